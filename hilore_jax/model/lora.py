"""LoRA: low-rank adapters on frozen projections, y = x W + (alpha / r) * dropout(x) A B (peft's LoRA), as extra
leaves of the params pytree.

A layer's adapters sit in `params["layers"][i]["lora"][target] = {"A": ..., "B": ...}` (targets of
config.LORA_TARGETS), so every forward (the gradient program, the log-prob passes, the sampler, the memory
manager's probes) runs them with no second code path; a config whose `lora` is None ignores them (the frozen base
alone: a LoRA run's KL reference, without a copy of the weights). `partition` splits such a tree into the frozen
base and the trainable adapters (`Split`, a small typed value): gradients, clipping, the optimizer and its state see
the adapters only.

Shapes per target (r the rank): A's input side is the frozen weight's input side, B's output side its output side:
q: A [D, r], B [r, N, H]; k, v: A [D, r], B [r, K, H]; o: A [N, H, r], B [r, D]; gate, up: A [D, r], B [r, F];
down: A [F, r], B [r, D]. A starts Kaiming-uniform (peft's: U(-1/sqrt(fan_in), 1/sqrt(fan_in))), B at zero, both
float32 whatever the base's dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hilore_jax.model import lowp
from hilore_jax.model import units as U
from hilore_jax.model.config import LORA_TARGETS, ModelConfig
from hilore_jax.model.layers import stack_layers


class Target(NamedTuple):
  """A projection an adapter may sit on: its frozen weight (block, leaf) and bias leaf, its einsum, its input unit
  and the HF module it is in Hugging Face / peft names."""

  block: str
  weight: str
  bias: str
  spec: str
  unit: str
  module: str


TARGETS: dict[str, Target] = {
    "q": Target("attn", "wq_DNH", "bq_NH", "btd,dnh->btnh", U.ATTN_NORM, "self_attn.q_proj"),
    "k": Target("attn", "wk_DKH", "bk_KH", "btd,dkh->btkh", U.ATTN_NORM, "self_attn.k_proj"),
    "v": Target("attn", "wv_DKH", "bv_KH", "btd,dkh->btkh", U.ATTN_NORM, "self_attn.v_proj"),
    "o": Target("attn", "wo_NHD", "bo_D", "btnh,nhd->btd", U.ATTN_CTX, "self_attn.o_proj"),
    "gate": Target("mlp", "wgate_DF", "bgate_F", "btd,df->btf", U.MLP_NORM, "mlp.gate_proj"),
    "up": Target("mlp", "wup_DF", "bup_F", "btd,df->btf", U.MLP_NORM, "mlp.up_proj"),
    "down": Target("mlp", "wdown_FD", "bdown_D", "btf,fd->btd", U.MLP_DOWN_IN, "mlp.down_proj"),
}
assert tuple(TARGETS) == LORA_TARGETS
KEY = "lora"  # a layer's adapters: params["layers"][i][KEY]
DROPOUT_KEY = "dropout_key"  # a layer's dropout key [2] uint32, only inside the gradient program (with_dropout)
# what the adapters' initialiser folds into the params' key: the base's own draws stay those of a run without LoRA
_SALT = 0x10CA


def _letters(spec: str) -> tuple[str, str, str]:
  """(the input's letters, the contracted ones, the output feature ones) of a projection 'x,w->y'."""
  lhs, out = spec.split("->")
  x, w = lhs.split(",")
  contracted = "".join(c for c in w if c in x)
  return x, contracted, "".join(c for c in w if c not in x)


def adapter_specs(spec: str) -> tuple[str, str, str]:
  """(x A's einsum, u B's, A B's merge into W's) of a projection's einsum; 'r' is the rank."""
  x, contracted, feats = _letters(spec)
  batch = "".join(c for c in x if c not in contracted)
  return (f"{x},{contracted}r->{batch}r", f"{batch}r,r{feats}->{batch}{feats}",
          f"{contracted}r,r{feats}->{contracted}{feats}")


def adapter_shapes(cfg: ModelConfig, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(A's shape, B's shape) of a target's adapter."""
  sizes = {"d": cfg.hidden_size, "f": cfg.intermediate_size, "n": cfg.num_attention_heads,
           "k": cfg.num_key_value_heads, "h": cfg.head_size}
  _, contracted, feats = _letters(TARGETS[target].spec)
  return tuple(sizes[c] for c in contracted) + (rank,), (rank,) + tuple(sizes[c] for c in feats)


def init_adapters(cfg: ModelConfig, rng: jax.Array) -> list[dict]:
  """Each layer's adapters of cfg.lora: A Kaiming-uniform as peft's (bound 1 / sqrt(fan_in)), B zeros, float32."""
  spec = cfg.lora
  keys = jax.random.split(rng, cfg.num_hidden_layers * len(spec.targets)).reshape(cfg.num_hidden_layers,
                                                                                   len(spec.targets), -1)
  layers = []
  for i in range(cfg.num_hidden_layers):
    layer = {}
    for j, t in enumerate(spec.targets):
      a_shape, b_shape = adapter_shapes(cfg, t, spec.rank)
      bound = 1.0 / math.sqrt(math.prod(a_shape[:-1]))
      layer[t] = {"A": jax.random.uniform(keys[i, j], a_shape, jnp.float32, -bound, bound),
                  "B": jnp.zeros(b_shape, jnp.float32)}
    layers.append(layer)
  return layers


def add_adapters(cfg: ModelConfig, params: dict, rng: jax.Array, adapters: list[dict] | None = None) -> dict:
  """params (a base without adapters) with cfg.lora's adapters in every layer: `adapters` where given (one dict per
  layer), else freshly initialised from rng (folded, so the base's own draws are untouched)."""
  if adapters is None:
    adapters = init_adapters(cfg, jax.random.fold_in(rng, _SALT))
  layers = params["layers"]
  depth = len(layers) if not isinstance(layers, dict) else jax.tree.leaves(layers)[0].shape[0]
  if len(adapters) != depth:
    raise ValueError(f"{len(adapters)} layers of adapters for {depth} layers")
  if isinstance(layers, dict):  # the train layout: the adapters stacked along the layer axis too
    return {**params, "layers": {**layers, KEY: stack_layers(adapters)}}
  return {**params, "layers": [{**layer, KEY: ad} for layer, ad in zip(layers, adapters)]}


def adapted_inputs(spec) -> tuple[str, ...] | None:
  """The projection inputs (units.PROJECTION_INPUTS) some adapter of spec reads; None without LoRA (units.table)."""
  if spec is None:
    return None
  return tuple(u for u in U.PROJECTION_INPUTS if any(TARGETS[t].unit == u for t in spec.targets))


def has_adapters(params) -> bool:
  layers = params["layers"] if isinstance(params, dict) else ()
  if isinstance(layers, dict):  # stacked (model/layers.py)
    return KEY in layers
  return bool(layers) and isinstance(layers[0], dict) and KEY in layers[0]


class Split(NamedTuple):
  """A params tree as its frozen part and what trains: without adapters everything trains (frozen None); with them
  only the adapters do ({"layers": [each layer's adapters]}, or stacked in the train layout). Any leaves: arrays,
  shardings, abstract values."""

  frozen: Any
  trainable: Any

  def combined(self, trainable=None):
    """The whole tree again, with `trainable` (same structure as self.trainable) in place of the adapters."""
    t = self.trainable if trainable is None else trainable
    if self.frozen is None:
      return t
    if isinstance(self.frozen["layers"], dict):
      return {**self.frozen, "layers": {**self.frozen["layers"], KEY: t["layers"]}}
    return {**self.frozen, "layers": [{**layer, KEY: ad} for layer, ad in zip(self.frozen["layers"], t["layers"])]}


def partition(params) -> Split:
  """The params' frozen base and trainable part (module docstring)."""
  if not has_adapters(params):
    return Split(None, params)
  layers = params["layers"]
  if isinstance(layers, dict):
    return Split({**params, "layers": {k: v for k, v in layers.items() if k != KEY}}, {"layers": layers[KEY]})
  frozen = {**params, "layers": [{k: v for k, v in layer.items() if k != KEY} for layer in params["layers"]]}
  return Split(frozen, {"layers": [layer[KEY] for layer in params["layers"]]})


def trainable(params):
  """What trains of a params tree (the adapters where it has them, else everything)."""
  return partition(params).trainable


def base_of(params) -> dict:
  """The params without their adapters (the same arrays: no copy)."""
  split = partition(params)
  return split.trainable if split.frozen is None else split.frozen


def stop_frozen(layer: dict) -> dict:
  """A layer's params with stop_gradient on all but its adapters: differentiated, it is what the trainer's gradient
  of the adapters alone keeps for backward (model.layer_residuals)."""
  if KEY not in layer:
    return layer
  frozen = jax.tree.map(jax.lax.stop_gradient, {k: v for k, v in layer.items() if k != KEY})
  return {**frozen, KEY: layer[KEY]}


def cast_base(params: dict, dtype) -> dict:
  """The frozen base's floating leaves in dtype (lora.base_dtype); adapters stay float32."""
  split = partition(params)
  if split.frozen is None:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  frozen = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, split.frozen)
  return Split(frozen, split.trainable).combined()


# ----------------------------------------------------------------------------- the forward


def layer_adapters(cfg: ModelConfig, p: dict) -> dict | None:
  """One layer's adapters when cfg runs them (cfg.lora set and the params carry them), else None."""
  if cfg.lora is None or KEY not in p:
    return None
  return p[KEY]


def with_dropout(params: dict, key: jax.Array) -> dict:
  """params with a dropout key in each layer's adapters (fold_in(key, layer)): the gradient program's forward then
  drops the adapters' inputs (cfg.lora.dropout); the forward-only passes never carry one (peft's eval mode)."""
  layers = params["layers"]
  if isinstance(layers, dict):
    depth = jax.tree.leaves(layers)[0].shape[0]
    keys = jnp.stack([jax.random.key_data(jax.random.fold_in(key, i)) for i in range(depth)])
    return {**params, "layers": {**layers, KEY: {**layers[KEY], DROPOUT_KEY: keys}}}
  layers = [{**layer, KEY: {**layer[KEY], DROPOUT_KEY: jax.random.key_data(jax.random.fold_in(key, i))}}
            for i, layer in enumerate(layers)]
  return {**params, "layers": layers}


def fold_dropout(adapters: dict, i) -> dict:
  """A layer's adapters with their dropout key (if any) folded with i: independent draws for a part of the layer's
  tokens (a chunk of the sequence, model/layer.py)."""
  if DROPOUT_KEY not in adapters:
    return adapters
  key = jax.random.fold_in(jax.random.wrap_key_data(adapters[DROPOUT_KEY]), i)
  return {**adapters, DROPOUT_KEY: jax.random.key_data(key)}


def _dropout(x, rate: float, key_data, salt: int):
  if not rate or key_data is None:
    return x
  keep = jax.random.bernoulli(jax.random.fold_in(jax.random.wrap_key_data(key_data), salt), 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def projections(cfg: ModelConfig, adapters: dict, targets: tuple[str, ...], x, km: tuple, ys: tuple) -> tuple:
  """ys (the frozen projections of x, one per target name) plus each adapted one's scale * (x A) B.

  The frozen weights' backward never reads x (no weight gradient). x is read only by the A gradients: kept as
  km's L code where the unit is L (lowp.project around x A alone), else as itself; x A [.., r], tagged LORA_XA, is
  what the B gradients read.
  """
  names = [t for t in targets if t in adapters]
  if not names:
    return ys
  spec = cfg.lora
  xd = _dropout(x, spec.dropout, adapters.get(DROPOUT_KEY), U.UNITS.index(TARGETS[names[0]].unit))
  a_specs = [adapter_specs(TARGETS[t].spec)[0] for t in names]
  if km[0] is None:
    us = [jnp.einsum(s, xd, adapters[t]["A"].astype(x.dtype)) for s, t in zip(a_specs, names)]
  else:
    us = lowp.project(xd, tuple(adapters[t]["A"] for t in names), tuple(a_specs), km[0], km[1])
  out = list(ys)
  for t, u in zip(names, us):
    u = checkpoint_name(u, U.LORA_XA)
    i = targets.index(t)
    b_spec = adapter_specs(TARGETS[t].spec)[1]
    out[i] = out[i] + (spec.scale * jnp.einsum(b_spec, u, adapters[t]["B"].astype(u.dtype))).astype(out[i].dtype)
  return tuple(out)


def xa_products(cfg: ModelConfig, adapters: dict, tensors: dict) -> jax.Array:
  """A layer's LORA_XA unit as one tensor [B, T, rank x targets]: every adapted projection's x A, from its input
  among tensors (by unit name): the op the memory profile times for it."""
  us = []
  for t in cfg.lora.targets:
    x = tensors[TARGETS[t].unit]
    us.append(jnp.einsum(adapter_specs(TARGETS[t].spec)[0], x, adapters[t]["A"].astype(x.dtype)))
  return jnp.concatenate(us, axis=-1)


# ----------------------------------------------------------------------------- merged weights


def _merged_weight(cfg: ModelConfig, layer: dict, target: str) -> jax.Array:
  """W + scale * A B of one layer's adapted weight, in the wider of W's and the compute dtype (a bfloat16 base under
  float32 compute keeps the adapter's small delta)."""
  tg, ad = TARGETS[target], layer[KEY][target]
  w = layer[tg.block][tg.weight]
  delta = jnp.einsum(adapter_specs(tg.spec)[2], ad["A"].astype(jnp.float32), ad["B"].astype(jnp.float32))
  return (w.astype(jnp.float32) + cfg.lora.scale * delta).astype(jnp.promote_types(w.dtype, cfg.compute_dtype))


def _layer_weights(cfg: ModelConfig, layers) -> list[dict] | dict:
  """Every layer's merged weights by target: a list per layer, or stacked (one vmapped program) for stacked layers."""
  one = lambda layer: {t: _merged_weight(cfg, layer, t) for t in cfg.lora.targets}
  return jax.vmap(one)(layers) if isinstance(layers, dict) else [one(layer) for layer in layers]


def _with_weights(params: dict, weights: list[dict] | dict) -> dict:
  """params without adapters, each layer's adapted weights replaced by weights[layer][target] (or weights[target]
  stacked, for stacked layers)."""
  if isinstance(params["layers"], dict):
    new = {k: (dict(v) if isinstance(v, dict) else v) for k, v in params["layers"].items() if k != KEY}
    for t, w in weights.items():
      new[TARGETS[t].block][TARGETS[t].weight] = w
    return {**params, "layers": new}
  layers = []
  for layer, ws in zip(params["layers"], weights):
    new = {k: (dict(v) if isinstance(v, dict) else v) for k, v in layer.items() if k != KEY}
    for t, w in ws.items():
      new[TARGETS[t].block][TARGETS[t].weight] = w
    layers.append(new)
  return {**params, "layers": layers}


def merged(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
  """(cfg without adapters, params with W + scale * A B in place of each adapted W and no adapters): a forward of
  the merged model is the adapted one up to float rounding."""
  if cfg.lora is None or not has_adapters(params):
    return cfg.replace(lora=None), base_of(params)
  return cfg.replace(lora=None), _with_weights(params, _layer_weights(cfg, params["layers"]))


@functools.partial(jax.jit, static_argnums=0)
def _merged_weights(cfg: ModelConfig, params: dict) -> list[dict] | dict:
  return _layer_weights(cfg, params["layers"])


def sampling_model(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
  """What the sampler runs: a LoRA model merged (one jitted program per rollout computes only the adapted weights;
  the rest are the params' own arrays), anything else as it is. Per decoded token the merged model reads each
  weight once and runs one matmul per projection, where base plus adapters reads W, A and B and runs three."""
  if cfg.lora is None or not has_adapters(params):
    return cfg, params
  return cfg.replace(lora=None), _with_weights(params, _merged_weights(cfg, params))
