"""Verifiers: reward(completion, reference) -> float for each task, and the answer extraction behind them.

Every extractor runs in linear time on the last MAX_ANSWER_CHARS characters of a completion, and a reward never
raises on any completion string (a bad *reference* is a data error, raised when the data is loaded).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from decimal import Decimal, InvalidOperation


def arithmetic_reward(completion: str, reference: int) -> float:
  """1.0 when the completion (up to the first newline) is exactly the integer answer."""
  text = completion[:MAX_ANSWER_CHARS].strip().split("\n")[0].strip()
  # a bounded length keeps int() linear and within Python's digit limit (it raises past 4300 digits)
  if len(text) > 64 or not re.fullmatch(r"-?\d+", text):
    return 0.0
  return 1.0 if int(text) == int(reference) else 0.0


def scratchpad_reward(completion: str, reference: int) -> float:
  """arithmetic_reward of the completion's text before its first '#' (the answer; what follows is the work)."""
  return arithmetic_reward(completion[:MAX_ANSWER_CHARS].split("\n")[0].split("#")[0], reference)


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


def to_number(text: str) -> Decimal | None:
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
    num, den = to_number(frac[2]), to_number(frac[3])
    if num is None or den is None or den == 0:
      return None
    return -(num / den) if frac[1] else num / den
  # '1{,}000' and '1\,000' are LaTeX thousands separators; '\text{18}' is 18
  flat = content.replace("\\,", "").replace("\\!", "").replace("{", "").replace("}", "")
  nums = find_numbers(flat)
  return to_number(nums[-1]) if nums else None


def extract_gsm8k_answer(completion: str, max_chars: int = MAX_ANSWER_CHARS) -> Decimal | None:
  """Final number in the last max_chars: the last \\boxed{...}, else after the last '####', else the last number."""
  text = _tail(completion, max_chars)
  boxed = last_boxed(text)
  if boxed is not None:
    return _boxed_number(boxed)
  if "####" in text:
    nums = find_numbers(text.rsplit("####", 1)[1])
    if nums:
      return to_number(nums[0])
  nums = find_numbers(text)
  return to_number(nums[-1]) if nums else None


def _gsm8k_reference(reference: str) -> Decimal:
  want = to_number(str(reference))
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


@functools.lru_cache(maxsize=1)
def _warm_math_verify() -> None:
  """One untimed parse and verify: math-verify builds its parsers on first use (seconds on a busy CPU), which must
  not count against the first real answer's timeout and turn a good reference into a 'does not parse' data error."""
  from math_verify import parse, verify

  quiet = logging.getLogger("math_verify")  # it warns that an untimed call could hang: this one is a constant
  level = quiet.level
  quiet.setLevel(logging.ERROR)
  try:
    verify(parse("$\\frac{1}{2}$", parsing_timeout=None), parse("$0.5$", parsing_timeout=None), timeout_seconds=None)
  finally:
    quiet.setLevel(level)


def _math_parse(text: str, wrap: bool) -> list:
  """math-verify's reading of text's last boxed answer, else of the whole text ($-wrapped if wrap and not in math)."""
  from math_verify import parse

  _warm_math_verify()
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
REFERENCE_CHECKS = {"arithmetic": int, "gsm8k": _gsm8k_reference, "math": _math_gold}  # each raises ValueError
