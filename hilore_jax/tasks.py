"""Verifiable tasks: prompts with references and a reward function (completion, reference) -> float."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import random
import re
import threading
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
  text = completion[:MAX_ANSWER_CHARS].strip().split("\n")[0].strip()
  # a bounded length keeps int() linear and within Python's digit limit (it raises past 4300 digits)
  if len(text) > 64 or not re.fullmatch(r"-?\d+", text):
    return 0.0
  return 1.0 if int(text) == int(reference) else 0.0


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


# ----------------------------------------------------------------------------- answer extraction

# Extractors read only a completion's last MAX_ANSWER_CHARS characters: the final answer sits at the end, real
# answers are far shorter (the longest GSM8K gold solution is ~1.2k characters), and it bounds what any completion
# can cost a training step, math-verify included.
MAX_ANSWER_CHARS = 4096
# math-verify's own parse and verify timeouts (whole seconds, signal based, so main thread only); a real answer takes
# milliseconds.
MATH_VERIFY_TIMEOUT_S = 2

_DIGITS = frozenset("0123456789")
_DIGITS_COMMAS = frozenset("0123456789,")
_BOX_MACROS = ("\\boxed", "\\fbox")


def _tail(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
  return text[len(text) - max_chars:] if len(text) > max_chars else text


def find_numbers(text: str) -> list[str]:
  """Every number token, left to right, as re.findall(r"-?[\\d,]*\\.?\\d+") finds them, in linear time."""
  # The regex backtracks quadratically over a long run of commas; this scanner reads each character a bounded
  # number of times. ASCII digits only: Decimal cannot read every Unicode digit that \d matches (e.g. '²').
  out, i, n = [], 0, len(text)
  while i < n:
    j = i + 1 if text[i] == "-" else i
    k, last_digit = j, -1
    while k < n and text[k] in _DIGITS_COMMAS:
      if text[k] != ",":
        last_digit = k
      k += 1
    if k + 1 < n and text[k] == "." and text[k + 1] in _DIGITS:
      end = k + 2
      while end < n and text[end] in _DIGITS:
        end += 1
      out.append(text[i:end])
      i = end
    elif last_digit >= 0:  # trailing commas (and a dot without digits after it) are not part of the number
      out.append(text[i:last_digit + 1])
      i = last_digit + 1
    else:  # no number starts anywhere in a digitless run of commas either, so skip it whole
      i = max(k, i + 1)
  return out


def last_boxed(text: str) -> str | None:
  """Content of the last closed \\boxed{...} or \\fbox{...} (braces matched, \\{ \\} skipped); None if none closes."""
  open_groups: list[tuple[int, bool]] = []  # (content start, opens a box) for every unclosed '{'
  found, i, n = None, 0, len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      macro = next((m for m in _BOX_MACROS if text.startswith(m, i)), None)
      if macro:
        j = i + len(macro)
        while j < n and text[j] == " ":
          j += 1
        if j < n and text[j] == "{":
          open_groups.append((j + 1, True))
          i = j + 1
          continue
      i += 2  # the escaped character (\{, \}, \\) or a macro's first letter never opens or closes a group
      continue
    if c == "{":
      open_groups.append((i + 1, False))
    elif c == "}" and open_groups:
      start, is_box = open_groups.pop()
      if is_box:  # boxes close in text order, so the last one closed wins (the outer one when nested)
        found = (start, i)
    i += 1
  return text[found[0]:found[1]] if found else None


# ----------------------------------------------------------------------------- GSM8K

_FRAC = re.compile(r"(-?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")  # [^{}]* stops at the next brace: no backtracking


def _to_number(text: str) -> Decimal | None:
  text = text.replace(",", "").replace("$", "").strip().rstrip(".")
  try:
    value = Decimal(text)
  except InvalidOperation:
    return None
  return value if value.is_finite() else None  # 'NaN' never equals anything, and 'sNaN' raises when compared


def _boxed_number(content: str) -> Decimal | None:
  """The number in a \\boxed{...}: a plain \\frac{a}{b}, else the last number once braces and thin spaces go."""
  frac = _FRAC.fullmatch(content.strip())
  if frac:
    num, den = _to_number(frac[2]), _to_number(frac[3])
    if num is None or den is None or den == 0:
      return None
    return -(num / den) if frac[1] else num / den
  # '1{,}000' and '1\,000' are LaTeX thousands separators; '\text{18}' is 18
  flat = content.replace("\\,", "").replace("\\!", "").replace("{", "").replace("}", "")
  nums = find_numbers(flat)
  return _to_number(nums[-1]) if nums else None


def extract_gsm8k_answer(completion: str, max_chars: int = MAX_ANSWER_CHARS) -> Decimal | None:
  """Final number in the last max_chars: the last \\boxed{...}, else after the last '####', else the last number."""
  text = _tail(completion, max_chars)
  boxed = last_boxed(text)
  if boxed is not None:
    return _boxed_number(boxed)
  if "####" in text:
    nums = find_numbers(text.rsplit("####", 1)[1])
    if nums:
      return _to_number(nums[0])
  nums = find_numbers(text)
  return _to_number(nums[-1]) if nums else None


def _gsm8k_reference(reference: str) -> Decimal:
  want = _to_number(str(reference))
  if want is None:
    raise ValueError(f"GSM8K reference {reference!r} is not a number")
  return want


def gsm8k_reward(completion: str, reference: str) -> float:
  """1.0 when the completion's final number equals the reference answer; a bad reference raises (a data error)."""
  want = _gsm8k_reference(reference)
  try:
    got = extract_gsm8k_answer(completion)
  except Exception:  # no completion may stop a training step; a model's text earns 0.0, never an exception
    return 0.0
  return 1.0 if got is not None and got == want else 0.0


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
        if _to_number(final) is None:
          raise ValueError(f"final answer {final!r} is not a number")
      except ValueError as e:  # json.JSONDecodeError is a ValueError
        if skip_malformed:
          report.skipped += 1
          continue
        raise ValueError(f"{path}:{lineno}: malformed GSM8K line: {e}") from None
      examples.append(Example(prompt_template.format(question=question), final.replace(",", ""), target=target))
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


def _has_math_mode(text: str) -> bool:
  """True when text has a '$' that opens math mode: one not escaped by an odd run of backslashes ('\\$5' is money)."""
  backslashes = 0
  for c in text:
    if c == "$" and backslashes % 2 == 0:
      return True
    backslashes = backslashes + 1 if c == "\\" else 0
  return False


def _math_timeout_s() -> int | None:
  # math-verify times out with SIGALRM, which Python allows only on the main thread; elsewhere it would raise
  return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_parse(text: str, wrap: bool) -> list:
  """math-verify's reading of text's last boxed answer, else of the whole text ($-wrapped if wrap and not in math)."""
  from math_verify import parse

  boxed = last_boxed(text)
  if boxed is not None:  # only the last box counts (math-verify would read every box as a set) and \fbox too
    found = parse(f"$\\boxed{{{boxed}}}$", parsing_timeout=_math_timeout_s())
    if found:
      return found
  return parse(f"${text}$" if wrap and not _has_math_mode(text) else text, parsing_timeout=_math_timeout_s())


@functools.lru_cache(maxsize=1 << 16)
def _math_gold(reference: str) -> list:
  """The parsed reference (cached: every rollout of a prompt reads it); one math-verify cannot read is a data error."""
  gold = _math_parse(reference, wrap=True)
  if not gold:
    raise ValueError(f"math reference {reference[:200]!r} does not parse")
  return gold


def math_reward(completion: str, reference: str) -> float:
  """1.0 when math-verify finds the completion's answer equal to the reference (e.g. \\frac{14}{3} == 14/3)."""
  from math_verify import verify
  from math_verify.errors import TimeoutException

  gold = _math_gold(reference)  # raises for a bad reference: a data error is not a wrong answer
  try:
    pred = _math_parse(_tail(completion), wrap=False)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=_math_timeout_s()) else 0.0
  except (Exception, TimeoutException):  # a BaseException; no completion may stop a training step
    return 0.0


REWARDS = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_reward, "math": math_reward}
_REFERENCE_CHECKS = {"arithmetic": int, "gsm8k": _gsm8k_reference, "math": _math_gold}  # each raises ValueError


def iter_jsonl_examples(path: str, reward_kind: str) -> Iterator[Example]:
  """Generic JSONL of {prompt, answer (string or number), solution?} rows (for MATH-style sets), references checked."""
  if reward_kind not in REWARDS:
    raise ValueError(f"unknown reward kind {reward_kind!r}, expected one of {sorted(REWARDS)}")
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          row = json.loads(line)
          prompt, answer = _field(row, "prompt"), _field(row, "answer", numbers=True)
          solution = _field(row, "solution", required=False)
          _REFERENCE_CHECKS[reward_kind](answer)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
          raise ValueError(f"{path}:{lineno}: malformed {reward_kind} line: {e}") from None
        yield Example(prompt, answer, solution)


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
