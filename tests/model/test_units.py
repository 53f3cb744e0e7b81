import os

import jax
import jax.numpy as jnp
import pytest

from hilore_jax import model
from hilore_jax.memory import profile as units
from hilore_jax.model import units as U


def test_unit_bytes_match_what_backward_saves(tiny_cfg):
  B, T = 2, 7
  us = units.enumerate_units(tiny_cfg, B, T, group_size=8)
  assert len(us) == tiny_cfg.num_hidden_layers * len(U.UNITS)
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  ids = jnp.ones((B, T), jnp.int32)
  save_all = model.LayerPolicy(remat=True, save=U.UNITS)
  res = [r for rs in model.layer_residuals(tiny_cfg, p, ids, (save_all,) * 3) for r in rs]
  for u in us[:len(U.UNITS)]:
    if u.kind in U.BOUNDARY:  # a checkpointed layer keeps its input as its argument (unnamed)
      continue
    hit = [r for r in res if r.name == u.kind]
    assert len(hit) == 3 and hit[0].shape == u.shape, u.kind
    assert u.bytes_h == 4 * jnp.size(jnp.zeros(u.shape))
    if u.kind in model.LOWP_UNITS:
      assert u.bytes_l == u.shape[0] * u.shape[1] * (-(-u.shape[-1] // 8) * (8 + 4)) if len(u.shape) == 3 else True
      assert u.bytes_l < u.bytes_h / 2  # int8 + one float32 scale per group of 8
    else:
      assert u.bytes_l is None


@pytest.mark.slow
def test_profile_is_measured_and_cached(tiny_cfg, tmp_path):
  prof = units.profile_ops(tiny_cfg, 2, 16, group_size=8, reps=3, cache_dir=str(tmp_path))
  assert set(prof["ops"]) == set(U.PRODUCERS) and all(v > 0 for v in prof["ops"].values())
  assert set(prof["codec"]) == set(model.LOWP_UNITS)
  assert all(t > 0 for per in prof["codec"].values() for t in per.values())
  assert prof["offload"] == {}  # CPU: no host offload to time
  files = os.listdir(tmp_path)
  assert len(files) == 1
  again = units.profile_ops(tiny_cfg, 2, 16, group_size=8, reps=3, cache_dir=str(tmp_path))
  assert again == prof  # read back from the cache, not re-measured
  other = units.profile_key(tiny_cfg.replace(dtype="bfloat16"), 2, 16, 8)
  assert other != units.profile_key(tiny_cfg, 2, 16, 8)
  us = units.enumerate_units(tiny_cfg, 2, 16, 8, prof)
  assert us[0].kind in U.BOUNDARY and us[0].recompute_s == 0.0  # the layer input has no producer op
  assert us[1].recompute_s == prof["ops"][U.BY_NAME[us[1].kind].producer]
  assert us[1].codec_s == prof["codec"][us[1].kind]["int8"] and us[1].offload_s is None


def test_profile_inputs_are_one_program(tiny_cfg):
  # the op profile's inputs are built by one compiled program, not an eager dispatch (and a compile) per random
  # tensor and parameter, which was seconds of a cold set-up at a real model's size
  from hilore_jax import runtime
  stats = runtime.CompileStats().install()
  calls = units._op_calls(tiny_cfg, 3, 11)
  assert stats.backend_count == 1 and set(calls) == set(units.producers(tiny_cfg))


def _names(jaxpr) -> list[str]:
  """Every checkpoint name in a jaxpr, sub-jaxprs included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name":
      out.append(eqn.params["name"])
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out.extend(_names(inner))
  return out


def _layer_names(cfg, policy):
  p = model.layer_params(model.init_params(cfg.replace(num_hidden_layers=1), jax.random.PRNGKey(0)), 0)
  B, T = 2, 5
  x = jnp.ones((B, T, cfg.hidden_size))
  ctx = model.LayerCtx(*model.rope_cos_sin(cfg, jnp.broadcast_to(jnp.arange(T), (B, T))),
                       jnp.ones((B, T, T), bool))
  # the backward pass (vjp) traces the custom VJPs of L units too
  fn = lambda p, x: jax.vjp(lambda p, x: model.decoder_layer(cfg, p, x, ctx, model.Train(policy))[0], p, x)[0]
  return _names(jax.make_jaxpr(fn)(p, x).jaxpr)


@pytest.mark.parametrize("attention", ["xla", "dot_product_attention", "blockwise"])
def test_the_table_names_exactly_what_the_decoder_tags(tiny_cfg, attention):
  cfg = tiny_cfg.replace(attention=attention)
  rows = [t.name for t in U.table(attention)]
  names = _layer_names(cfg, None)
  assert sorted(set(names)) == sorted(rows)
  assert len(names) == len(rows)  # each tensor tagged once
  assert (U.ATTN_PROBS in rows) == (attention == "xla")  # the fused kernel has no probabilities tensor
  assert [t.name for t in U.table(attention) if t.unit] == [u for u in U.UNITS if u in rows]
  lowp = model.LayerPolicy(remat=False, lowp=U.LOWP_UNITS)
  codes = set(_layer_names(cfg, lowp)) - set(U.CHECKPOINT_NAMES)
  assert codes == {n for u in U.LOWP_UNITS if u in rows for n in U.code_names(u)}


class _Recorder(dict):
  def __init__(self, tensors):
    super().__init__(tensors)
    self.read = set()

  def __getitem__(self, key):
    self.read.add(key)
    return super().__getitem__(key)


@pytest.mark.parametrize("attention", ["xla", "dot_product_attention", "blockwise"])
def test_each_producer_reads_what_the_table_says(tiny_cfg, attention):
  assert set(model.OPS) == set(U.PRODUCERS) | {U.FUSED_ATTN, U.LORA_OP}  # LoRA's x A: its table's op
  tiny_cfg = tiny_cfg.replace(attention=attention)
  sizes = U.dims(tiny_cfg, 2, 5)
  p = model.layer_params(model.init_params(tiny_cfg.replace(num_hidden_layers=1), jax.random.PRNGKey(0)), 0)
  ctx = model.LayerCtx(*model.rope_cos_sin(tiny_cfg, jnp.broadcast_to(jnp.arange(5), (2, 5))),
                       jnp.ones((2, 5, 5), bool))
  producers = {t.producer: t.reads for t in U.table(attention) if t.producer}
  for t in U.table(attention):
    if t.producer is None:
      continue
    assert producers[t.producer] == t.reads, t.name  # an op reads the same tensors for each output
    rec = _Recorder({n: jnp.ones(U.shape(n, sizes)) for n in U.CHECKPOINT_NAMES})
    out = model.OPS[t.producer](tiny_cfg, p, rec, ctx)
    assert rec.read == set(t.reads), (t.producer, rec.read)
    assert out.shape == U.shape(t.name, sizes), t.name


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["dot_product_attention", "blockwise"])
def test_memory_policies_work_under_the_fused_kernel(tiny_cfg, attention):
  """H and R keep the gradient exact under the fused kernels, L stays within rounding of it."""
  cfg = tiny_cfg.replace(attention=attention, attention_block_q=3, attention_block_k=4)
  p = model.init_params(cfg, jax.random.PRNGKey(0), init_std=0.3)
  ids = jnp.array([[3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10, 12, 14]])
  grad = lambda pol: jax.grad(lambda q: jnp.sum(jnp.tanh(model.forward(cfg, q, ids, layer_policies=(pol,) * 3))))(p)
  flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(g)])
  exact = flat(grad(model.NO_REMAT))
  rel = lambda g: float(jnp.linalg.norm(flat(g) - exact) / jnp.linalg.norm(exact))
  for pol in (model.FULL_REMAT, model.LayerPolicy(remat=True, save=(U.Q, U.K, U.V, U.MLP_GATE))):
    assert rel(grad(pol)) < 1e-5  # float32 reassociation only
  # every unit L (q, k and v through the fused kernel's own VJP, as kept), and L beside H and R
  for pol in (model.LayerPolicy(remat=False, lowp=U.LOWP_UNITS, group_size=8),
              model.LayerPolicy(remat=True, save=(U.MLP_GATE,), lowp=(U.Q, U.K, U.V, U.ATTN_CTX), group_size=8)):
    err = rel(grad(pol))
    assert 1e-5 < err < 0.05, (pol, err)
  codes = {r.name for rs in model.layer_residuals(cfg, p, ids, (model.LayerPolicy(remat=False, lowp=(U.Q, U.K, U.V),
                                                                                  group_size=8),) * 3)
           for r in rs if r.name}
  assert {n for u in (U.Q, U.K, U.V) for n in U.code_names(u)} <= codes and not {U.Q, U.K, U.V} & codes
  # what backward keeps follows the policy: q as H, the L units as codes, never a probabilities tensor
  kept = {r.name for rs in model.layer_residuals(cfg, p, ids, (model.LayerPolicy(remat=True, save=(U.Q,)),) * 3)
          for r in rs if r.name}
  assert kept == {U.Q}
