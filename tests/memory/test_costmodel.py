import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.memory import costmodel, methods
from hilore_jax.memory import profile as units
from hilore_jax.memory.allocator import H, L, R
from hilore_jax.model import units as U


def test_rerun_ops_follow_the_layer_graph():
  # every producer but the output projection (nothing backward reads comes after it)
  every = set(U.PRODUCERS) - {"down_proj"}
  assert costmodel.rerun_ops({}) == every  # full checkpointing reruns the whole layer
  # q/k/v kept: attention still reruns scores and pv (probs are R here), and the q/k/v input is still needed
  # for their weight gradients, so its norm reruns unless it is kept H or L
  kept_qkv = {model.Q: H, model.K: H, model.V: H}
  assert {"q_proj", "k_proj", "v_proj"}.isdisjoint(costmodel.rerun_ops(kept_qkv))
  assert "attn_norm_op" in costmodel.rerun_ops(kept_qkv)
  assert "attn_norm_op" not in costmodel.rerun_ops({**kept_qkv, model.ATTN_NORM: L})
  # L of the q/k/v input alone saves nothing: q, k, v must be recomputed from an exact input
  assert costmodel.rerun_ops({model.ATTN_NORM: L}) == every
  # keeping the MLP input spares o_proj; gate/up kept + L inputs spare the whole MLP but the activation product
  mlp = {model.MLP_INPUT: H, model.MLP_GATE: H, model.MLP_UP: H, model.MLP_NORM: L, model.MLP_DOWN_IN: L}
  assert costmodel.rerun_ops(mlp) & {"o_proj", "mlp_norm_op", "gate_proj", "up_proj", "act"} == set()
  assert "act" in costmodel.rerun_ops({**mlp, model.MLP_DOWN_IN: R})


@pytest.mark.slow
def test_no_rerun_choice_really_recomputes_nothing(tiny_cfg):
  # matmul outputs H, everything else but the layer input L: the cost model says backward reruns nothing, and under
  # remat the compiled step has (almost) No-GC's FLOPs: the codes serve every backward read
  keep = (model.Q, model.K, model.V, model.MLP_INPUT, model.MLP_GATE, model.MLP_UP)
  lowp = tuple(u for u in U.UNITS if u not in keep + (model.LAYER_INPUT,))
  pol = model.LayerPolicy(remat=True, save=keep, lowp=lowp, group_size=8)
  assert costmodel.rerun_ops({**{k: H for k in keep}, **{k: L for k in lowp}}) == set()
  assert costmodel.rerun_ops({**{k: H for k in keep}, **{k: L for k in lowp}, model.ATTN_PROBS: R}) == {"scores"}
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  ids = jnp.ones((2, 9), jnp.int32)

  def flops(pols):
    g = jax.jit(jax.grad(lambda q: jnp.sum(model.forward(tiny_cfg, q, ids, layer_policies=pols))))
    return g.lower(p).compile().cost_analysis()["flops"]

  f_none, f_gc, f_plan = flops((model.NO_REMAT,) * 3), flops((model.FULL_REMAT,) * 3), flops((pol,) * 3)
  assert f_plan < f_gc
  assert (f_plan - f_none) < 0.4 * (f_gc - f_none)  # GC's recompute is gone; what is left is mostly the codec


def test_layer_input_l_only_without_any_rerun(tiny_cfg):
  us = units.enumerate_units(tiny_cfg, 2, 9, 8, {"ops": {op: 1.0 for op in U.PRODUCERS}, "codec": {}})
  cands = costmodel.candidates([u for u in us if u.layer == 0], {op: 1.0 for op in U.PRODUCERS})
  with_input_l = [c for c in cands if model.LAYER_INPUT in c.lowp]
  assert with_input_l and all(R not in c.choice for c in with_input_l)
  assert all(c.time_s == 0 for c in with_input_l)  # codec time 0 here: nothing reruns
  layer_input = next(u for u in us if u.kind == model.LAYER_INPUT)
  # its L is a saving against full checkpointing (which keeps the layer input already)
  assert costmodel.unit_bytes(layer_input, L) == layer_input.bytes_l - layer_input.bytes_h < 0


def test_candidates_are_pareto_and_risk_prunes(tiny_cfg):
  ops = {op: 1.0 + i for i, op in enumerate(sorted(set(U.PRODUCERS) - {"down_proj"}))}
  us = units.enumerate_units(tiny_cfg, 2, 9, 8, {"ops": ops, "codec": {k: {"int8": 0.01} for k in model.LOWP_UNITS}})
  layer0 = [u for u in us if u.layer == 0]
  cands = costmodel.candidates(layer0, ops)
  assert any(c.lowp for c in cands) and any(not c.lowp for c in cands)
  # pairwise, as the cost model's pruning once was: no candidate beats another on every count (L sets as bits; in
  # blocks of rows, numpy: a Python loop over the ~5*10^7 pairs took 5 s)
  kinds = sorted({k for c in cands for k in c.lowp})
  b, t = np.array([c.bytes for c in cands], float), np.array([c.time_s for c in cands])
  s = np.array([sum(1 << kinds.index(k) for k in c.lowp) for c in cands])
  for lo in range(0, len(cands), 512):
    bc, tc, sc = b[lo:lo + 512, None], t[lo:lo + 512, None], s[lo:lo + 512, None]
    beats = (b <= bc) & (t <= tc + 1e-15) & ((s & sc) == s) & ((b < bc) | (t < tc - 1e-15) | (s != sc))
    assert not beats.any(), [cands[lo + i] for i in np.flatnonzero(beats.any(1))[:3]]
  opts = costmodel.layer_options(cands, {k: 1.0 for k in model.LOWP_UNITS})
  b, t = np.array([o.bytes for o in opts]), np.array([o.time_s for o in opts])
  for i in range(len(opts)):  # nothing dominated remains
    assert not np.any((b <= b[i]) & (t <= t[i]) & ((b < b[i]) | (t < t[i])) &
                      (np.array([o.risk for o in opts]) <= opts[i].risk))
  assert min(o.bytes for o in opts) == 0 and max(o.time_s for o in opts) == sum(ops.values())


def _pairwise_options(cands, risk_of):
  """layer_options by its definition: every pair of rows compared."""
  r = [sum(risk_of.get(k, 0.0) for k in c.lowp) for c in cands]
  beats = lambda j, i: (cands[j].bytes <= cands[i].bytes and cands[j].time_s <= cands[i].time_s + 1e-15 and
                        r[j] <= r[i] and (cands[j].bytes < cands[i].bytes or
                                          cands[j].time_s < cands[i].time_s - 1e-15 or r[j] < r[i]))
  return [(c.choice, c.bytes, c.time_s, r[i]) for i, c in enumerate(cands)
          if not any(beats(j, i) for j in range(len(cands)))]


def test_layer_options_are_the_pairwise_pareto_set():
  got = lambda cands, risk_of: [(o.choice, o.bytes, o.time_s, o.risk) for o in costmodel.layer_options(cands, risk_of)]
  # within the time tolerance beating is not transitive: c is beaten by b alone, which a beats (a's 1.8e-15 s is
  # over c's 0 by more than 1e-15); 254 more rows a beats put c in the second chunk of rows, b in the first
  chain = ([costmodel.Candidate(("a",), 0, 1.8e-15, ()), costmodel.Candidate(("b",), 1, 0.9e-15, ())] +
           [costmodel.Candidate(("x", str(i)), 2, 1.0, ()) for i in range(254)] +
           [costmodel.Candidate(("c",), 3, 0.0, ())])
  assert got(chain, {}) == _pairwise_options(chain, {}) == [(("a",), 0, 1.8e-15, 0)]
  # ties in every count, times a fraction of the tolerance apart, risks of any L set
  rng = np.random.default_rng(0)
  kinds = ("q", "k", "v")
  for n in (0, 1, 7, 300):
    cands = [costmodel.Candidate((str(i),), int(rng.integers(0, 6)),
                                 float(rng.integers(0, 5) * 1e-3 + rng.choice([0.0, 5e-16, -5e-16, 2e-15])),
                                 tuple(k for k in kinds if rng.random() < 0.4)) for i in range(n)]
    risk_of = {"q": 0.1, "k": 0.2, "v": 0.30000000000000004}
    assert got(cands, risk_of) == _pairwise_options(cands, risk_of)


@pytest.mark.slow
def test_plan_bytes_are_exactly_what_backward_keeps(tiny_cfg):
  # every Pareto layer choice, as the methods turn it into a policy, keeps exactly the cost model's bytes on top of
  # full checkpointing: nothing unmodelled (norm statistics, RoPE tables) rides along, L layer input included
  cfg = tiny_cfg.replace(num_hidden_layers=1)
  B, T, group = 3, 7, 8
  us = units.enumerate_units(cfg, B, T, group, {"ops": {op: 1.0 for op in U.PRODUCERS}, "codec": {}})
  cands = costmodel.candidates(us, {op: 1.0 for op in U.PRODUCERS})
  p = model.init_params(cfg, jax.random.PRNGKey(0))
  ids = jnp.ones((B, T), jnp.int32)

  def kept(pol):
    (res,) = model.layer_residuals(cfg, p, ids, (pol,))
    itemsize = {"f32": 4, "i8": 1, "bool": 1}
    return sum(int(np.prod(r.shape)) * itemsize[r.dtype] for r in res
               if "argument p" not in r.source)  # parameters are there anyway

  base = kept(model.FULL_REMAT)
  rng = np.random.default_rng(0)
  picks = [cands[i] for i in rng.choice(len(cands), 12, replace=False)]
  picks.append(next(c for c in cands if model.LAYER_INPUT in c.lowp and len(c.lowp) == 1))
  for c in picks:
    plan = methods.Plan(c.choice, tuple("int8" if x == L else None for x in c.choice), c.bytes, 0.0, 0.0)
    (pol,) = methods.policies(plan, us, 1, group)
    assert kept(pol) - base == c.bytes, c.choice


def test_lowp_kinds_keep_l_to_the_kinds_named(tiny_cfg):
  # memory.lowp_kinds: only those kinds get an L option in any layer choice the solvers pick from; with every kind
  # allowed the choices code others too
  ops = {op: 1.0 for op in U.PRODUCERS}
  prof = {"ops": ops, "codec": {k: {"int8": 0.01} for k in model.LOWP_UNITS}}
  kinds = (model.ATTN_NORM, model.MLP_DOWN_IN)

  def coded(lowp_kinds):
    us = units.enumerate_units(tiny_cfg, 2, 9, 8, prof, lowp_kinds=lowp_kinds)
    return us, {k for c in costmodel.candidates([u for u in us if u.layer == 0], ops) for k in c.lowp}

  us, chosen = coded(kinds)
  assert {u.kind for u in us if u.bytes_l is not None} == set(kinds)
  assert chosen == set(kinds)
  assert coded(())[1] == set(model.LOWP_UNITS)
  from hilore_jax.errors import ConfigError
  from hilore_jax.memory.config import MemoryConfig
  with pytest.raises(ConfigError, match="memory.lowp_kinds: \\['attn_out'\\] cannot be low-precision"):
    MemoryConfig(lowp_kinds=("attn_out",))
  with pytest.raises(ConfigError, match="uniform_int8.*codes every unit"):
    MemoryConfig(policy="uniform_int8", lowp_kinds=kinds)


@pytest.mark.slow
@pytest.mark.parametrize("targets", [model.config.LORA_TARGETS, ("q", "v", "down")])
def test_lora_plan_bytes_are_exactly_what_backward_keeps(tiny_cfg, targets):
  # LoRA: the frozen weights read no input in backward, a projection input is kept only for its adapters' A
  # gradients (none without an adapter: no unit), and the adapters' x A is one more unit; every Pareto layer choice
  # keeps exactly the cost model's bytes on top of full checkpointing, as without LoRA
  from hilore_jax.model.config import LoraSpec

  cfg = tiny_cfg.replace(num_hidden_layers=1, lora=LoraSpec(3, 6.0, targets))
  B, T, group = 3, 7, 8
  ops = {op: 1.0 for op in units.producers(cfg)}
  us = units.enumerate_units(cfg, B, T, group, {"ops": ops, "codec": {}})
  kinds = [u.kind for u in us]
  assert kinds[-1] == model.units.LORA_XA and us[-1].shape == (B, T, 3 * len(targets))
  assert (model.ATTN_CTX in kinds) == ("o" in targets)  # an unread input is no unit
  cands = costmodel.candidates(us, ops)
  p = model.init_params(cfg, jax.random.PRNGKey(0))
  ids = jnp.ones((B, T), jnp.int32)

  def kept(pol):
    (res,) = model.layer_residuals(cfg, p, ids, (pol,))
    itemsize = {"f32": 4, "i8": 1, "bool": 1}
    return sum(int(np.prod(r.shape)) * itemsize[r.dtype] for r in res if "argument p" not in r.source)

  base = kept(model.FULL_REMAT)
  rng = np.random.default_rng(1)
  picks = [cands[i] for i in rng.choice(len(cands), 10, replace=False)]
  with_input_l = [c for c in cands if model.LAYER_INPUT in c.lowp]
  # the layer input's L needs every unit of the full table kept (LayerPolicy checks those): an unread input is none
  assert bool(with_input_l) == (len(targets) == 7)
  picks += with_input_l[:1]
  alone = (H,) + (R,) * (len(us) - 2) + (H,)  # x A alone kept (no Pareto choice at these equal op times)
  picks = [(c.choice, c.bytes) for c in picks] + [(alone, costmodel.choice_bytes(dict(zip(kinds, alone)), us))]
  for choice, predicted in picks:
    plan = methods.Plan(choice, tuple("int8" if x == L else None for x in choice), predicted, 0.0, 0.0)
    (pol,) = methods.policies(plan, us, 1, group)
    assert kept(pol) - base == predicted, choice
  assert picks[-1][1] == 4 * B * T * 3 * len(targets)
  # the x A unit is what the adapters' B gradients read: kept, its producer is not rerun
  assert "lora_a" in costmodel.rerun_ops({}, model.units.lora_rows(kinds))
  assert "lora_a" not in costmodel.rerun_ops({model.units.LORA_XA: H}, model.units.lora_rows(kinds))
