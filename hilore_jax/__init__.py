"""hilore-jax: a JAX GRPO trainer with HiLoRe activation memory management."""

from hilore_jax import xla_flags

xla_flags.configure()

# pylint: disable=wrong-import-position

from hilore_jax.hf import load_hf, save_hf
from hilore_jax.model import CHECKPOINT_NAMES, LayerPolicy, forward, init_params
from hilore_jax.model_config import ModelConfig
from hilore_jax.sampler import SamplingConfig, generate
from hilore_jax.tokenizer import load_tokenizer

__all__ = ["CHECKPOINT_NAMES", "LayerPolicy", "ModelConfig", "SamplingConfig", "forward", "generate",
           "init_params", "load_hf", "load_tokenizer", "save_hf"]
__version__ = "0.1.0"
