"""The rollout engine: what samples a rollout's completions (`rollout.engine`), behind one interface so another
inference engine can take the JAX sampler's place.

An engine is built once per run from the model config, the rollout settings and the tokenizer's stop and pad ids,
and asked for completions with the current params pytree each step (an external engine syncs its weights from it);
it returns host arrays (`Completions`). The anchors choose as follows: TRL's GRPOTrainer generates with
transformers' `generate` or, with `use_vllm`, a vLLM engine (a server or colocated); verl runs vLLM or SGLang
rollout workers (`actor_rollout_ref.rollout.name`); Tunix selects `rollout_engine` vanilla (its JAX sampler), vllm
or sglang_jax. Here `jax` is the in-process KV-cache sampler (rl/sampler.py); another registers itself with
`register(name, factory)` and is chosen by `rollout.engine=name`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import numpy as np

from hilore_jax.errors import ConfigError
from hilore_jax.model import ModelConfig, lora
from hilore_jax.rl import sampler
from hilore_jax.rl.config import DecodeConfig, RolloutConfig, SamplingConfig


@dataclasses.dataclass(frozen=True)
class Completions:
  """An engine's completions, host arrays with rows grouped by prompt (G consecutive rows per prompt)."""

  prompt_ids: np.ndarray  # [B, P] left-aligned (left padding)
  prompt_mask: np.ndarray
  tokens: np.ndarray  # [B, N] the pad id after each row's end
  logprobs: np.ndarray  # [B, N] under the sampling distribution, 0 after each row's end
  mask: np.ndarray  # [B, N] 1 on generated tokens up to and including the first stop id
  trace: tuple = ()  # the engine's own record of the decode (the JAX engine's segments)


class RolloutEngine(Protocol):
  """Samples num_generations completions of each prompt under params."""

  def generate(self, params: Any, prompt_ids_BpP: np.ndarray, prompt_mask_BpP: np.ndarray, rng: jax.Array,
               sc: SamplingConfig, num_generations: int) -> Completions:
    ...


@dataclasses.dataclass(frozen=True)
class JaxEngine:
  """The in-process KV-cache sampler (rl/sampler.py) on the trainer's own devices and params."""

  cfg: ModelConfig
  stop_ids: tuple[int, ...]
  pad_id: int
  decode: DecodeConfig = DecodeConfig()

  def generate(self, params, prompt_ids_BpP, prompt_mask_BpP, rng, sc: SamplingConfig,
               num_generations: int) -> Completions:
    cfg, params = lora.sampling_model(self.cfg, params)  # a LoRA model's adapters merged once per call
    out = sampler.generate(cfg, params, prompt_ids_BpP, prompt_mask_BpP, rng, sc, self.stop_ids, self.pad_id,
                           num_generations=num_generations, decode=self.decode)
    return Completions(**out)


def _jax(cfg: ModelConfig, rollout: RolloutConfig, stop_ids: tuple[int, ...], pad_id: int) -> JaxEngine:
  return JaxEngine(cfg, tuple(stop_ids), pad_id, rollout.decoding())


# name -> factory(model config, rollout settings, stop ids, pad id) -> engine
Factory = Callable[[ModelConfig, RolloutConfig, tuple, int], RolloutEngine]
ENGINES: dict[str, Factory] = {"jax": _jax}


def register(name: str, factory: Factory) -> None:
  """Make `rollout.engine=name` build its engine with factory."""
  if name in ENGINES and ENGINES[name] is not factory:
    raise ValueError(f"rollout engine {name!r} is already registered")
  ENGINES[name] = factory


def build(cfg: ModelConfig, rollout: RolloutConfig, stop_ids, pad_id: int) -> RolloutEngine:
  """The engine rollout.engine names, for this model and tokenizer."""
  if rollout.engine not in ENGINES:
    raise ConfigError(f"rollout.engine must be one of {sorted(ENGINES)} (registered engines), got "
                      f"{rollout.engine!r}")
  return ENGINES[rollout.engine](cfg, rollout, tuple(stop_ids), pad_id)
