"""The rollout-engine interface (rl/rollout_engine.py): rollout.engine picks a registered engine, the trainer samples
and evaluates through it, and its settings are checked at the boundary."""

import dataclasses

import jax
import numpy as np
import pytest
from trainer_util import tiny_config

from hilore_jax import cli
from hilore_jax.errors import ConfigError
from hilore_jax.rl import rollout_engine
from hilore_jax.rl.config import DecodeConfig, RolloutConfig


@dataclasses.dataclass
class Recording:
  """An engine that answers with the JAX engine's completions and records every call (what a server would see)."""

  inner: rollout_engine.JaxEngine
  calls: list

  def generate(self, params, prompt_ids_BpP, prompt_mask_BpP, rng, sc, num_generations):
    self.calls.append((np.shape(prompt_ids_BpP), sc, num_generations))
    return self.inner.generate(params, prompt_ids_BpP, prompt_mask_BpP, rng, sc, num_generations)


CALLS: list = []


def _recording(cfg, rollout, stop_ids, pad_id):
  return Recording(rollout_engine.JaxEngine(cfg, stop_ids, pad_id, rollout.decoding()), CALLS)


def test_the_trainer_samples_and_evaluates_through_the_named_engine(tmp_path):
  from hilore_jax.loop.trainer import Trainer

  rollout_engine.register("recording", _recording)
  CALLS.clear()
  t = Trainer(tiny_config(tmp_path, "rollout.engine=recording", "rollout.decode_segment=2"))
  assert isinstance(t.sampler, Recording) and t.sampler.inner.decode == DecodeConfig(segment=2)
  roll = t.next_rollout()
  (shape, sc, G), = CALLS
  assert shape[0] == 3 and G == 4 and sc == t.config.rollout.sampling()
  assert roll.tokens.shape == (12, 3) and roll.trace  # the engine's completions, its trace included
  t.evaluate(t.state["params"], jax.random.PRNGKey(0))
  assert [c[2] for c in CALLS[1:]] == [1, 2]  # greedy, then pass@2
  with pytest.raises(ValueError, match="already registered"):
    rollout_engine.register("recording", lambda *a: None)


def test_an_unknown_engine_names_the_registered_ones():
  with pytest.raises(ConfigError, match=r"rollout.engine must be one of \[.*'jax'.*\].*got 'vllm'"):
    rollout_engine.build(None, RolloutConfig(engine="vllm"), (1,), 0)
  assert isinstance(rollout_engine.build(None, RolloutConfig(), (1,), 0), rollout_engine.JaxEngine)


@pytest.mark.parametrize("override,message", [
    ("rollout.dtype=float16", r"rollout.dtype must be one of \['', 'float32', 'bfloat16'\]"),
    ("rollout.decode_segment=0", r"rollout.decode_segment must be > 0"),
    ("rollout.cache_bucket=-4", r"rollout.cache_bucket must be > 0"),
    ("rollout.engine=", r"rollout.engine must name a rollout engine"),
])
def test_bad_engine_settings_name_the_key(override, message):
  with pytest.raises(ValueError, match=message):
    cli.load_config(None, [override])


def test_sampler_log_probs_need_the_models_precision():
  with pytest.raises(ConfigError, match="grpo.old_logp=sampler needs the sampler's log-probs at the model's precision"):
    cli.load_config(None, ["grpo.old_logp=sampler", "rollout.dtype=bfloat16"])
  cli.load_config(None, ["grpo.old_logp=sampler", "rollout.dtype=float32"])
  cli.load_config(None, ["rollout.dtype=bfloat16"])  # old log-probs by a forward pass: fine
