"""Decoder model configuration with Hugging Face field names (Qwen2 and Llama families)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_name(dtype: Any) -> str:
  """Canonical name of a dtype given as a name or a jnp dtype."""
  name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
  return name


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections an adapter may sit on (peft's q_proj, ...)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Low-rank adapters on frozen projections: y = x W + (alpha / rank) * dropout(x) A B (peft's LoRA)."""

  rank: int
  alpha: float
  targets: tuple[str, ...] = LORA_TARGETS
  dropout: float = 0.0  # on the adapter's input, in the gradient program only (forward-only passes run without)

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
      raise ValueError(f"lora.rank must be a positive integer here, got {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"lora.alpha must be > 0, got {self.alpha!r}")
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if bad or not self.targets:
      raise ValueError(f"lora.targets: unknown {bad} (choose from {list(LORA_TARGETS)})" if bad else
                       f"lora.targets must name at least one of {list(LORA_TARGETS)}")
    if len(set(self.targets)) != len(self.targets):
      raise ValueError(f"lora.targets names a projection twice: {list(self.targets)}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
    # one order whatever the config's: the params' layout and every compiled program depend on it
    object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


ATTENTION_KERNELS = ("xla", "dot_product_attention", "blockwise")
# blockwise's query and key block sizes: a [B, K, G, 128, 256] float32 score block is live at a time
ATTENTION_BLOCK_Q, ATTENTION_BLOCK_K = 128, 256


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Qwen2/Llama decoder; field names follow transformers' configs."""

  vocab_size: int = 128
  hidden_size: int = 64
  intermediate_size: int = 176
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  head_dim: int | None = None  # None: hidden_size // num_attention_heads
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted items of HF's rope scaling dict
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = True
  attention_bias: bool = True  # q/k/v bias (always on in Qwen2)
  o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj
  mlp_bias: bool = False
  model_type: str = "qwen2"
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  # xla: softmax probabilities as a tensor; dot_product_attention: jax.nn's fused kernel (cuDNN flash attention on
  # GPU); blockwise: flash-style attention over query x key blocks, memory O(T x block) on any backend
  attention: str = "xla"
  attention_block_q: int = ATTENTION_BLOCK_Q  # blockwise's block sizes (T and S need not be multiples)
  attention_block_k: int = ATTENTION_BLOCK_K
  # adapters on frozen projections (model/lora.py); None: every forward ignores any adapter in the params (the
  # frozen base alone: the KL reference of a LoRA run)
  lora: LoraSpec | None = None
  # runs of layers with one remat policy as lax.scan over their stacked params (compile time and the compiler's
  # memory follow the number of runs, not depth); False: every layer a plain call, so XLA's cost analysis, which
  # counts a loop body once, counts each layer (the roofline projection's counts)
  scan_layers: bool = True
  # a layer whose policy recomputes its MLP runs the MLP over chunks of at most this many positions, each
  # rematerialised alone, so its backward holds [B, chunk, F] intermediates, not [B, T, F] (0: never chunked)
  mlp_chunk_len: int = 512

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                       f"num_key_value_heads ({self.num_key_value_heads})")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(f"model.hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                       f"({self.num_attention_heads}); set model.head_dim")
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if self.head_size % 2:
      raise ValueError(f"head size must be even for RoPE, got {self.head_size}")
    if self.attention not in ATTENTION_KERNELS:
      raise ValueError(f"model.attention must be one of {list(ATTENTION_KERNELS)}, got {self.attention!r}")
    for name in ("attention_block_q", "attention_block_k"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
    if isinstance(self.mlp_chunk_len, bool) or not isinstance(self.mlp_chunk_len, int) or self.mlp_chunk_len < 0:
      raise ValueError(f"model.mlp_chunk_len must be an integer >= 0 (0: the MLP never chunked), got "
                       f"{self.mlp_chunk_len!r}")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"model.scan_layers must be true or false, got {self.scan_layers!r}")
    if self.model_type not in ("qwen2", "llama"):
      raise ValueError(f"model.model_type must be one of ['llama', 'qwen2'], got {self.model_type!r}")
    object.__setattr__(self, "dtype", dtype_name(self.dtype))
    object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    rope_type = self.rope_type
    if rope_type not in ROPE_TYPES:
      raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {list(ROPE_TYPES)}")

  @property
  def head_size(self) -> int:
    return self.head_dim

  @property
  def rope_type(self) -> str:
    scaling = dict(self.rope_scaling or ())
    return scaling.get("rope_type", scaling.get("type", "default"))

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def params_dtype(self):
    return DTYPES[self.param_dtype]

  @property
  def architecture(self) -> str:
    return {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


_ROPE_KEYS = ("rope_theta", "rope_type", "type")


def from_hf_dict(d: dict, dtype: Any = "float32", param_dtype: Any | None = None) -> ModelConfig:
  """ModelConfig from a transformers config.json dict (transformers 4 and 5 layouts)."""
  archs = d.get("architectures") or []
  arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
  model_type = SUPPORTED_ARCHITECTURES[arch] if arch else d.get("model_type")
  if model_type not in ("qwen2", "llama"):
    raise ValueError(f"unsupported architecture {archs or d.get('model_type')!r}; "
                     f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
  if d.get("use_sliding_window"):
    raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
  # transformers 5 keeps theta and scaling in rope_parameters; 4.x has rope_theta + rope_scaling.
  rope = dict(d.get("rope_parameters") or {})
  legacy = dict(d.get("rope_scaling") or {})
  theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
  scaling = {k: v for k, v in {**legacy, **rope}.items() if k != "rope_theta"}
  if scaling.get("rope_type", scaling.get("type", "default")) == "default":
    scaling = None
  eos = d.get("eos_token_id")
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  attention_bias = True if model_type == "qwen2" else bool(d.get("attention_bias", False))
  return ModelConfig(
      vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
      num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
      num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
      head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
      rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
      max_position_embeddings=d.get("max_position_embeddings", 2048),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type == "qwen2")),
      attention_bias=attention_bias, o_proj_bias=model_type == "llama" and attention_bias,
      mlp_bias=bool(d.get("mlp_bias", False)), model_type=model_type,
      bos_token_id=d.get("bos_token_id"), eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
      dtype=dtype_name(dtype), param_dtype=dtype_name(param_dtype or dtype))


def to_hf_dict(cfg: ModelConfig) -> dict:
  """transformers config.json dict for this model (rope in both 4.x and 5.x layouts)."""
  if cfg.model_type == "qwen2" and cfg.o_proj_bias:
    raise ValueError("Qwen2 has no o_proj bias; cannot export o_proj_bias=True as Qwen2")
  if cfg.model_type == "llama" and cfg.attention_bias != cfg.o_proj_bias:
    raise ValueError("Llama's attention_bias covers q/k/v and o_proj together")
  rope = {"rope_type": "default", **dict(cfg.rope_scaling or ()), "rope_theta": cfg.rope_theta}
  rope.pop("type", None)
  d = {
      "architectures": [cfg.architecture], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
      "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_size,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
      "rope_scaling": None if cfg.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
      "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
      "hidden_act": "silu", "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
      "use_cache": True,
  }
  if cfg.model_type == "llama":
    d.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
  elif cfg.mlp_bias:
    raise ValueError("Qwen2 has no MLP bias; cannot export mlp_bias=True as Qwen2")
  return d
