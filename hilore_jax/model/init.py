"""Random params of a decoder: the pytree every forward reads (per-layer list layout, model/layers.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hilore_jax.model import lora
from hilore_jax.model.config import ModelConfig


def init_params(cfg: ModelConfig, rng: jax.Array, init_std: float = 0.02) -> dict:
  """Random params (normal(0, init_std) weights, zero biases, unit norms) in cfg.param_dtype."""
  D, F, N, KV, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_size)
  dt = cfg.params_dtype
  keys = iter(jax.random.split(rng, 2 + 7 * cfg.num_hidden_layers))

  def normal(shape):
    return (init_std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

  layers = []
  for _ in range(cfg.num_hidden_layers):
    attn = {"wq_DNH": normal((D, N, H)), "wk_DKH": normal((D, KV, H)), "wv_DKH": normal((D, KV, H)),
            "wo_NHD": normal((N, H, D))}
    if cfg.attention_bias:
      attn.update(bq_NH=jnp.zeros((N, H), dt), bk_KH=jnp.zeros((KV, H), dt), bv_KH=jnp.zeros((KV, H), dt))
    if cfg.o_proj_bias:
      attn["bo_D"] = jnp.zeros((D,), dt)
    mlp = {"wgate_DF": normal((D, F)), "wup_DF": normal((D, F)), "wdown_FD": normal((F, D))}
    if cfg.mlp_bias:
      mlp.update(bgate_F=jnp.zeros((F,), dt), bup_F=jnp.zeros((F,), dt), bdown_D=jnp.zeros((D,), dt))
    layers.append({"attn": attn, "mlp": mlp, "attn_norm_D": jnp.ones((D,), dt),
                   "mlp_norm_D": jnp.ones((D,), dt)})
  params = {"embed_VD": normal((cfg.vocab_size, D)), "layers": layers, "final_norm_D": jnp.ones((D,), dt)}
  if not cfg.tie_word_embeddings:
    params["lm_head_DV"] = normal((D, cfg.vocab_size))
  return params if cfg.lora is None else lora.add_adapters(cfg, params, rng)
