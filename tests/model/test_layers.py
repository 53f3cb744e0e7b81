"""model/layers.py: the layer stack's two layouts, and its runs of one remat policy under lax.scan."""

import builders
import jax
import jax.numpy as jnp
import pytest
from jaxpr_util import eqn_count, scan_lengths
from tolerance import assert_trees_close

from hilore_jax import model
from hilore_jax.model import LayerPolicy
from hilore_jax.model.layer import Train, mlp_chunks

KEEP_L = LayerPolicy(remat=True, save=(model.V,), lowp=(model.MLP_NORM,), group_size=8)
SAVE = LayerPolicy(remat=True, save=(model.MLP_GATE, model.Q))
# two runs of two layers, then two one-layer runs: scans, a loop of one, plain calls
PLAN = (model.FULL_REMAT, model.FULL_REMAT, KEEP_L, KEEP_L, model.FULL_REMAT, SAVE)


def _cfg(**kw):
  return builders.tiny_model(num_hidden_layers=len(PLAN), tie_word_embeddings=False, **kw)


def _params(cfg):
  return builders.params(cfg, init_std=0.3, noise=0.1)


IDS = jnp.array([[3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10, 12, 14]])


def _grads(cfg, params, policies):
  loss = lambda q: jnp.sum(model.forward(cfg, q, IDS, layer_policies=policies) ** 2)
  return model.unstacked(jax.jit(jax.grad(loss))(params))


def test_policy_runs():
  assert model.policy_runs(PLAN) == [(0, 2, model.FULL_REMAT), (2, 4, KEEP_L), (4, 5, model.FULL_REMAT), (5, 6, SAVE)]


def test_layouts_round_trip():
  p = _params(_cfg())
  s = model.stacked(p)
  assert model.is_stacked(s) and not model.is_stacked(p) and model.num_layers(s) == model.num_layers(p) == len(PLAN)
  assert s["layers"]["mlp"]["wup_DF"].shape == (len(PLAN), 24, 37)
  assert_trees_close(model.unstacked(s), p, ulps=0)
  assert_trees_close(model.layer_params(s, 4), model.layer_params(p, 4), ulps=0)


@pytest.mark.parametrize("attention", ["xla", pytest.param("blockwise", marks=pytest.mark.slow)])  # quick: one
def test_every_layout_and_structure_gives_the_same_gradients(attention):
  cfg = _cfg(attention=attention, attention_block_q=4, attention_block_k=4)
  p = _params(cfg)
  want = _grads(cfg.replace(scan_layers=False), p, PLAN)  # every layer a plain call, per-layer params
  # the other three of (scanned or plain calls) x (stacked or per-layer params); the layout never reaches the
  # attention (a scan stacks per-layer params first, a plain call reads one layer either way), so blockwise
  # attention, whose custom VJP runs inside the layer scan's, is checked on the train layout's scan alone
  others = ((True, p), (True, model.stacked(p)), (False, model.stacked(p)))
  for scan, params in others if attention == "xla" else others[1:2]:
    # float32 sums in another order (a loop body's fusion): a few ulps of each leaf's scale
    assert_trees_close(_grads(cfg.replace(scan_layers=scan), params, PLAN), want, ulps=256)


def test_a_run_stacks_its_residuals_as_bits_and_reads_its_layers_in_place():
  # XLA:CPU has no bf16 dynamic-slice: bf16 stacks got a float32 copy; a run over layers[a:b] held a copy of them
  cfg = _cfg(dtype="bfloat16")
  p = model.stacked(_params(cfg))
  res = model.saved_residuals(lambda q: jnp.sum(model.forward(cfg, q, IDS, layer_policies=PLAN)), p)
  stacks = [r for r in res if "output of scan" in r.source]
  # per run: the layer inputs, and the kept units (KEEP_L's v, and its mlp_norm code and scales)
  assert {r.shape[0] for r in stacks} == {1, 2} and {r.dtype for r in stacks} == {"u16", "i8", "f32"}, stacks
  assert all(r.shape[-1] == 1 for r in stacks if r.dtype == "f32"), stacks  # float32: only the codes' scales
  # a copy of a run's layers: float32 (the params' dtype) [run length, *one layer's shape], not an argument (a
  # norm's bf16 weight broadcast to [1, D] or its [positions, D] input is no copy)
  layer_shapes = {x.shape[1:] for x in jax.tree_util.tree_leaves(p["layers"])}
  copies = [r for r in res if r.shape[:1] in ((1,), (2,)) and r.shape[1:] in layer_shapes and r.dtype == "f32"
            and not r.source.startswith("from the argument")]
  assert not copies, copies
  args = [r for r in res if r.source.startswith("from the argument q['layers']")]
  assert sorted(r.shape for r in args) == sorted(x.shape for x in jax.tree_util.tree_leaves(p["layers"]))


def test_a_plan_of_a_few_runs_traces_to_the_same_program_at_any_depth():
  def size(depth, scan):
    third = depth // 3
    plan = (SAVE,) * third + (KEEP_L,) * third + (model.FULL_REMAT,) * (depth - 2 * third)
    cfg = _cfg().replace(num_hidden_layers=depth, scan_layers=scan)
    p = model.stacked(model.init_params(cfg, jax.random.PRNGKey(0)))
    loss = lambda q: jnp.sum(model.forward(cfg, q, IDS[:1, :5], layer_policies=plan))
    return eqn_count(jax.make_jaxpr(jax.grad(loss))(p).jaxpr)

  assert size(6, True) == size(12, True) == size(24, True)
  assert size(12, False) > 1.5 * size(6, False)  # every layer a plain call grows with depth


@pytest.mark.slow
def test_a_scanned_plan_compiles_to_what_it_keeps_unrolled():
  # bf16 and blockwise, where the stacked residuals dominate: with a run's layers sliced (a copy) or its bf16
  # residuals stacked as bf16 (XLA:CPU's float32 copy), the scanned program was 17-30% over the unrolled one here
  cfg = model.ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=256, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16", attention="blockwise",
                          attention_block_q=32, attention_block_k=32)
  p = model.stacked(model.init_params(cfg, jax.random.PRNGKey(0)))
  ids = (jnp.arange(16 * 128).reshape(16, 128) * 7) % 97
  keep = LayerPolicy(remat=True, save=(model.ATTN_CTX,))

  def memory(pols, scan, chunk=0):
    c = cfg.replace(scan_layers=scan, mlp_chunk_len=chunk)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(model.forward(c, q, ids, layer_policies=pols))))
    return grad.lower(p).compile().memory_analysis()

  gc = (model.FULL_REMAT,) * 8  # one run over the whole stack
  # measured 1.056: XLA:CPU schedules a loop body's backward on its own, a few buffers apart
  assert memory(gc, True).temp_size_in_bytes <= 1.10 * memory(gc, False).temp_size_in_bytes
  # three runs, a one-layer run last in backward: the compiled peak (temp and the gradients, engine.Step.peak_bytes)
  # measured 1.034 of the unrolled one; 1.10-1.17 with any one of the fixes undone: the residuals stacked as bf16,
  # the one-layer run's cotangent not tied to its weight gradients, or the stacked gradient buffer carried from the
  # first run's backward on (issue 46)
  peak = lambda m: m.temp_size_in_bytes + m.output_size_in_bytes
  pols = (keep,) + (model.FULL_REMAT,) * 4 + (keep,) * 3
  assert peak(memory(pols, True)) <= 1.07 * peak(memory(pols, False))
  # the MLP in 4 chunks of 32 positions (model.mlp_chunk_len): each GC layer's backward holds a chunk's [B, 32, F]
  # intermediates, not [B, 128, F]: measured 0.83 of the unchunked peak, scanned
  assert peak(memory(gc, True, 32)) <= 0.9 * peak(memory(gc, True))


def test_the_mlp_runs_in_chunks_only_where_the_policy_recomputes_it():
  cfg = _cfg(mlp_chunk_len=2)
  assert mlp_chunks(cfg, Train(model.FULL_REMAT), 7) == 4  # ceil(7 / 2): the last chunk padded
  assert mlp_chunks(cfg, Train(LayerPolicy(remat=True, save=(model.V, model.MLP_NORM))), 7) == 4
  assert mlp_chunks(cfg, Train(model.FULL_REMAT), 2) == 1  # no longer than one chunk
  assert mlp_chunks(cfg.replace(mlp_chunk_len=0), Train(model.FULL_REMAT), 7) == 1  # off
  for policy in (model.NO_REMAT, SAVE, KEEP_L, LayerPolicy(remat=True, lowp=(model.MLP_DOWN_IN,))):
    assert mlp_chunks(cfg, Train(policy), 7) == 1, policy  # keeps the MLP's own tensors, or its input as a code
  with pytest.raises(ValueError, match=r"model.mlp_chunk_len must be an integer >= 0"):
    _cfg(mlp_chunk_len=-1)


@pytest.mark.parametrize("scan", [True, False])
def test_a_chunked_mlp_gives_the_same_gradients(scan):
  cfg = _cfg(scan_layers=scan)
  p = model.stacked(_params(cfg))
  loss = lambda c: lambda q: jnp.sum(model.forward(c, q, IDS, layer_policies=PLAN) ** 2)
  chunked = cfg.replace(mlp_chunk_len=2)
  # PLAN's three FULL_REMAT layers chunk (7 positions: 4 chunks of 2, one padded), KEEP_L and SAVE do not: a chunk
  # loop in each (unrolled) or in each of the two FULL_REMAT runs' bodies (scanned); none with chunking off
  assert scan_lengths(jax.make_jaxpr(loss(chunked))(p).jaxpr).count(4) == (2 if scan else 3)
  assert 4 not in scan_lengths(jax.make_jaxpr(loss(cfg.replace(mlp_chunk_len=0)))(p).jaxpr)
  want = jax.jit(jax.grad(loss(cfg.replace(mlp_chunk_len=0))))(p)
  assert_trees_close(jax.jit(jax.grad(loss(chunked)))(p), want, ulps=256)  # float32 sums in another order
