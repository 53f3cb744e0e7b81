"""Tasks: the GSM8K / MATH loaders and their errors, the arithmetic task's streams and formats, the warm-start
teacher (tests/tasks/test_verifiers.py checks the rewards' answer extraction)."""

import dataclasses
import json
import os
import re

import pytest

from hilore_jax.errors import ConfigError
from hilore_jax.tasks import task as tasks
from hilore_jax.tasks import verifiers
from hilore_jax.tasks.config import ArithmeticSpec, TaskConfig
import repo

SHARED = os.path.join(repo.ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")
SAMPLE = os.path.join(repo.DATA, "gsm8k_sample.jsonl")
GSM8K = SHARED if os.path.exists(SHARED) else SAMPLE


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_every_gsm8k_gold_solution_scores_one():
  examples, report = tasks.load_gsm8k(GSM8K)
  rows = _rows(GSM8K)
  assert report.loaded == len(rows) and report.skipped == 0
  if GSM8K == SHARED:
    assert len(rows) == 1319
  score = sum(verifiers.gsm8k_reward(r["answer"], e.reference) for r, e in zip(rows, examples))
  assert score == len(rows)


def test_changed_final_number_scores_zero():
  examples, _ = tasks.load_gsm8k(GSM8K)
  rows = _rows(GSM8K)
  for r, e in list(zip(rows, examples))[:200]:
    head, final = r["answer"].rsplit("####", 1)
    wrong = f"{head}#### {int(float(final.strip().replace(',', ''))) + 1}"
    assert verifiers.gsm8k_reward(wrong, e.reference) == 0.0


def test_malformed_line_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  good = json.dumps({"question": "q", "answer": "a\n#### 3"})
  path.write_text("\n".join([good, '{"question": "q"', good, json.dumps({"question": "q", "answer": "no marker"})]))
  with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed"):
    tasks.load_gsm8k(str(path))
  examples, report = tasks.load_gsm8k(str(path), skip_malformed=True)
  assert (report.loaded, report.skipped) == (2, 2) and [e.reference for e in examples] == ["3", "3"]


def test_arithmetic_task_is_seeded_and_disjoint():
  spec = ArithmeticSpec(seed=3, max_value=20, num_terms=3, ops=("+", "-"), num_test=17)
  a, b = tasks.arithmetic_task(spec), tasks.arithmetic_task(spec)
  assert a.train_batch(5, 7) == b.train_batch(5, 7)
  assert a.train_batch(0, 5) != tasks.arithmetic_task(ArithmeticSpec(seed=4, max_value=20)).train_batch(0, 5)
  test_prompts = {e.prompt for e in a.test_examples}
  assert len(test_prompts) == 17
  train = a.train_batch(0, 300)
  assert not test_prompts & {e.prompt for e in train}
  for e in train[:20]:
    assert e.prompt.endswith("=") and eval(e.prompt[:-1]) == e.reference
    assert a.reward(f"{e.reference}", e.reference) == 1.0
    assert a.reward(f"{e.reference + 1}", e.reference) == 0.0
  assert a.reward(" 12\nmore", 12) == 1.0 and a.reward("12abc", 12) == 0.0


def test_bad_arithmetic_spec():
  with pytest.raises(ValueError, match="ops"):
    ArithmeticSpec(ops=("/",))


def test_fixed_width_format():
  t = tasks.arithmetic_task(ArithmeticSpec(seed=1, max_value=99, fixed_width=True))
  for e in t.train_batch(0, 50):
    a, b = e.prompt[:-1].split("+")
    assert len(a) == len(b) == 2 and int(a) + int(b) == e.reference
    assert len(e.target) == 3 and int(e.target) == e.reference
    assert t.reward(e.target, e.reference) == 1.0  # '052' is 52


def test_question_format_asks_in_words_and_rewards_the_final_number():
  spec = ArithmeticSpec(seed=3, max_value=99, ops=("+", "-"), format="question")
  t = tasks.build_task(TaskConfig(arithmetic=spec, prompt_template="{question} Reply with a number."))
  for e in t.train_batch(0, 30) + list(t.test_examples[:30]):
    m = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\? Reply with a number\.", e.prompt)
    assert m, e.prompt
    a, op, b = int(m[1]), m[2], int(m[3])
    assert e.reference == (a + b if op == "+" else a - b) and e.target == str(e.reference)
    # free text: the final number counts, whatever precedes it
    assert t.reward(f"{a} {op} {b} = {e.reference}", e.reference) == 1.0
    assert t.reward(f"The answer is {e.reference}.", e.reference) == 1.0
    assert t.reward(f"{e.reference} or maybe {e.reference + 1}", e.reference) == 0.0
    assert t.reward("no idea", e.reference) == 0.0
  assert not {e.prompt for e in t.test_examples} & {e.prompt for e in t.train_batch(0, 500)}
  with pytest.raises(ConfigError, match="fixed_width and scratchpad apply to format=symbols only"):
    ArithmeticSpec(format="question", fixed_width=True)
  with pytest.raises(ConfigError, match="task.arithmetic.format must be one of"):
    ArithmeticSpec(format="prose")


def test_word_format_tells_two_step_stories_and_rewards_the_final_number():
  from hilore_jax.tasks.task import WORD_STORIES

  spec = ArithmeticSpec(seed=5, min_value=1, max_value=13, num_terms=3, ops=("+", "-"), format="word")
  t = tasks.build_task(TaskConfig(arithmetic=spec, prompt_template="{question} Think step by step."))
  seen = set()
  for e in t.train_batch(0, 200) + list(t.test_examples[:50]):
    assert e.prompt.endswith("? Think step by step.")
    a, b, c = map(int, re.findall(r"\d+", e.prompt))  # the story's three numbers, in order of use
    story = next(s for s in WORD_STORIES if re.fullmatch(re.sub(r"\\{[abcn]\\}", ".+?", re.escape(s[1])),
                                                       e.prompt[:-len(" Think step by step.")]))
    seen.add(story[1])
    first = a + b if story[0][0] == "+" else a - b
    assert first >= 0 and e.reference == (first + c if story[0][1] == "+" else first - c) >= 0
    assert t.reward(f"{a} and {b} and {c} give {e.reference}.", e.reference) == 1.0
    assert t.reward(f"{e.reference + 1}", e.reference) == 0.0
  assert len(seen) == len(WORD_STORIES)  # every story is drawn
  assert not {e.prompt for e in t.test_examples} & {e.prompt for e in t.train_batch(0, 500)}
  only_plus = tasks.arithmetic_task(ArithmeticSpec(num_terms=3, ops=("+",), format="word"))
  assert all(" fly away" not in e.prompt and " sold " not in e.prompt for e in only_plus.train_batch(0, 100))
  with pytest.raises(ConfigError, match="set num_terms: 3"):
    ArithmeticSpec(format="word")
  with pytest.raises(ConfigError, match="'\\+' and '-' only"):
    ArithmeticSpec(format="word", num_terms=3, ops=("*",))


def test_one_step_stories_mix_in_at_their_share_and_leave_the_two_step_stream_alone():
  from hilore_jax.tasks.task import WORD_STORIES_ONE

  spec = ArithmeticSpec(seed=5, min_value=1, max_value=10, num_terms=3, ops=("+", "-"), format="word")
  mixed = tasks.arithmetic_task(dataclasses.replace(spec, one_step_frac=0.5))
  one = 0
  for e in mixed.train_batch(0, 400):
    numbers = list(map(int, re.findall(r"\d+", e.prompt)))
    if len(numbers) == 2:  # a one-step story: its operation from its text, its result never negative
      one += 1
      a, b = numbers
      op = next(s[0] for s in WORD_STORIES_ONE
                if re.fullmatch(re.sub(r"\\{[abn]\\}", ".+?", re.escape(s[1])), e.prompt))
      assert e.reference == (a + b if op == "+" else a - b) >= 0
  assert 150 <= one <= 250  # about half of 400
  plain = tasks.arithmetic_task(spec)  # one_step_frac 0: the stream draws exactly as before
  assert all(len(re.findall(r"\d+", e.prompt)) == 3 for e in plain.train_batch(0, 200))
  with pytest.raises(ConfigError, match="one_step_frac mixes one-step stories into format=word"):
    ArithmeticSpec(one_step_frac=0.5)


def test_biased_teacher_changes_only_warmstart_targets():
  clean = tasks.arithmetic_task(ArithmeticSpec(seed=2, fixed_width=True))
  biased = tasks.arithmetic_task(ArithmeticSpec(seed=2, fixed_width=True, teacher_error_rate=0.6))
  a, b = clean.train_batch(0, 400), biased.train_batch(0, 400)
  assert [e.prompt for e in a] == [e.prompt for e in b] and [e.reference for e in a] == [e.reference for e in b]
  wrong = [e for e in b if int(e.target) != e.reference]
  assert 0.5 < len(wrong) / 400 < 0.7
  assert all(int(e.target) == e.reference + 1 and len(e.target) == 3 for e in wrong)
  assert all(e.target == str(e.reference).zfill(3) for e in a)
  assert clean.test_examples == biased.test_examples


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_json_number_answers_load(tmp_path):
  path = _write_jsonl(tmp_path / "nums.jsonl", [{"prompt": "p", "answer": 42},
                                                {"prompt": "q", "answer": 2.5, "solution": "s"}])
  a, b = tasks.iter_jsonl_examples(path, "math")
  assert (a.reference, a.target, b.reference, b.target) == ("42", None, "2.5", "s")
  assert verifiers.math_reward("\\boxed{42}", a.reference) == 1.0 and verifiers.math_reward("$5/2$", b.reference) == 1.0
  path = _write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": 18},
                                               {"question": "r", "answer": "a\n#### 3"}])
  examples, report = tasks.load_gsm8k(path)
  assert report.loaded == 2 and [(e.reference, e.target) for e in examples] == [("18", None), ("3", "a\n#### 3")]
  assert verifiers.gsm8k_reward("so #### 18", examples[0].reference) == 1.0


@pytest.mark.parametrize("bad", [[1], {"x": 1}, True, None])
def test_non_string_answer_names_file_and_line(tmp_path, bad):
  kind = type(bad).__name__
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "1"}, {"prompt": "p", "answer": bad}])
  with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*field 'answer' must be a string or a number, got {kind}"):
    list(tasks.iter_jsonl_examples(path, "math"))
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": bad}])
  with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*field 'answer' must be a string or a number, got {kind}"):
    tasks.load_gsm8k(path)
  assert tasks.load_gsm8k(path, skip_malformed=True)[1].skipped == 1


def test_bad_references_raise_not_score_zero(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "1"}, {"prompt": "p", "answer": "2"},
                                               {"prompt": "p", "answer": "\\text{}"}])
  with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed math line: math reference"):
    list(tasks.iter_jsonl_examples(path, "math"))
  with pytest.raises(ValueError, match="does not parse"):
    verifiers.math_reward("\\boxed{1}", "")
  with pytest.raises(ValueError, match="is not a number"):
    verifiers.gsm8k_reward("#### 1", "one")


def test_scratchpad_targets_vary_in_length_and_the_reward_reads_the_answer():
  assert tasks._work([3, 5], ["+"]) == "3,3,3,3,3,3" and tasks._work([86, 30], ["+"]) == "86"
  assert tasks._work([7, 45], ["+"]) == ",".join(["07"] * 6)
  spec = ArithmeticSpec(fixed_width=True, scratchpad=True, teacher_error_rate=0.5)
  task = tasks.arithmetic_task(spec)
  examples = [task.train_example(i) for i in range(200)]
  lengths = {len(e.target) for e in examples}
  assert min(lengths) <= 6 and max(lengths) >= 30  # 3 digits, '#', 1 to 10 copies of the first operand
  for e in examples:
    answer, work = e.target.split("#")
    assert work == tasks._work([int(x) for x in e.prompt[:-1].split("+")], ["+"])  # the teacher's bias: answer only
    assert int(answer) in (e.reference, e.reference + 1)
    assert task.reward(e.target, e.reference) == float(int(answer) == e.reference)
  assert verifiers.scratchpad_reward("052#07,07\nmore", 52) == 1.0
  assert verifiers.scratchpad_reward("052", 52) == 1.0  # the tail is optional
  assert verifiers.scratchpad_reward("07#052", 52) == 0.0  # the answer comes first
  with pytest.raises(Exception, match="scratchpad"):
    ArithmeticSpec(scratchpad=True, ops=("+", "*"))
