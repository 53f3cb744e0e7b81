"""Verifiable tasks: prompts with references and a reward function (completion, reference) -> float."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Iterator, Sequence

from hilore_jax.config import ArithmeticSpec, TaskConfig

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


def _arith_problem(spec: ArithmeticSpec, rng: random.Random) -> Example:
  terms = [rng.randint(spec.min_value, spec.max_value) for _ in range(spec.num_terms)]
  width = len(str(spec.max_value)) if spec.fixed_width else 0
  ops = [rng.choice(spec.ops) for _ in terms[1:]]
  expr = str(terms[0])
  for op, t in zip(ops, terms[1:]):
    expr += op + str(t)
  value = eval(expr)  # expr holds only digits and + - *
  shown = str(terms[0]).zfill(width) + "".join(op + str(t).zfill(width) for op, t in zip(ops, terms[1:]))
  target = str(value).zfill(_answer_width(spec)) if spec.fixed_width and value >= 0 else str(value)
  return Example(prompt=shown + "=", reference=value, target=target)


def arithmetic_reward(completion: str, reference: int) -> float:
  """1.0 when the completion (up to the first newline) is exactly the integer answer."""
  text = completion.strip().split("\n")[0].strip()
  return 1.0 if re.fullmatch(r"-?\d+", text) and int(text) == int(reference) else 0.0


def arithmetic_task(spec: ArithmeticSpec) -> Task:
  """Synthetic arithmetic ('12+35=' -> '47'); test prompts never appear in the training stream."""
  test_rng = random.Random(f"test-{spec.seed}")
  test: dict[str, Example] = {}
  max_distinct = (spec.max_value - spec.min_value + 1) ** spec.num_terms * len(spec.ops) ** (spec.num_terms - 1)
  while len(test) < min(spec.num_test, max_distinct // 4):
    ex = _arith_problem(spec, test_rng)
    test[ex.prompt] = ex

  def train_example(i: int) -> Example:
    rng = random.Random(f"train-{spec.seed}-{i}")
    while True:
      ex = _arith_problem(spec, rng)
      if ex.prompt not in test:
        break
    if spec.teacher_error_rate and rng.random() < spec.teacher_error_rate:
      # a biased teacher: the reference (and so GRPO's reward) stays exact, only the imitation target is off
      ex = dataclasses.replace(ex, target=str(ex.reference + 1).zfill(len(ex.target)))
    return ex

  return Task("arithmetic", train_example, list(test.values()), arithmetic_reward)


# ----------------------------------------------------------------------------- GSM8K

_NUMBER = r"-?[\d,]*\.?\d+"


def _to_number(text: str) -> Decimal | None:
  text = text.replace(",", "").replace("$", "").strip().rstrip(".")
  try:
    return Decimal(text)
  except InvalidOperation:
    return None


def extract_gsm8k_answer(completion: str) -> Decimal | None:
  """Final number of a completion: \\boxed{...}, else after the last '####', else the last number."""
  boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
  if boxed:
    nums = re.findall(_NUMBER, boxed[-1])
    return _to_number(nums[-1]) if nums else None
  if "####" in completion:
    nums = re.findall(_NUMBER, completion.rsplit("####", 1)[1])
    if nums:
      return _to_number(nums[0])
  nums = re.findall(_NUMBER, completion)
  return _to_number(nums[-1]) if nums else None


def gsm8k_reward(completion: str, reference: str) -> float:
  """1.0 when the completion's final number equals the reference answer."""
  got, want = extract_gsm8k_answer(completion), _to_number(reference)
  return 1.0 if got is not None and want is not None and got == want else 0.0


@dataclasses.dataclass
class LoadReport:
  path: str
  loaded: int = 0
  skipped: int = 0


def load_gsm8k(path: str, skip_malformed: bool = False, prompt_template: str = "{question}\n") -> tuple[list[Example], LoadReport]:
  """GSM8K JSONL ({question, answer with '#### N'}); a malformed line raises with file:line unless skipped."""
  examples, report = [], LoadReport(path)
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
          raise ValueError("expected an object with string fields 'question' and 'answer'")
        if "####" not in row["answer"]:
          raise ValueError("answer has no '#### <number>' final answer")
        final = row["answer"].rsplit("####", 1)[1].strip()
        if _to_number(final) is None:
          raise ValueError(f"final answer {final!r} is not a number")
      except ValueError as e:  # json.JSONDecodeError is a ValueError
        if skip_malformed:
          report.skipped += 1
          continue
        raise ValueError(f"{path}:{lineno}: malformed GSM8K line: {e}") from None
      examples.append(Example(prompt_template.format(question=row["question"]), final.replace(",", ""),
                              target=row["answer"]))
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


# ----------------------------------------------------------------------------- MATH-style


def math_reward(completion: str, reference: str) -> float:
  """1.0 when math-verify finds the completion's answer equal to the reference (e.g. \\frac{14}{3} == 14/3)."""
  from math_verify import parse, verify

  gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$")
  pred = parse(completion)
  return 1.0 if gold and pred and verify(gold, pred) else 0.0


REWARDS = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_reward, "math": math_reward}


def iter_jsonl_examples(path: str, reward_kind: str) -> Iterator[Example]:
  """Generic JSONL of {prompt, answer} rows (for MATH-style sets)."""
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          row = json.loads(line)
          yield Example(row["prompt"], row["answer"], row.get("solution"))
        except (ValueError, KeyError, TypeError) as e:
          raise ValueError(f"{path}:{lineno}: malformed {reward_kind} line: {e!r}") from None


# ----------------------------------------------------------------------------- from config


def build_task(tc: TaskConfig) -> Task:
  """The task a config names (JSONL files are read here)."""
  if tc.kind == "arithmetic":
    return arithmetic_task(tc.arithmetic)
  if tc.kind == "gsm8k":
    train, rep = load_gsm8k(tc.train_path, tc.skip_malformed, tc.prompt_template)
    test, rep_t = load_gsm8k(tc.test_path, tc.skip_malformed, tc.prompt_template)
    for r in (rep, rep_t):
      if r.skipped:
        log.warning("%s: skipped %d malformed lines (task.skip_malformed=true)", r.path, r.skipped)
    return dataset_task("gsm8k", train, test, gsm8k_reward, tc.seed)
  train = list(iter_jsonl_examples(tc.train_path, "math"))
  test = list(iter_jsonl_examples(tc.test_path, "math"))
  return dataset_task("math", train, test, math_reward, tc.seed)
