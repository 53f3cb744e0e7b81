"""Verifiable tasks: a training stream of prompts with references, a test split, and the task's verifier
(verifiers.py); synthetic arithmetic, GSM8K and MATH-style JSONL loaders that name file:line on a bad line."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from typing import Any, Callable, Iterator, Sequence

from hilore_jax.errors import DataError
from hilore_jax.tasks import verifiers
from hilore_jax.tasks.config import ArithmeticSpec, TaskConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  reference: Any
  target: str | None = None  # a gold completion, for the supervised warm-start


@dataclasses.dataclass
class Task:
  """A task: a training stream indexed by position, a fixed test split, and a verifier."""

  name: str
  train_example: Callable[[int], Example]  # position -> example, so a data position resumes exactly
  test_examples: Sequence[Example]
  reward: Callable[[str, Any], float]
  num_train: int | None = None  # None: unbounded stream

  def train_batch(self, start: int, n: int) -> list[Example]:
    return [self.train_example(i) for i in range(start, start + n)]


# ----------------------------------------------------------------------------- synthetic arithmetic


def _answer_width(spec: ArithmeticSpec) -> int:
  hi = spec.max_value
  biggest = max(hi * spec.num_terms, hi**spec.num_terms if "*" in spec.ops else 0)
  return len(str(biggest)) + ("-" in spec.ops)


# Stories for format=word: (ops, text) with {n} a name, {a} {b} {c} the numbers in order of use; every intermediate
# result of a story stays >= 0 (numbers are redrawn until it does), so each one reads as a real situation.
WORD_STORIES = (
    (("+", "-"), "{n} has {a} marbles. {n} wins {b} more and then gives {c} to a friend. "
                 "How many marbles does {n} have now?"),
    (("-", "-"), "A shop had {a} apples. It sold {b} in the morning and {c} in the afternoon. "
                 "How many apples are left?"),
    (("+", "+"), "{n} read {a} pages on Monday, {b} pages on Tuesday and {c} pages on Wednesday. "
                 "How many pages did {n} read in all?"),
    (("-", "+"), "There are {a} birds on a tree. {b} fly away and then {c} more land on it. "
                 "How many birds are on the tree now?"),
    (("-", "+"), "{n} had {a} dollars, spent {b} dollars on lunch and then earned {c} dollars. "
                 "How many dollars does {n} have now?"),
    (("+", "-"), "A bus has {a} people on it. At the first stop {b} people get on, and at the second stop {c} "
                 "people get off. How many people are on the bus now?"),
    (("-", "-"), "{n} baked {a} cookies, ate {b} of them and gave {c} to the neighbours. "
                 "How many cookies are left?"),
    (("+", "+"), "A farm has {a} cows, {b} sheep and {c} goats. How many animals does the farm have?"),
)
# One-step stories (task.arithmetic.one_step_frac): (op, text) with {a} {b}; a '-' story's result stays >= 0.
WORD_STORIES_ONE = (
    ("+", "{n} has {a} marbles and wins {b} more. How many marbles does {n} have now?"),
    ("-", "A shop had {a} apples and sold {b} of them. How many apples are left?"),
    ("+", "{n} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {n} read in all?"),
    ("-", "There are {a} birds on a tree and {b} fly away. How many birds are on the tree now?"),
)
WORD_NAMES = ("Mia", "Sam", "Ava", "Leo", "Zoe", "Ben", "Ivy", "Max")


def _one_step_problem(spec: ArithmeticSpec, rng: random.Random, template: str) -> Example:
  stories = [s for s in WORD_STORIES_ONE if s[0] in spec.ops]
  op, text = stories[rng.randrange(len(stories))]
  a, b = (rng.randint(spec.min_value, spec.max_value) for _ in range(2))
  a, b = (a, b) if op == "+" else (max(a, b), min(a, b))
  value = a + b if op == "+" else a - b
  question = text.format(n=WORD_NAMES[rng.randrange(len(WORD_NAMES))], a=a, b=b)
  return Example(prompt=template.replace("{question}", question), reference=value, target=str(value))


def _word_problem(spec: ArithmeticSpec, rng: random.Random, template: str) -> Example:
  # the draw only where one-step stories are asked for: streams without them stay as they were
  if spec.one_step_frac and rng.random() < spec.one_step_frac:
    return _one_step_problem(spec, rng, template)
  stories = [s for s in WORD_STORIES if set(s[0]) <= set(spec.ops)]
  ops, text = stories[rng.randrange(len(stories))]
  while True:
    a, b, c = (rng.randint(spec.min_value, spec.max_value) for _ in range(3))
    first = a + b if ops[0] == "+" else a - b
    value = first + c if ops[1] == "+" else first - c
    if first >= 0 and value >= 0:
      break
  question = text.format(n=WORD_NAMES[rng.randrange(len(WORD_NAMES))], a=a, b=b, c=c)
  return Example(prompt=template.replace("{question}", question), reference=value, target=str(value))


def _arith_problem(spec: ArithmeticSpec, rng: random.Random, template: str = "{question}") -> Example:
  if spec.format == "word":
    return _word_problem(spec, rng, template)
  terms = [rng.randint(spec.min_value, spec.max_value) for _ in range(spec.num_terms)]
  width = len(str(spec.max_value)) if spec.fixed_width else 0
  ops = [rng.choice(spec.ops) for _ in terms[1:]]
  expr = str(terms[0])
  for op, t in zip(ops, terms[1:]):
    expr += op + str(t)
  value = eval(expr)  # expr holds only digits and + - *
  shown = str(terms[0]).zfill(width) + "".join(op + str(t).zfill(width) for op, t in zip(ops, terms[1:]))
  target = str(value).zfill(_answer_width(spec)) if spec.fixed_width and value >= 0 else str(value)
  if spec.scratchpad:
    target = target + "#" + _work(terms, ops)
  if spec.format == "question":
    question = f"What is {terms[0]}" + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:])) + "?"
    return Example(prompt=template.replace("{question}", question), reference=value, target=str(value))
  return Example(prompt=shown + "=", reference=value, target=target)


def _work(terms: Sequence[int], ops: Sequence[str]) -> str:
  """A tail whose length varies with the problem: the first operand once, and once more per unit of each later
  operand's last digit ('3', '+', '5' -> '3,3,3,3,3,3'). A stand-in for reasoning length, written after the answer
  (three formats with harder or earlier work left the bench's 6-layer model at 0-5% reward, every group the same)."""
  return ",".join([str(terms[0]).zfill(len(str(max(terms))))] * (1 + sum(t % 10 for t in terms[1:])))


def arithmetic_task(spec: ArithmeticSpec, template: str = "{question}") -> Task:
  """Synthetic arithmetic ('12+35=' -> '47', or 'What is 12 + 35?' through template); test prompts never appear in
  the training stream."""
  test_rng = random.Random(f"test-{spec.seed}")
  test: dict[str, Example] = {}
  max_distinct = (spec.max_value - spec.min_value + 1) ** spec.num_terms * len(spec.ops) ** (spec.num_terms - 1)
  while len(test) < min(spec.num_test, max_distinct // 4):
    ex = _arith_problem(spec, test_rng, template)
    test[ex.prompt] = ex

  def train_example(i: int) -> Example:
    rng = random.Random(f"train-{spec.seed}-{i}")
    while True:
      ex = _arith_problem(spec, rng, template)
      if ex.prompt not in test:
        break
    if spec.teacher_error_rate and rng.random() < spec.teacher_error_rate:
      # a biased teacher: the reference (and so GRPO's reward) stays exact, only the imitation target is off
      answer, tail = ex.target.partition("#")[::2]
      wrong = str(ex.reference + 1).zfill(len(answer))
      ex = dataclasses.replace(ex, target=wrong + "#" + tail if spec.scratchpad else wrong)
    return ex

  reward = verifiers.scratchpad_reward if spec.scratchpad else verifiers.arithmetic_reward
  if spec.format in ("question", "word"):
    reward = lambda completion, reference: verifiers.gsm8k_reward(completion, str(reference))  # its final number
  return Task("arithmetic", train_example, list(test.values()), reward)


@dataclasses.dataclass
class LoadReport:
  path: str
  loaded: int = 0
  skipped: int = 0


def _field(row: Any, name: str, numbers: bool = False, required: bool = True) -> str | None:
  """A JSONL field as a string; a JSON number becomes its string form where numbers are allowed."""
  if not isinstance(row, dict):
    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
  value = row.get(name)
  if value is None and not required:
    return None
  if isinstance(value, str):
    return value
  # bool is an int in Python, but JSON true/false is no answer
  if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
    if not math.isfinite(value):
      raise ValueError(f"field {name!r} must be a finite number, got {value}")
    return str(value)
  if name not in row:
    raise ValueError(f"missing field {name!r}")
  kind = "a string or a number" if numbers else "a string"
  raise ValueError(f"field {name!r} must be {kind}, got {type(value).__name__} {value!r:.40}")


def load_gsm8k(path: str, skip_malformed: bool = False,
               prompt_template: str = "{question}\n") -> tuple[list[Example], LoadReport]:
  """GSM8K JSONL ({question, answer with '#### N' or a bare number}); a malformed line raises with file:line."""
  examples, report = [], LoadReport(path)
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        question, answer = _field(row, "question"), _field(row, "answer", numbers=True)
        if isinstance(row["answer"], str):
          if "####" not in answer:
            raise ValueError("answer has no '#### <number>' final answer")
          final, target = answer.rsplit("####", 1)[1].strip(), answer
        else:  # a bare number is the final answer alone: no worked solution to warm-start on
          final, target = answer, None
        if verifiers.to_number(final) is None:
          raise ValueError(f"final answer {final!r} is not a number")
      except ValueError as e:  # json.JSONDecodeError is a ValueError
        if skip_malformed:
          report.skipped += 1
          continue
        raise DataError(f"{path}:{lineno}: malformed GSM8K line: {e}") from None
      # replace, not str.format: '\\boxed{}' in an instruction is text, not a format field
      prompt = prompt_template.replace("{question}", question)
      examples.append(Example(prompt, final.replace(",", ""), target=target))
      report.loaded += 1
  return examples, report


def dataset_task(name: str, train: Sequence[Example], test: Sequence[Example], reward, seed: int = 0) -> Task:
  """A task over a finite dataset; the training stream reshuffles every epoch, deterministically."""

  def train_example(i: int) -> Example:
    epoch, j = divmod(i, len(train))
    order = list(range(len(train)))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return train[order[j]]

  return Task(name, train_example, list(test), reward, num_train=len(train))


def iter_jsonl_examples(path: str, reward_kind: str) -> Iterator[Example]:
  """Generic JSONL of {prompt, answer (string or number), solution?} rows (for MATH-style sets), references checked."""
  if reward_kind not in verifiers.REWARDS:
    raise ValueError(f"unknown reward kind {reward_kind!r}, expected one of {sorted(verifiers.REWARDS)}")
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          row = json.loads(line)
          prompt, answer = _field(row, "prompt"), _field(row, "answer", numbers=True)
          solution = _field(row, "solution", required=False)
          verifiers.REFERENCE_CHECKS[reward_kind](answer)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
          raise DataError(f"{path}:{lineno}: malformed {reward_kind} line: {e}") from None
        yield Example(prompt, answer, solution)


# ----------------------------------------------------------------------------- from config


def build_task(tc: TaskConfig) -> Task:
  """The task a config names (JSONL files are read here)."""
  if tc.kind == "arithmetic":
    words = tc.arithmetic.format in ("question", "word")
    return arithmetic_task(tc.arithmetic, tc.prompt_template if words else "{question}")
  if tc.kind == "gsm8k":
    train, rep = load_gsm8k(tc.train_path, tc.skip_malformed, tc.prompt_template)
    test, rep_t = load_gsm8k(tc.test_path, tc.skip_malformed, tc.prompt_template)
    for r in (rep, rep_t):
      if r.skipped:
        log.warning("%s: skipped %d malformed lines (task.skip_malformed=true)", r.path, r.skipped)
    return dataset_task("gsm8k", train, test, verifiers.gsm8k_reward, tc.seed)
  train = list(iter_jsonl_examples(tc.train_path, "math"))
  test = list(iter_jsonl_examples(tc.test_path, "math"))
  return dataset_task("math", train, test, verifiers.math_reward, tc.seed)
