import chex
import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close

from hilore_jax import model
from hilore_jax.model import LayerPolicy, codec
from hilore_jax.model import units as U


def test_int8_codes_by_hand():
  x = jnp.array([[1.0, -2.0, 0.5, 0.0, 127.0]])
  codes, scale = codec.encode(x, "int8", 3)  # groups [1, -2, .5] and [0, 127, pad]
  np.testing.assert_allclose(scale[..., 0], [[2 / 127, 1.0]], rtol=1e-6)
  assert codes.dtype == jnp.int8
  # round(127/2) = 64 (half-even: 63.5 -> 64)
  assert codes[0, 0].tolist() == [64, -127, 32] and codes[0, 1].tolist() == [0, 127, 0]
  back = codec.decode(codes, scale, x.shape, jnp.float32, "int8")
  assert np.all(np.abs(back - x) <= np.repeat(np.asarray(scale[..., 0]), 3, -1)[..., :5] / 2 + 1e-7)
  assert codec.code_bytes((2, 5), group_size=3) == 2 * (6 + 8)


def test_bounded_error_on_random_data():
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 7, 50)) * 3
  codes, scale = codec.encode(x, "int8", 16)
  err = jnp.abs(codec.decode(codes, scale, x.shape, jnp.float32, "int8") - x)
  assert float(err.max()) <= float(scale.max()) / 2 + 1e-6
  assert 0 < float(jnp.linalg.norm(err) / jnp.linalg.norm(x)) < 0.01


def _params(cfg):
  return builders.params(cfg, init_std=0.3, noise=0.1)


def _loss(cfg, p, ids, policies):
  return jnp.sum(jax.nn.log_softmax(model.forward(cfg, p, ids, layer_policies=policies))[..., 1:4] ** 2)


IDS = jnp.array([[3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10, 12, 14]])
HLR = LayerPolicy(remat=True, save=(model.MLP_GATE, model.MLP_UP, model.Q, model.K, model.V),
                  lowp=(model.MLP_DOWN_IN, model.ATTN_CTX), group_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,short", [("float32", "f32"), ("bfloat16", "bf16")])
def test_saved_residuals_prove_h_l_r(tiny_cfg, dtype, short):
  cfg = tiny_cfg.replace(dtype=dtype)
  p = _params(cfg)
  res = [r for rs in model.layer_residuals(cfg, p, IDS, (HLR,) * 3) for r in rs]
  names = [r.name for r in res]
  for name in HLR.save:  # H: saved, in compute dtype
    hits = [r for r in res if r.name == name]
    assert len(hits) == 3 and all(r.dtype == short for r in hits), name
  for unit in HLR.lowp:  # L: int8 codes + float32 scales, no float copy
    cname, sname = U.code_names(unit)
    assert [r.dtype for r in res if r.name == cname] == ["i8"] * 3
    assert [r.dtype for r in res if r.name == sname] == ["f32"] * 3
    assert unit not in names
  for unit in (model.ATTN_NORM, model.MLP_NORM, model.ATTN_PROBS, model.MLP_SILU):  # R: absent
    assert unit not in names
  # the int8 code of mlp_down_in has the float tensor's element count (F=37 padded to groups of 8 -> 40)
  code = next(r for r in res if r.name == "mlp_down_in:code")
  assert code.shape == (2, 7, 5, 8)


@pytest.mark.slow
def test_r_and_h_exact_l_bounded(tiny_cfg):
  p = _params(tiny_cfg)
  grad = lambda pols: jax.jit(jax.grad(_loss, argnums=1), static_argnums=(0, 3))(tiny_cfg, p, IDS, pols)
  flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(g)])
  rel_err = lambda g, ref: float(jnp.linalg.norm(flat(g) - flat(ref)) / jnp.linalg.norm(flat(ref)))
  g_h = grad((model.NO_REMAT,) * 3)
  g_r = grad((model.FULL_REMAT,) * 3)
  assert rel_err(g_r, g_h) <= 1e-5  # recomputation is exact up to float reassociation
  assert float(jnp.abs(flat(g_r) - flat(g_h)).max()) <= 1e-5 * float(jnp.abs(flat(g_h)).max())
  chex.assert_trees_all_close(g_r, g_h, rtol=1e-5, atol=1e-5 * float(jnp.abs(flat(g_h)).max()))
  chex.assert_trees_all_equal_shapes_and_dtypes(g_r, g_h)
  all_l = LayerPolicy(remat=False, lowp=model.LOWP_UNITS, group_size=8)
  g_l = grad((all_l,) * 3)
  rel = rel_err(g_l, g_h)
  print(f"relative gradient error with every unit L int8: {rel:.2e}")
  assert 1e-6 < rel < 0.05  # really quantized, and bounded
  # backward reads the codes, the forward never does: the loss is the exact one up to float reassociation (two
  # programs); an L code in the forward would move it ~1e-3
  assert_close(_loss(tiny_cfg, p, IDS, (all_l,) * 3), _loss(tiny_cfg, p, IDS, (model.NO_REMAT,) * 3), ulps=64)


@pytest.mark.parametrize("fmt,bound", [("int8", 1 / 254), ("fp8_e4m3", 1 / 16), ("int4", 1 / 14), ("bf16", 1 / 256)])
def test_formats_round_trip_within_their_step(fmt, bound):
  x = jax.random.normal(jax.random.PRNGKey(3), (3, 5, 21)) * 4
  codes, scale = codec.encode(x, fmt, 6)
  back = codec.decode(codes, scale, x.shape, jnp.float32, fmt)
  absmax = np.repeat(np.abs(np.asarray(scale[..., 0])) * {"int8": 127, "fp8_e4m3": 448, "int4": 7, "bf16": 1}[fmt],
                     6, -1)[..., :21]
  err = np.abs(np.asarray(back - x))
  assert np.all(err <= bound * absmax + 1e-6), fmt
  assert err.max() > 0  # really lossy
  assert codes.size * codes.dtype.itemsize + scale.size * 4 == codec.code_bytes(x.shape, 6, fmt)


def test_int4_packs_two_codes_per_byte():
  x = jnp.array([[7.0, -7.0, 0.0, 3.0, 1.0]])  # groups of 4 (odd 5 padded): [7,-7,0,3], [1,pad,pad,pad]
  codes, scale = codec.encode(x, "int4", 4)
  assert codes.dtype == jnp.uint8 and codes.shape == (1, 2, 2)
  assert codes[0, 0].tolist() == [15 | (1 << 4), 8 | (11 << 4)]
  np.testing.assert_allclose(codec.decode(codes, scale, x.shape, jnp.float32, "int4"), x, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,short", [("fp8_e4m3", "f8_e4m3fn"), ("int4", "u8"), ("bf16", "bf16")])
def test_other_formats_saved_as_their_codes(tiny_cfg, fmt, short):
  p = _params(tiny_cfg)
  pol = LayerPolicy(remat=True, lowp=(model.MLP_DOWN_IN, model.ATTN_CTX), formats=(fmt, "int8"), group_size=8)
  res = [r for rs in model.layer_residuals(tiny_cfg, p, IDS, (pol,) * 3) for r in rs]
  assert [r.dtype for r in res if r.name == "mlp_down_in:code"] == [short] * 3
  assert [r.dtype for r in res if r.name == "attn_ctx:code"] == ["i8"] * 3
  g = lambda pols: jax.grad(_loss, argnums=1)(tiny_cfg, p, IDS, pols)
  flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)])
  ref = flat(g((model.NO_REMAT,) * 3))
  assert 0 < float(jnp.linalg.norm(flat(g((pol,) * 3)) - ref) / jnp.linalg.norm(ref)) < 0.05


def test_offload_is_refused_on_cpu(tiny_cfg):
  from hilore_jax.errors import OffloadUnsupported
  from hilore_jax.memory import methods, profile

  assert not model.offload_supported()
  us = profile.enumerate_units(tiny_cfg, 2, 9, 8)
  plan = methods.Plan(tuple("O" if u.kind == model.MLP_GATE else "R" for u in us), (None,) * len(us), 0, 0.0, 0.0)
  with pytest.raises(OffloadUnsupported, match=r"offloading \['mlp_gate'\] \(O\) is unsupported on the cpu backend"):
    methods.policies(plan, us, tiny_cfg.num_hidden_layers, 8)


def test_policy_validation():
  with pytest.raises(ValueError, match=r"LayerPolicy.lowp: \['mlp_silu'\] are not valid here"):
    LayerPolicy(remat=True, lowp=(model.MLP_SILU,))
  with pytest.raises(ValueError, match="more than one of H"):
    LayerPolicy(remat=True, save=(model.MLP_NORM,), lowp=(model.MLP_NORM,))
  with pytest.raises(ValueError, match="only apply when remat"):
    LayerPolicy(save=(model.MLP_NORM,))
  with pytest.raises(ValueError, match=r"may be L under remat only when no other unit is recomputed; \['attn_ctx'"):
    LayerPolicy(remat=True, lowp=(model.LAYER_INPUT,))
  # nothing else recomputed (the probabilities may be): the layer's input is not needed exactly
  LayerPolicy(remat=True, lowp=(model.LAYER_INPUT,), save=tuple(u for u in U.UNITS if u not in (
      model.LAYER_INPUT, model.ATTN_PROBS)))
  LayerPolicy(lowp=(model.MLP_NORM, model.LAYER_INPUT))  # no remat: L without any recompute
  with pytest.raises(ValueError, match=r"unknown low-precision formats \['int3'\]"):
    LayerPolicy(remat=True, lowp=(model.MLP_NORM,), formats=("int3",))
  with pytest.raises(ValueError, match="more than one of H"):
    LayerPolicy(remat=True, save=(model.MLP_GATE,), offload=(model.MLP_GATE,))


def _layer_saved(cfg, policy):
  p = _params(cfg.replace(num_hidden_layers=1))
  (res,) = model.layer_residuals(cfg.replace(num_hidden_layers=1), p, IDS, (policy,))
  return res


@pytest.mark.slow
@pytest.mark.parametrize("unit", U.UNITS)
def test_each_unit_l_keeps_only_its_code(tiny_cfg, unit):
  # without remat every other unit is kept (H); with remat (not for the layer input, which a checkpointed layer
  # keeps as its argument) nothing else is named: in both the unit's float tensor is gone and its code is there
  for remat in (False, True) if unit != model.LAYER_INPUT else (False,):
    pol = LayerPolicy(remat=remat, lowp=(unit,), group_size=8)
    res = _layer_saved(tiny_cfg, pol)
    names = [r.name for r in res if r.name]
    cname, sname = U.code_names(unit)
    assert [r.dtype for r in res if r.name == cname] == ["i8"] and [r.dtype for r in res if r.name == sname] == ["f32"]
    assert unit not in names, (unit, remat)
    others = {n for n in names if ":" not in n}
    if remat:
      assert not others, (unit, others)
    else:  # the rest stays H (q is kept reshaped, unnamed, unless the attention reads it through its VJP)
      assert set(U.UNITS) - {unit, model.Q} <= others <= set(U.CHECKPOINT_NAMES) - {unit}, (unit, others)


def test_every_unit_l_in_every_format(tiny_cfg):
  fmts = ("int8", "fp8_e4m3", "int4", "bf16")
  short = {"int8": "i8", "fp8_e4m3": "f8_e4m3fn", "int4": "u8", "bf16": "bf16"}
  chosen = tuple(fmts[i % 4] for i in range(len(U.UNITS)))
  pol = LayerPolicy(remat=False, lowp=U.UNITS, formats=chosen, group_size=8)
  res = _layer_saved(tiny_cfg, pol)
  assert not [r for r in res if r.name in U.CHECKPOINT_NAMES]  # no float copy of anything the layer tags
  for unit, fmt in zip(U.UNITS, chosen):
    assert [r.dtype for r in res if r.name == U.code_names(unit)[0]] == [short[fmt]], unit


@pytest.mark.slow
def test_l_unit_is_not_recomputed(tiny_cfg):
  # the layer keeps every unit but q: as L (code) backward reruns nothing; as R it reruns q's projection
  p = _params(tiny_cfg)
  rest = tuple(u for u in U.UNITS if u not in (model.Q, model.LAYER_INPUT))
  flops = lambda pol: jax.jit(jax.grad(_loss, argnums=1), static_argnums=(0, 3)).lower(
      tiny_cfg, p, IDS, (pol,) * 3).compile().cost_analysis()["flops"]
  f_l = flops(LayerPolicy(remat=True, save=rest, lowp=(model.Q,), group_size=8))
  f_r = flops(LayerPolicy(remat=True, save=rest, group_size=8))
  f_h = flops(model.NO_REMAT)
  assert f_l < f_r and f_l - f_h < 0.5 * (f_r - f_h)  # (the codec's own FLOPs are the rest)
