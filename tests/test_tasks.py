import json
import os

import pytest

from hilore_jax import tasks

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "test.jsonl")
SAMPLE = os.path.join(os.path.dirname(__file__), "data", "gsm8k_sample.jsonl")
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
  score = sum(tasks.gsm8k_reward(r["answer"], e.reference) for r, e in zip(rows, examples))
  assert score == len(rows)


def test_changed_final_number_scores_zero():
  examples, _ = tasks.load_gsm8k(GSM8K)
  rows = _rows(GSM8K)
  for r, e in list(zip(rows, examples))[:200]:
    head, final = r["answer"].rsplit("####", 1)
    wrong = f"{head}#### {int(float(final.strip().replace(',', ''))) + 1}"
    assert tasks.gsm8k_reward(wrong, e.reference) == 0.0


@pytest.mark.parametrize("completion,expected", [
    ("so the total is 1,234 dollars.", "1234"),
    ("The answer is \\boxed{42}. (Not 7.)", "42"),
    ("work: 3+4=7\n#### 7\nthanks 99", "7"),
    ("it costs $18.", "18"),
    ("-5 degrees", "-5"),
    ("about 2.50", "2.5"),
])
def test_answer_extraction(completion, expected):
  assert tasks.gsm8k_reward(completion, expected) == 1.0
  assert tasks.gsm8k_reward(completion, "13") == 0.0


def test_no_number_scores_zero():
  assert tasks.gsm8k_reward("I do not know", "3") == 0.0


def test_malformed_line_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  good = json.dumps({"question": "q", "answer": "a\n#### 3"})
  path.write_text("\n".join([good, '{"question": "q"', good, json.dumps({"question": "q", "answer": "no marker"})]))
  with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed"):
    tasks.load_gsm8k(str(path))
  examples, report = tasks.load_gsm8k(str(path), skip_malformed=True)
  assert (report.loaded, report.skipped) == (2, 2) and [e.reference for e in examples] == ["3", "3"]


def test_math_verify_equivalence():
  assert tasks.math_reward("Thus $\\boxed{\\frac{14}{3}}$", "14/3") == 1.0
  assert tasks.math_reward("the answer is $14/3$", "\\frac{14}{3}") == 1.0
  assert tasks.math_reward("Thus $\\boxed{\\frac{14}{5}}$", "14/3") == 0.0


def test_arithmetic_task_is_seeded_and_disjoint():
  spec = tasks.ArithmeticSpec(seed=3, max_value=20, num_terms=3, ops=("+", "-"), num_test=17)
  a, b = tasks.arithmetic_task(spec), tasks.arithmetic_task(spec)
  assert a.train_batch(5, 7) == b.train_batch(5, 7)
  assert a.train_batch(0, 5) != tasks.arithmetic_task(tasks.ArithmeticSpec(seed=4, max_value=20)).train_batch(0, 5)
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
    tasks.ArithmeticSpec(ops=("/",))


def test_fixed_width_format():
  t = tasks.arithmetic_task(tasks.ArithmeticSpec(seed=1, max_value=99, fixed_width=True))
  for e in t.train_batch(0, 50):
    a, b = e.prompt[:-1].split("+")
    assert len(a) == len(b) == 2 and int(a) + int(b) == e.reference
    assert len(e.target) == 3 and int(e.target) == e.reference
    assert t.reward(e.target, e.reference) == 1.0  # '052' is 52


def test_biased_teacher_changes_only_warmstart_targets():
  clean = tasks.arithmetic_task(tasks.ArithmeticSpec(seed=2, fixed_width=True))
  biased = tasks.arithmetic_task(tasks.ArithmeticSpec(seed=2, fixed_width=True, teacher_error_rate=0.6))
  a, b = clean.train_batch(0, 400), biased.train_batch(0, 400)
  assert [e.prompt for e in a] == [e.prompt for e in b] and [e.reference for e in a] == [e.reference for e in b]
  wrong = [e for e in b if int(e.target) != e.reference]
  assert 0.5 < len(wrong) / 400 < 0.7
  assert all(int(e.target) == e.reference + 1 and len(e.target) == 3 for e in wrong)
  assert all(e.target == str(e.reference).zfill(3) for e in a)
  assert clean.test_examples == biased.test_examples
