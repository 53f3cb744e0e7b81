import collections

import jax
import jax.numpy as jnp
import pytest

from hilore_jax import model
from hilore_jax.memory import methods
from hilore_jax.memory import profile as units
from hilore_jax.memory.allocator import H, L, R
from hilore_jax.model import codec
from hilore_jax.model import units as U

B, T = 2, 9
IDS = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) % 29 + 1


def _units(cfg):
  # op times in proportion to their FLOPs, so the plans are deterministic
  ops = {"attn_norm_op": 1.0, "q_proj": 5.0, "k_proj": 3.0, "v_proj": 3.0, "scores": 4.0, "pv": 4.0, "o_proj": 5.0,
         "mlp_norm_op": 1.0, "gate_proj": 8.0, "up_proj": 8.0, "act": 1.0}
  prof = {"ops": ops, "codec": {k: {f: 0.2 for f in codec.FORMATS} for k in model.LOWP_UNITS}}
  return units.enumerate_units(cfg, B, T, 8, prof), ops


def _saved(cfg, pols):
  p = model.init_params(cfg, jax.random.PRNGKey(0))
  res = [r for rs in model.layer_residuals(cfg, p, IDS, pols) for r in rs]
  return collections.Counter((r.name, r.dtype) for r in res if r.name)


def _expected(plan, us):
  """(name, dtype) -> count the plan says backward keeps."""
  out = collections.Counter()
  short = {"int8": "i8", "fp8_e4m3": "f8_e4m3fn", "int4": "u8", "bf16": "bf16"}
  for u, c, f in zip(us, plan.choice, plan.formats):
    if c == H:
      out[(u.kind, "f32")] += 1
    elif c == L:
      out[(f"{u.kind}:code", short[f])] += 1
      out[(f"{u.kind}:scale", "f32")] += 1
  return out


def _check(cfg, method, extra, **kw):
  us, ops = _units(cfg)
  plan = methods.plan(method, us, ops, extra, group_size=8, **kw)
  assert plan.bytes <= extra or method in ("none",)
  saved = _saved(cfg, methods.policies(plan, us, cfg.num_hidden_layers, 8, method))
  kept = {k: v for k, v in saved.items() if k[0] in U.UNITS or ":" in k[0]}
  if method != "none":
    assert kept == _expected(plan, us), method  # exactly what the plan keeps, in the form it claims
  return plan, saved


def _budget(cfg, share):
  us, _ = _units(cfg)
  return int(share * sum(u.bytes_h for u in us))


def test_none_keeps_everything_and_gc_keeps_only_layer_inputs(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  probs = (B, tiny_cfg.num_key_value_heads, tiny_cfg.num_attention_heads // tiny_cfg.num_key_value_heads, T, T)
  us, ops = _units(tiny_cfg)
  shapes = {}
  for method in ("none", "gc"):
    plan = methods.plan(method, us, ops, 0)
    pols = methods.policies(plan, us, tiny_cfg.num_hidden_layers, 8, method)
    res = [r for rs in model.layer_residuals(tiny_cfg, p, IDS, pols) for r in rs]
    shapes[method] = [r.shape for r in res]
    assert set(plan.choice) == {H if method == "none" else R}
    if method == "gc":
      assert not [r for r in res if r.name]  # nothing named inside a layer is kept: only its input (an argument)
  assert shapes["none"].count(probs) >= tiny_cfg.num_hidden_layers and probs not in shapes["gc"]
  assert len(shapes["none"]) > 2 * len(shapes["gc"])  # (both include the parameters)


def test_sac_keeps_only_matmul_outputs(tiny_cfg):
  plan, _ = _check(tiny_cfg, "sac", _budget(tiny_cfg, 0.3))
  us, _ = _units(tiny_cfg)
  kept = {u.kind for u, c in zip(us, plan.choice) if c == H}
  assert kept and kept <= set(U.MATMUL_UNITS) and L not in plan.choice


def test_optimal_hr_is_exact_and_uses_the_graph(tiny_cfg):
  extra = _budget(tiny_cfg, 0.3)
  plan, _ = _check(tiny_cfg, "optimal_hr", extra)
  sac, _ = _check(tiny_cfg, "sac", extra)
  assert L not in plan.choice and plan.time_s <= sac.time_s  # never slower than the per-unit knapsack


def test_uniform_int8_compresses_every_compressible_unit(tiny_cfg):
  plan, _ = _check(tiny_cfg, "uniform_int8", _budget(tiny_cfg, 1.0))
  us, _ = _units(tiny_cfg)
  assert all((c == L) == (u.bytes_l is not None) for u, c in zip(us, plan.choice))
  assert set(f for f in plan.formats if f) == {"int8"}
  small, _ = _check(tiny_cfg, "uniform_int8", sum(u.bytes_l for u in us if u.bytes_l and u.layer == 0))
  assert small.choice.count(L) == len(model.LOWP_UNITS)  # only the first layer fits


def test_greedy_bits_mixes_widths_by_sensitivity(tiny_cfg):
  us, _ = _units(tiny_cfg)
  sens = {(u.layer, u.kind): 10.0 if u.kind == model.ATTN_CTX else 0.1 for u in us if u.bytes_l}
  four = sum(codec.code_bytes(u.shape, 8, "int4") for u in us if u.bytes_l)
  plan, _ = _check(tiny_cfg, "greedy_bits", int(four * 1.6), sensitivity=sens)
  fmts = {u.kind: f for u, f in zip(us, plan.formats) if f}
  assert fmts[model.ATTN_CTX] in ("int8", "bf16") and "int4" in set(fmts.values())  # the sensitive unit goes wider


def test_adacc_and_hilore_compress_within_the_risk_budget(tiny_cfg):
  us, _ = _units(tiny_cfg)
  risk = {(u.layer, u.kind): 1e-6 * (1 + u.layer) for u in us if u.bytes_l}
  extra = _budget(tiny_cfg, 0.45)
  for method in ("adacc_style", "hilore"):
    plan, _ = _check(tiny_cfg, method, extra, risk_of=risk, delta=2.5e-6)
    assert L in plan.choice and plan.risk <= 2.5e-6
    safe, _ = _check(tiny_cfg, method, extra, risk_of=risk, delta=0.0)
    assert L not in safe.choice and safe.time_s >= plan.time_s
  with pytest.raises(ValueError, match="unknown memory.policy"):
    methods.plan("magic", us, {}, 0)
