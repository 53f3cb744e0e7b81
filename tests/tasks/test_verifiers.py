"""The verifiers: answer extraction on real answer formats (boxed, money, thousands), math-verify's equivalence and
timeouts, linear work on pathological completions, and rewards that never raise."""

import concurrent.futures
import json
import random
import re
from decimal import Decimal

import pytest

from hilore_jax.tasks import task as tasks
from hilore_jax.tasks import verifiers

@pytest.mark.parametrize("completion,expected", [
    ("so the total is 1,234 dollars.", "1234"),
    ("The answer is \\boxed{42}. (Not 7.)", "42"),
    ("work: 3+4=7\n#### 7\nthanks 99", "7"),
    ("it costs $18.", "18"),
    ("-5 degrees", "-5"),
    ("about 2.50", "2.5"),
])
def test_answer_extraction(completion, expected):
  assert verifiers.gsm8k_reward(completion, expected) == 1.0
  assert verifiers.gsm8k_reward(completion, "13") == 0.0


def test_no_number_scores_zero():
  assert verifiers.gsm8k_reward("I do not know", "3") == 0.0


def test_math_verify_equivalence():
  assert verifiers.math_reward("Thus $\\boxed{\\frac{14}{3}}$", "14/3") == 1.0
  assert verifiers.math_reward("the answer is $14/3$", "\\frac{14}{3}") == 1.0
  assert verifiers.math_reward("Thus $\\boxed{\\frac{14}{5}}$", "14/3") == 0.0


def test_math_verify_is_warmed_once_untimed_before_any_timed_parse(monkeypatch):
  import math_verify

  calls = []
  real = math_verify.parse
  monkeypatch.setattr(math_verify, "parse", lambda *a, **k: calls.append(k.get("parsing_timeout")) or real(*a, **k))
  verifiers._warm_math_verify.cache_clear()
  verifiers._math_gold.cache_clear()
  assert verifiers.math_reward("Thus $\\boxed{\\frac{7}{3}}$", "7/3") == 1.0
  # a cold first parse (building math-verify's parsers) never runs under the 2 s timeout of a real answer
  assert calls[0] is None and calls[1] is None and set(calls[2:]) == {verifiers.MATH_VERIFY_TIMEOUT_S}
  calls.clear()
  verifiers.math_reward("$\\frac{7}{3}$", "7/3")
  assert None not in calls  # once per process


def test_math_money_reference_with_escaped_dollar(tmp_path):
  # '\$' is an escaped dollar, not math mode: the reference must still be wrapped in $...$ to parse
  money = "\\$5.00"
  assert verifiers.math_reward("The total is $\\$5.00$.", money) == 1.0
  assert verifiers.math_reward("The total is \\boxed{\\$5.00}", money) == 1.0
  assert verifiers.math_reward("so it costs $5$", money) == 1.0
  assert verifiers.math_reward("The total is \\boxed{\\$6.00}", money) == 0.0
  assert verifiers.math_reward("so it costs $5.01$", money) == 0.0
  # MATH files carry it JSON-escaped, as "\\$18" on disk
  path = tmp_path / "money.jsonl"
  path.write_text(json.dumps({"prompt": "p", "answer": "\\$18"}) + "\n")
  assert '"\\\\$18"' in open(path).read()
  (ex,) = tasks.iter_jsonl_examples(str(path), "math")
  assert ex.reference == "\\$18"
  assert verifiers.math_reward("He pays \\boxed{18} dollars.", ex.reference) == 1.0
  assert verifiers.math_reward("He pays \\boxed{81} dollars.", ex.reference) == 0.0
  assert verifiers.math_reward("the answer is $14/3$", "$\\frac{14}{3}$") == 1.0  # an unescaped $ is still math mode


def test_last_boxed_matches_braces():
  assert verifiers.last_boxed("a \\boxed{x{y}z} b") == "x{y}z"
  assert verifiers.last_boxed("\\boxed{1} then \\fbox{\\{1,2\\}} end") == "\\{1,2\\}"  # \{ \} are not groups
  assert verifiers.last_boxed("\\boxed{\\boxed{5}}") == "\\boxed{5}"  # the outer box closes last
  assert verifiers.last_boxed("\\boxed {2}") == "2"
  assert verifiers.last_boxed("\\boxed{3} and \\boxed{4") == "3"  # an unclosed box is no answer
  assert verifiers.last_boxed("\\boxed{") is None and verifiers.last_boxed("\\boxedx{2}") is None
  assert verifiers.last_boxed("}} \\boxed{7} {") == "7"


@pytest.mark.parametrize("completion,expected", [
    ("so x = \\boxed{\\frac{1}{2}}", "0.5"),
    ("The total is \\boxed{-\\dfrac{3}{4}}.", "-0.75"),
    ("It costs \\boxed{\\$1{,}000}, not 7.", "1000"),
    ("It costs \\boxed{1\\,000} dollars", "1000"),
    ("The answer is \\boxed{\\text{18}} (not 7).", "18"),
    ("first \\boxed{3}, on reflection \\boxed{\\text{4 apples}}; 9", "4"),
    ("#### 9\nso \\fbox{12} 9", "12"),
    ("\\boxed{\\text{5}} then \\boxed{6", "5"),  # an unclosed box is no answer
])
def test_gsm8k_boxed_with_nested_braces(completion, expected):
  assert verifiers.gsm8k_reward(completion, expected) == 1.0
  assert verifiers.gsm8k_reward(completion, "9") == 0.0


def test_math_boxed_last_wins_and_fbox():
  two = "first \\boxed{5}, on reflection \\boxed{\\frac{1}{2}}"
  assert verifiers.math_reward(two, "1/2") == 1.0 and verifiers.math_reward(two, "5") == 0.0
  assert verifiers.math_reward("The answer is \\fbox{3}.", "3") == 1.0
  assert verifiers.math_reward("so \\boxed{1{,}000} in all", "1000") == 1.0
  assert verifiers.math_reward("so \\boxed{\\text{18}}", "18") == 1.0
  assert verifiers.math_reward("The answer is 0.5", "\\boxed{\\frac{1}{2}}") == 1.0  # a boxed reference reads the same


def test_find_numbers_matches_the_regex_it_replaces():
  assert verifiers.find_numbers("a 1,234. b -5 ,,, 2.50.7 $3") == ["1,234", "-5", "2.50", ".7", "3"]
  rng = random.Random(0)
  for _ in range(3000):
    s = "".join(rng.choice("0123456789,.-$ a") for _ in range(rng.randint(0, 16)))
    assert verifiers.find_numbers(s) == re.findall(r"-?[\d,]*\.?\d+", s, re.ASCII), s


PATHOLOGICAL = ["7" + "," * 40_000, "," * 40_000, "1" * 100_000, "\\boxed{" * 50_000,
                "{" * 50_000 + "\\boxed{12}" + "}" * 50_000, "-," * 50_000, "\\" * 100_000]


class _Counted(str):
  """A str that counts the characters read from it by index or slice (its slices share the count): how much work a
  scanner does, read without a clock."""

  def __new__(cls, text: str, reads: list | None = None):
    out = super().__new__(cls, text)
    out.reads = reads if reads is not None else [0]
    return out

  def __getitem__(self, key):
    out = super().__getitem__(key)
    if isinstance(key, slice):
      self.reads[0] += len(out)
      return _Counted(out, self.reads)
    self.reads[0] += 1
    return out


def test_pathological_completions_cost_linear_work(monkeypatch):
  # the old regex backtracked quadratically (28-60 s on 40k commas, ~n^2 / 2 steps): count the characters the
  # extractors read rather than the seconds they take, which a busy machine stretches: a linear scan reads each a few
  # times
  import math_verify

  commas = _Counted(PATHOLOGICAL[0])
  assert verifiers.find_numbers(commas) == ["7"]
  assert len(commas) <= commas.reads[0] <= 8 * len(commas)  # it scans the text itself, each character a few times
  uncapped = [Decimal(7), None, Decimal("1" * 100_000), None, Decimal(12), None, None]
  for completion, want in zip(PATHOLOGICAL, uncapped):
    text = _Counted(completion)
    assert verifiers.extract_gsm8k_answer(text, max_chars=10**6) == want
    assert 0 < text.reads[0] <= 8 * len(completion), (completion[:20], text.reads[0])
  parse, parsed = math_verify.parse, []
  monkeypatch.setattr(math_verify, "parse", lambda text, **kw: parsed.append(len(text)) or parse(str(text), **kw))
  for completion in PATHOLOGICAL:
    text = _Counted(completion)
    assert verifiers.gsm8k_reward(text, "7") == 0.0  # the 7 of the first lies before the last MAX_ANSWER_CHARS
    assert 0 < text.reads[0] <= 8 * verifiers.MAX_ANSWER_CHARS, (completion[:20], text.reads[0])
    assert verifiers.math_reward(completion, "7") == 0.0
  # math-verify, whose parser is not ours, only ever sees the last MAX_ANSWER_CHARS (inside "$\\boxed{...}$" at most)
  assert len(parsed) >= len(PATHOLOGICAL) and max(parsed) <= verifiers.MAX_ANSWER_CHARS + len("$\\boxed{}$")


def test_extractors_read_only_the_last_max_answer_chars():
  pad = " " * (verifiers.MAX_ANSWER_CHARS - 3)
  assert verifiers.gsm8k_reward("so 7.." + pad, "7") == 1.0  # the last MAX_ANSWER_CHARS begin at '7'
  assert verifiers.gsm8k_reward("so 7..." + pad, "7") == 0.0
  assert verifiers.math_reward("so $7$" + pad, "7") == 1.0  # they begin at '$'
  assert verifiers.math_reward("so $7$   " + pad, "7") == 0.0  # they hold only spaces


def test_math_reward_passes_timeouts_on_the_main_thread_only(monkeypatch):
  import math_verify

  seen = []

  def recording(fn, timeout_kwarg):
    def wrapped(*args, **kwargs):
      seen.append(kwargs.get(timeout_kwarg))
      return fn(*args, **kwargs)
    return wrapped

  monkeypatch.setattr(math_verify, "parse", recording(math_verify.parse, "parsing_timeout"))
  monkeypatch.setattr(math_verify, "verify", recording(math_verify.verify, "timeout_seconds"))
  assert verifiers.math_reward("so $\\frac{14}{3}$", "\\frac{28}{6}") == 1.0
  assert seen and set(seen) == {verifiers.MATH_VERIFY_TIMEOUT_S}
  seen.clear()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:  # SIGALRM is main-thread only: no timeout, no raise
    assert pool.submit(verifiers.math_reward, "so $\\frac{14}{3}$", "\\frac{42}{9}").result() == 1.0
  assert seen and set(seen) == {None}


def test_rewards_never_raise_on_random_completions():
  rng = random.Random(0)
  alphabet = list("0123456789,.$-{}#") + ["\\boxed", "\\", " "]
  texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(2000)]
  scored = {0.0, 1.0}

  def score(rewards, chunk):
    return {reward(t, ref) for reward, ref in rewards for t in chunk}

  every = [(verifiers.gsm8k_reward, "12"), (verifiers.arithmetic_reward, 12)]
  assert score(every + [(verifiers.math_reward, "12")], texts[:1000]) <= scored
  with concurrent.futures.ThreadPoolExecutor(1) as pool:  # rollouts may score off the main thread
    assert pool.submit(score, every + [(verifiers.math_reward, "12")], texts[1000:]).result() <= scored
  assert score(every, texts[1000:]) <= scored


def test_arithmetic_reward_never_raises_on_huge_numbers():
  assert verifiers.arithmetic_reward("1" * 5000, 11) == 0.0  # int() would raise past 4300 digits
  assert verifiers.arithmetic_reward("-0047\nmore", -47) == 1.0
