"""hilore-jax: a JAX GRPO trainer with HiLoRe activation memory management.

Wings: `model/` (decoder, dataflow table, remat policies, L codes, HF interop), `memory/` (the HiLoRe
decisions), `bench/` (benchmarks); the GRPO loop is the flat modules beside them.
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
