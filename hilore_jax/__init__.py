"""hilore-jax: a JAX GRPO trainer with HiLoRe activation memory management.

Wings: `model/` (decoder, dataflow table, remat policies, L codes, HF and GGUF interop), `memory/` (the HiLoRe
decisions), `rl/` (GRPO numerics, the train step's pure functions, the update batch, rollouts, sampler, replay),
`tasks/` (tasks, verifiers, prompts, tokenizers; no JAX), `optim/` (AdamW, LoGRA), and on top of them `loop/` (the
trainer, the engine's state and compiled steps, evaluation, checkpoints, metrics); `capacity/` (train.capacity's
compile-only search). At the root: the config that composes the wings' sections and the run's plumbing (sharding,
runtime, errors, entry-point helpers). The lab (benchmarks and studies) is `experiments/`, beside the package.
"""

from hilore_jax import runtime

runtime.configure_xla_flags()  # before any JAX backend starts: CPU memory figures depend on it

# pylint: disable=wrong-import-position
from hilore_jax.config import Config  # noqa: E402
from hilore_jax.model import CHECKPOINT_NAMES, LayerPolicy, ModelConfig, forward, init_params  # noqa: E402
from hilore_jax.model.hf import load_hf, save_hf  # noqa: E402
from hilore_jax.rl.config import SamplingConfig  # noqa: E402
from hilore_jax.rl.sampler import generate  # noqa: E402
from hilore_jax.tasks.tokenizer import load_tokenizer  # noqa: E402

__all__ = ["CHECKPOINT_NAMES", "Config", "LayerPolicy", "ModelConfig", "SamplingConfig", "forward", "generate",
           "init_params", "load_hf", "load_tokenizer", "save_hf"]
__version__ = "0.2.0"
