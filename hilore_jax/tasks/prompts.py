"""Prompts: an Example -> prompt token ids (the task's text as is, or as the user turn of the tokenizer's chat
template), the token ids that end a completion, and completion decoding. One Prompter serves rollouts,
evaluation and the supervised warm-start, so all three see the same prompts."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from hilore_jax.errors import ConfigError
from hilore_jax.tasks.config import TaskConfig
from hilore_jax.tasks.task import Example

_PROBE = "HILORE_PROBE_REPLY"  # a plain-word assistant reply: templates pass it through unchanged


@dataclasses.dataclass(frozen=True, eq=False)
class Prompter:
  """Formats, tokenizes and truncates prompts; stop_ids[0] is the token a gold completion ends with."""

  tokenizer: Any
  chat: bool = False
  system_prompt: str | None = None
  stop_ids: tuple[int, ...] = ()

  @property
  def end_id(self) -> int:
    return self.stop_ids[0]

  def render(self, user: str) -> str:
    """The prompt text: the task's text itself, or the chat template's conversation ending in the assistant header."""
    if not self.chat:
      return user
    system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
    return self.tokenizer.apply_chat_template([*system, {"role": "user", "content": user}],
                                              add_generation_prompt=True, tokenize=False)

  def _ids(self, text: str) -> list[int]:
    # a chat template writes any BOS itself: encoding its text with special tokens would add a second
    return list(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])

  def prompt_ids(self, example: Example, max_len: int) -> tuple[list[int], bool]:
    """One prompt's ids (at most max_len) and whether it was truncated.

    template: the oldest tokens are dropped. chat: tokens are dropped from the start of the user message, so the
    system message, the turn markers and the generation prompt stay intact (the question's end survives).
    """
    ids = self._ids(self.render(example.prompt))
    if len(ids) <= max_len:
      return ids, False
    if not self.chat:
      return ids[-max_len:], True
    user_ids = self.tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
    drop = len(ids) - max_len
    while drop < len(user_ids):
      ids = self._ids(self.render(self.tokenizer.decode(user_ids[drop:])))
      if len(ids) <= max_len:
        return ids, True
      drop += len(ids) - max_len  # tokens can merge differently at the new start: cut again
    raise ConfigError(f"rollout.max_prompt_len={max_len} leaves no room for the question: the chat template "
                      f"alone (system prompt and turn markers) takes {len(self._ids(self.render('')))} tokens")

  def encode(self, examples: Sequence[Example], max_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Left-padded ids and mask [n, max_len], and how many prompts were truncated."""
    ids = np.full((len(examples), max_len), self.tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(examples), max_len), np.int32)
    truncated = 0
    for i, e in enumerate(examples):
      toks, cut = self.prompt_ids(e, max_len)
      truncated += cut
      if toks:
        ids[i, max_len - len(toks):] = toks
        mask[i, max_len - len(toks):] = 1
    return ids, mask, truncated

  def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Completion texts: the tokens before the first stop id, decoded at once (no split bytes), specials skipped."""
    stops = set(self.stop_ids)
    out = []
    for row, m in zip(tokens, mask):
      toks = []
      for t, k in zip(row.tolist(), m.tolist()):
        if not k or t in stops:
          break
        toks.append(t)
      out.append(self.tokenizer.decode(toks, skip_special_tokens=True))
    return out


def end_of_turn_id(tokenizer) -> int | None:
  """The special token the chat template writes right after an assistant reply (<|im_end|>, <|eot_id|>, ...)."""
  text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                                       tokenize=False)
  if _PROBE not in text:
    return None
  after = tokenizer(text[text.rindex(_PROBE) + len(_PROBE):], add_special_tokens=False)["input_ids"]
  special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
  return after[0] if after and after[0] in special else None


def generation_eos_ids(checkpoint_dir: str | None) -> list[int]:
  """eos_token_id of the checkpoint's generation_config.json (an id or a list), if it has one."""
  path = os.path.join(checkpoint_dir, "generation_config.json") if checkpoint_dir else None
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    eos = json.load(f).get("eos_token_id")
  return [] if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def stop_ids(tokenizer, chat: bool, checkpoint_dir: str | None = None) -> tuple[int, ...]:
  """End-of-turn (chat), the tokenizer's eos, then the checkpoint's generation eos ids; first one first, no repeats."""
  ids = [end_of_turn_id(tokenizer) if chat else None, tokenizer.eos_token_id, *generation_eos_ids(checkpoint_dir)]
  return tuple(dict.fromkeys(i for i in ids if i is not None))


def build_prompter(tokenizer, tc: TaskConfig, tokenizer_path: str, checkpoint_dir: str | None = None) -> Prompter:
  """The Prompter a task config asks for; chat needs a tokenizer with a chat template."""
  chat = tc.prompt_format == "chat"
  if chat and not getattr(tokenizer, "chat_template", None):
    raise ConfigError(f"task.prompt_format=chat: the tokenizer at {tokenizer_path} has no chat template")
  ids = stop_ids(tokenizer, chat, checkpoint_dir)
  if not ids:
    raise ConfigError(f"the tokenizer at {tokenizer_path} has no eos token: completions could never stop")
  return Prompter(tokenizer, chat, tc.system_prompt, ids)


def write_generation_config(out_dir: str, prompter: Prompter, source_dir: str | None = None):
  """generation_config.json for an HF export, so transformers' generate stops where the sampler did; the
  source checkpoint's other settings (its recommended sampling) carry over."""
  src = os.path.join(source_dir, "generation_config.json") if source_dir else None
  gen = {}
  if src and os.path.exists(src):
    with open(src) as f:
      gen = json.load(f)
  gen.update(eos_token_id=list(prompter.stop_ids), pad_token_id=prompter.tokenizer.pad_token_id)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(gen, f, indent=2)
