import collections

import jax
import jax.numpy as jnp
import pytest

from hilore_jax import model
from hilore_jax.memory import costmodel, methods
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
  # a layer with an R unit is checkpointed and keeps its input as its (unnamed) argument; without one, the plain
  # (no-remat) program keeps q reshaped (unnamed) unless attention reads it through its VJP
  rerun = {u.layer for u, c in zip(us, plan.choice) if c == R and u.kind not in U.BOUNDARY}
  custom_attn = {u.layer for u, c in zip(us, plan.choice) if c == L and u.kind in (model.Q, model.K, model.V,
                                                                                    model.ATTN_PROBS)}
  for u, c, f in zip(us, plan.choice, plan.formats):
    if c == H and u.kind in U.BOUNDARY and u.layer in rerun:
      continue
    if c == H and u.kind == model.Q and u.layer not in rerun and u.layer not in custom_attn:
      continue
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


@pytest.mark.slow
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


def test_sac_is_the_best_of_its_named_grid(tiny_cfg):
  extra = _budget(tiny_cfg, 0.3)
  plan, _ = _check(tiny_cfg, "sac", extra)
  us, ops = _units(tiny_cfg)
  kept = {u.kind for u, c in zip(us, plan.choice) if c == H}
  assert kept in [set(v) for v in methods.SAC_GRID.values()] and L not in plan.choice
  assert U.ATTN_CTX in methods.SAC_GRID["attn_out"]  # the grid can keep the attention output
  # no single grid entry on every layer that fits is faster
  for names in methods.SAC_GRID.values():
    choice = [H if u.kind in names else R for u in us]
    b, t, _ = methods.evaluate(choice, us, ops)
    assert b > extra or t >= plan.time_s


def test_optimal_hr_is_exact_and_uses_the_graph(tiny_cfg):
  extra = _budget(tiny_cfg, 0.3)
  plan, _ = _check(tiny_cfg, "optimal_hr", extra)
  sac, _ = _check(tiny_cfg, "sac", extra)
  assert L not in plan.choice and plan.time_s <= sac.time_s  # never slower than the per-unit knapsack


def test_uniform_int8_compresses_every_unit_in_two_arms(tiny_cfg):
  us, _ = _units(tiny_cfg)
  # without layer checkpointing: every unit of every layer, the layer input too, nothing recomputed
  plan, saved = _check(tiny_cfg, "uniform_int8", _budget(tiny_cfg, 1.0))
  assert set(plan.choice) == {L} and set(plan.formats) == {"int8"}
  assert not [k for k in saved if k[0] in U.UNITS]  # no float copy of any unit
  layer0 = sum(codec.code_bytes(u.shape, 8) - (u.bytes_h if u.kind in U.BOUNDARY else 0) for u in us if u.layer == 0)
  tight = methods.plan("uniform_int8", us, _units(tiny_cfg)[1], layer0, group_size=8)
  assert tight.choice == plan.choice and tight.bytes > layer0  # ignores the budget (the budget fit falls back to GC)
  # with layer checkpointing: only the layers that fit, the rest recomputed
  small, _ = _check(tiny_cfg, "uniform_int8_gc", layer0)
  assert small.choice.count(L) == len(U.UNITS) and small.choice.count(R) == 2 * len(U.UNITS)


def test_greedy_bits_mixes_widths_by_sensitivity(tiny_cfg):
  us, _ = _units(tiny_cfg)
  sens = {(u.layer, u.kind): 10.0 if u.kind == model.ATTN_CTX else 0.1 for u in us if u.bytes_l}
  # int4 codes of everything, net of the layer inputs they replace
  four = sum(codec.code_bytes(u.shape, 8, "int4") - (u.bytes_h if u.kind in U.BOUNDARY else 0) for u in us)
  for method in ("greedy_bits", "greedy_bits_gc"):
    plan, _ = _check(tiny_cfg, method, int(four * 1.3), sensitivity=sens)
    fmts = [(u.kind, f) for u, f in zip(us, plan.formats) if f]
    assert {f for k, f in fmts if k == model.ATTN_CTX} <= {"int8", "bf16"}  # the sensitive unit goes wider
    assert "int4" in {f for _, f in fmts} and {k for k, _ in fmts} == set(U.UNITS)  # every unit may be compressed


@pytest.mark.slow
def test_hilore_static_and_hilore_compress_within_the_risk_budget(tiny_cfg):
  us, _ = _units(tiny_cfg)
  risk = {(u.layer, u.kind): 1e-6 * (1 + u.layer) for u in us if u.bytes_l}
  extra = _budget(tiny_cfg, 0.45)
  for method in ("hilore_static", "hilore"):
    plan, _ = _check(tiny_cfg, method, extra, risk_of=risk, delta=2.5e-6)
    assert L in plan.choice and plan.risk <= 2.5e-6
    safe, _ = _check(tiny_cfg, method, extra, risk_of=risk, delta=0.0)
    assert L not in safe.choice and safe.time_s >= plan.time_s
    # which budget binds: here both (more bytes or more risk would each buy a faster plan)
    _, ops = _units(tiny_cfg)
    plan_at = lambda d0: lambda a, d=None: methods.plan(method, us, ops, a, risk_of=risk, group_size=8,
                                                        delta=d0 if d is None else d)
    assert methods.active_constraint(method, us, extra, plan, plan_at(2.5e-6)) == "both"
    # a win within the tolerance (the MILP's proven gap in the manager) binds nothing; rtol=1: nothing is faster
    assert methods.active_constraint(method, us, extra, plan, plan_at(2.5e-6), rtol=1.0) == "none"
    free = methods.plan(method, us, ops, extra, risk_of=risk, delta=1.0, group_size=8)
    assert methods.active_constraint(method, us, extra, free, plan_at(1.0)) == "memory"
    greedy = methods.plan(method, us, ops, extra, risk_of=risk, delta=2.5e-6, group_size=8, solver="greedy")
    assert greedy.time_s >= plan.time_s - 1e-9 and greedy.risk <= 2.5e-6  # the exact solver is never slower
    # the MILP's time limit reaches the solver: at 1e-9 s HiGHS has no plan, and greedy's is taken
    capped = methods.plan(method, us, ops, extra, risk_of=risk, delta=2.5e-6, group_size=8, mip_time_limit_s=1e-9)
    assert capped.choice == greedy.choice and capped.choice != plan.choice  # greedy misses the optimum here
  with pytest.raises(ValueError, match="unknown memory.policy"):
    methods.plan("magic", us, {}, 0)


def test_every_layer_keeps_the_choices_any_layer_keeps(tiny_cfg):
  # per-kind risks that rank the L units differently in each layer: each layer's own Pareto pruning drops choices
  # another layer keeps, and a run of layers needs one choice available in all of them
  us, ops = _units(tiny_cfg)
  kinds = sorted({u.kind for u in us if u.bytes_l})
  risk = {(u.layer, u.kind): 1e-6 * (1 + (kinds.index(u.kind) * (u.layer + 1)) % 5) for u in us if u.bytes_l}
  groups = methods.layer_groups(us, ops, risk, allow_l=True, allow_o=False)
  per_layer = [{o.choice for o in g} for g in groups]
  assert all(s == per_layer[0] for s in per_layer)
  cands = [c for c in costmodel.candidates([u for u in us if u.layer == 0], ops) if c.choice in per_layer[0]]
  own = [{o.choice for o in costmodel.layer_options(cands, {k: r for (layer, k), r in risk.items() if layer == g})}
         for g in range(len(groups))]
  assert any(o != per_layer[0] for o in own)  # pruned alone, the layers would differ
  for g, group in enumerate(groups):  # an added choice carries its own layer's risk
    for o in group:
      assert o.risk == pytest.approx(sum(risk.get((g, k), 0.0) for k, c in zip(
          [u.kind for u in us if u.layer == g], o.choice) if c == L))
