"""The task wing's settings (task.*): which verifiable task, its data files, and how prompts are formatted."""

from __future__ import annotations

import dataclasses

from hilore_jax.errors import ConfigError, check_choice, check_positive, check_range


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
  """Difficulty knobs of the synthetic arithmetic task (task.arithmetic.*)."""

  seed: int = 0
  min_value: int = 0
  max_value: int = 99
  num_terms: int = 2
  ops: tuple[str, ...] = ("+",)
  num_test: int = 200
  teacher_error_rate: float = 0.0  # share of warm-start targets where the teacher answers one too high
  fixed_width: bool = False  # zero-pad operands and gold answers to a fixed width ('07+45=' -> '052')
  # completions of varying length: the answer, '#', then a tail (the first operand once, and once more per unit of
  # the others' last digit): '3+5=' -> '8#3,3,3,3,3,3'; the reward reads the answer before the '#'
  scratchpad: bool = False
  # symbols: '12+35=' and the bare answer; question: 'What is 12 + 35?' in words (through task.prompt_template), the
  # reward reading the completion's final number (free text such as '12 + 35 = 47', a chat model's answer);
  # word: a short story with num_terms = 3 numbers and two operations ('Mia has 12 pens. She buys 7 more and then
  # gives away 5. How many pens does Mia have now?'), rewarded the same way: a problem that needs steps
  format: str = "symbols"
  # word only: the share of one-step stories (two numbers, one operation) mixed in, so the difficulty varies
  one_step_frac: float = 0.0

  def __post_init__(self):
    check_range("task.arithmetic.teacher_error_rate", self.teacher_error_rate, 0.0, 1.0)
    check_range("task.arithmetic.one_step_frac", self.one_step_frac, 0.0, 1.0)
    if self.one_step_frac and self.format != "word":
      raise ConfigError(f"task.arithmetic.one_step_frac mixes one-step stories into format=word, got format "
                        f"{self.format!r}")
    if self.min_value < 0 or self.max_value < self.min_value:
      raise ConfigError(f"task.arithmetic needs 0 <= min_value <= max_value, got {self.min_value}, "
                        f"{self.max_value}")
    if self.num_terms < 2:
      raise ConfigError(f"task.arithmetic.num_terms must be >= 2, got {self.num_terms}")
    bad = sorted(set(self.ops) - {"+", "-", "*"})
    if bad or not self.ops:
      raise ConfigError(f"task.arithmetic.ops must be a non-empty subset of ['+', '-', '*'], got {list(self.ops)}")
    check_positive("task.arithmetic.num_test", self.num_test)
    if self.scratchpad and "*" in self.ops:
      raise ConfigError("task.arithmetic.scratchpad counts digits of the later operands: ops must not include '*'")
    check_choice("task.arithmetic.format", self.format, ("symbols", "question", "word"))
    if self.format != "symbols" and (self.fixed_width or self.scratchpad):
      raise ConfigError(f"task.arithmetic.format={self.format} writes plain numbers and reads the final one: "
                        "fixed_width and scratchpad apply to format=symbols only")
    if self.format == "word":
      if self.num_terms != 3:
        raise ConfigError(f"task.arithmetic.format=word tells stories with three numbers: set num_terms: 3, got "
                          f"{self.num_terms}")
      if set(self.ops) - {"+", "-"}:
        raise ConfigError(f"task.arithmetic.format=word has stories for '+' and '-' only, got ops {list(self.ops)}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  kind: str = "arithmetic"  # arithmetic | gsm8k | math
  seed: int = 0  # shuffling of dataset tasks
  arithmetic: ArithmeticSpec = ArithmeticSpec()
  train_path: str | None = None  # gsm8k / math JSONL
  test_path: str | None = None
  skip_malformed: bool = False
  # gsm8k and arithmetic questions: {question} is replaced (other braces are text); the user turn in chat
  prompt_template: str = "{question}\n"
  prompt_format: str = "template"  # template: the text as is | chat: inside the tokenizer's chat template
  system_prompt: str | None = None  # chat only: a system message before the user's

  def __post_init__(self):
    check_choice("task.kind", self.kind, ("arithmetic", "gsm8k", "math"))
    if self.kind != "arithmetic" and not (self.train_path and self.test_path):
      raise ConfigError(f"task.kind={self.kind} needs task.train_path and task.test_path (JSONL files)")
    if "{question}" not in self.prompt_template:
      raise ConfigError(f"task.prompt_template must contain {{question}}, got {self.prompt_template!r}")
    check_choice("task.prompt_format", self.prompt_format, ("template", "chat"))
    if self.system_prompt is not None and self.prompt_format != "chat":
      raise ConfigError("task.system_prompt needs task.prompt_format=chat (with a template, write it into "
                        "task.prompt_template)")
