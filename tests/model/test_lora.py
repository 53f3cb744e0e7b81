import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerance import assert_close, assert_trees_close

from hilore_jax import model
from hilore_jax.model import lora
from hilore_jax.model import units as U
from hilore_jax.model.config import LoraSpec
from hilore_jax.rl import rollout, train_state, train_step
from hilore_jax.rl.config import GRPOConfig, SamplingConfig
from hilore_jax.rl.update_batch import UpdateBatch


def _lora_cfg(cfg, targets=model.config.LORA_TARGETS, rank=3, alpha=5.0, dropout=0.0):
  return cfg.replace(lora=LoraSpec(rank, alpha, tuple(targets), dropout))


def _trained(cfg, params, seed=1, std=0.2):
  """params with every adapter's B moved off zero (a fresh adapter changes nothing)."""
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 * cfg.num_hidden_layers * 7))
  layers = [{**layer, lora.KEY: {t: {"A": ad["A"], "B": std * jax.random.normal(next(keys), ad["B"].shape)}
                                 for t, ad in layer[lora.KEY].items()}} for layer in params["layers"]]
  return {**params, "layers": layers}


def test_adapters_start_like_peft_and_leave_the_base_alone(tiny_cfg):
  cfg = _lora_cfg(tiny_cfg, rank=5)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  base = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  assert_trees_close(lora.base_of(params), base, ulps=0)  # the base's own draws are those of a run without LoRA
  for layer in params["layers"]:
    assert set(layer[lora.KEY]) == set(model.config.LORA_TARGETS)
    for ad in layer[lora.KEY].values():
      a, b = np.asarray(ad["A"]), np.asarray(ad["B"])
      assert a.dtype == b.dtype == np.float32 and not b.any()
      fan_in = math.prod(a.shape[:-1])  # peft's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
      assert a.shape[-1] == 5 and np.abs(a).max() <= 1 / math.sqrt(fan_in) and a.std() > 0.4 / math.sqrt(fan_in)
  assert params["layers"][0][lora.KEY]["o"]["A"].shape == (4, 6, 5)  # o's input is the heads' context [N, H]
  assert params["layers"][0][lora.KEY]["down"]["B"].shape == (5, 24)
  ids = jnp.array([[3, 5, 7, 11, 13]])
  assert_close(model.forward(cfg, params, ids), model.forward(tiny_cfg, base, ids), ulps=0)  # B = 0: the base


def test_the_adapted_forward_is_the_merged_model_and_its_gradient_the_chain_rule(tiny_cfg):
  cfg = _lora_cfg(tiny_cfg, targets=("q", "o", "up", "down"))
  params = _trained(cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  ids = jnp.array([[3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10, 12, 14]])
  merged_cfg, merged = lora.merged(cfg, params)
  assert merged_cfg.lora is None and not lora.has_adapters(merged)
  out = model.forward(cfg, params, ids)
  assert_close(out, model.forward(merged_cfg, merged, ids), ulps=64)
  assert float(jnp.abs(out - model.forward(tiny_cfg, lora.base_of(params), ids)).max()) > 1e-2  # adapters act
  # adapters off (the KL reference): the base, whatever the params carry
  assert_close(model.forward(cfg.replace(lora=None), params, ids), model.forward(tiny_cfg, lora.base_of(params), ids),
               ulps=0)

  # d loss / dB = scale * A^T dL/dW' and dL/dA = scale * dL/dW' B^T, dL/dW' the merged weight's gradient
  loss = lambda p, c: jnp.sum(jnp.tanh(model.forward(c, p, ids)))
  split = lora.partition(params)
  g = jax.grad(lambda t: loss(split.combined(t), cfg))(split.trainable)
  gw = jax.grad(loss)(merged, merged_cfg)
  s = cfg.lora.scale
  for i in range(cfg.num_hidden_layers):
    for t in cfg.lora.targets:
      tg = lora.TARGETS[t]
      a, b = (np.asarray(params["layers"][i][lora.KEY][t][w], np.float64) for w in ("A", "B"))
      dw = np.asarray(gw["layers"][i][tg.block][tg.weight], np.float64)
      r = a.shape[-1]
      a2, b2, dw2 = a.reshape(-1, r), b.reshape(r, -1), dw.reshape(a.reshape(-1, r).shape[0], -1)
      assert_close(g["layers"][i][t]["B"], (s * a2.T @ dw2).reshape(b.shape), ulps=256, scale=np.abs(dw2).sum())
      assert_close(g["layers"][i][t]["A"], (s * dw2 @ b2.T).reshape(a.shape), ulps=256, scale=np.abs(dw2).sum())


def _batch(rng, B=4, P=5, N=4, V=31):
  r = np.random.RandomState(rng)
  mask = np.ones((B, N), np.int32)
  mask[1, 3:] = 0
  return UpdateBatch(jnp.asarray(r.randint(2, V, (B, P)), jnp.int32), jnp.ones((B, P), jnp.int32),
                     jnp.asarray(r.randint(2, V, (B, N)), jnp.int32), jnp.asarray(mask),
                     adv=jnp.asarray(r.randn(B), jnp.float32))


def test_the_train_step_trains_the_adapters_alone(tiny_cfg):
  cfg = _lora_cfg(tiny_cfg)
  params = _trained(cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  spec = train_step.StepSpec(cfg, GRPOConfig(), model.uniform(3, model.FULL_REMAT))
  batch = _batch(0)
  # jitted as the trainer runs them (op by op, each of their ops compiled on its own)
  grads_and_stats = jax.jit(train_step.grads_and_stats, static_argnums=2)
  grads, stats = grads_and_stats(params, batch, spec)
  assert jax.tree.structure(grads) == jax.tree.structure(lora.trainable(params))  # no frozen weight's gradient
  # the same as the gradient of the whole tree, restricted to the adapters
  norm = train_step.grpo.normalisers(batch.mask)
  full, _ = jax.jit(jax.grad(train_step.loss_and_stats, has_aux=True), static_argnums=2)(params, batch, spec, *norm)
  assert_trees_close(grads, lora.trainable(full), ulps=64, scale="tree")
  # accumulated over microbatches: the same gradient
  micro, _ = grads_and_stats(params, batch, dataclasses.replace(spec, microbatches=2))
  assert_trees_close(micro, grads, ulps=64, scale="tree")
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  state = train_state.create(params, opt)
  new, _ = jax.jit(lambda s, g: train_step.update_step(s, g, opt))(state, grads)
  assert_trees_close(lora.base_of(new["params"]), lora.base_of(params), ulps=0)  # the base stays frozen
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), lora.trainable(new["params"]),
                       lora.trainable(params))
  assert min(jax.tree.leaves(moved)) > 0


def test_dropout_acts_in_the_gradient_program_only(tiny_cfg):
  cfg = _lora_cfg(tiny_cfg, dropout=0.5)
  params = _trained(cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  batch = _batch(1)
  spec = train_step.StepSpec(cfg, GRPOConfig(), model.uniform(3, model.NO_REMAT))
  no_drop = train_step.StepSpec(_lora_cfg(tiny_cfg, dropout=0.0), GRPOConfig(), spec.policies)
  grads_and_stats = jax.jit(train_step.grads_and_stats, static_argnums=2)  # as the trainer runs it
  g_drop, s_drop = grads_and_stats(params, batch, spec)
  g_exact, s_exact = grads_and_stats(params, batch, no_drop)
  assert not np.allclose(s_drop["token_logp"], s_exact["token_logp"])  # the gradient's forward drops
  again, _ = grads_and_stats(params, batch, spec)
  assert_trees_close(again, g_drop, ulps=0)  # the same rows draw the same masks (resume, calibration probes)
  # forward-only passes (old and reference log-probs, the sampler) run without dropout
  logp = jax.jit(train_step.sequence_logprobs, static_argnums=0)(spec, params, batch)
  assert_close(logp, s_exact["token_logp"], ulps=64)


def test_a_chunked_mlp_keeps_the_adapters_gradients_and_draws_each_chunks_own_dropout(tiny_cfg):
  cfg = _lora_cfg(tiny_cfg, targets=("q", "up", "down"))
  params = _trained(cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  ids = jnp.array([[3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10, 12, 14]])
  gc = model.uniform(cfg.num_hidden_layers, model.FULL_REMAT)
  grad = lambda c: jax.jit(jax.grad(lambda q: jnp.sum(model.forward(c, q, ids, layer_policies=gc) ** 2)))(params)
  # 7 positions in chunks of 3 (the last padded): the adapters' gradients as the whole sequence's
  assert_trees_close(lora.trainable(grad(cfg.replace(mlp_chunk_len=3))),
                     lora.trainable(grad(cfg.replace(mlp_chunk_len=0))), ulps=256)
  adapters = lora.with_dropout(model.stacked(params), jax.random.PRNGKey(4))["layers"][lora.KEY]
  first = lora.layer_adapters(cfg, {lora.KEY: jax.tree.map(lambda x: x[0], adapters)})
  keys = [np.asarray(lora.fold_dropout(first, i)[lora.DROPOUT_KEY]) for i in range(3)]
  assert all(not np.array_equal(a, b) for a, b in ((keys[0], keys[1]), (keys[1], keys[2]), (keys[0], keys[2])))
  assert not np.array_equal(keys[0], np.asarray(first[lora.DROPOUT_KEY]))
  assert lora.fold_dropout({"up": {}}, 1) == {"up": {}}  # no dropout key: as it is


def test_the_merged_sampler_matches_the_unmerged_forward(tiny_cfg):
  from hilore_jax.tasks import Example, prompts
  from hilore_jax.tasks.config import TaskConfig
  from hilore_jax.tasks.tokenizer import load_tokenizer

  tok = load_tokenizer("char")
  cfg = _lora_cfg(tiny_cfg.replace(vocab_size=len(tok) + 3))
  params = _trained(cfg, model.init_params(cfg, jax.random.PRNGKey(0), init_std=0.3))
  calls = []
  merge = lora.sampling_model
  try:  # the sampler runs the merged model
    lora.sampling_model = lambda c, p: calls.append(c) or merge(c, p)
    prompter = prompts.build_prompter(tok, TaskConfig(), "char")
    roll = rollout.sample_completions(cfg, params, prompter, [Example("12+3=", "15")] * 3, 2, 8,
                                      SamplingConfig(max_new_tokens=5, temperature=1.0), jax.random.PRNGKey(2),
                                      lambda t, r: 0.0)
  finally:
    lora.sampling_model = merge
  assert calls and calls[0].lora is not None
  batch = UpdateBatch(*(jnp.asarray(x) for x in (roll.prompt_ids, roll.prompt_mask, roll.tokens, roll.mask)))
  logp = train_step.completion_logprobs(cfg, params, batch)[0]  # the adapted model, unmerged
  m = roll.mask > 0
  assert m.sum() > 4
  np.testing.assert_allclose(np.asarray(logp)[m], roll.sample_logprobs[m], atol=1e-5)
  base_logp = train_step.completion_logprobs(tiny_cfg.replace(vocab_size=cfg.vocab_size), lora.base_of(params),
                                             batch)[0]
  assert np.abs(np.asarray(base_logp)[m] - roll.sample_logprobs[m]).max() > 1e-3  # what the adapters change


def test_lora_specs_reject_bad_values():
  with pytest.raises(ValueError, match="lora.rank must be a positive integer"):
    LoraSpec(0, 8.0)
  with pytest.raises(ValueError, match=r"lora.targets: unknown \['qkv'\]"):
    LoraSpec(4, 8.0, ("q", "qkv"))
  with pytest.raises(ValueError, match="lora.alpha must be > 0"):
    LoraSpec(4, -1.0)
  assert LoraSpec(4, 8.0, ("down", "q")).targets == ("q", "down")  # one order: the params' layout


@pytest.mark.parametrize("targets", [model.config.LORA_TARGETS, ("q", "v")])
def test_the_lora_table_names_what_the_decoder_tags_and_reads(tiny_cfg, targets):
  cfg = _lora_cfg(tiny_cfg, targets=targets)
  adapted = lora.adapted_inputs(cfg.lora)
  rows = U.table("xla", adapted)
  assert [t.name for t in rows if t.unit][-1] == U.LORA_XA
  unread = {u for u in U.PROJECTION_INPUTS if u not in adapted}
  assert unread == ({U.ATTN_CTX, U.MLP_NORM, U.MLP_DOWN_IN} if targets == ("q", "v") else set())
  assert all(U.BY_NAME[u].unit and not next(t for t in rows if t.name == u).unit for u in unread)
  assert U.lora_rows(t.name for t in rows if t.unit) == rows  # what the cost model derives from a layer's units
  # the producer ops (the profile times them) read what the table says
  sizes = U.dims(cfg, 2, 5)
  assert sizes["A"] == 3 * len(targets)
  p = model.layer_params(model.init_params(cfg.replace(num_hidden_layers=1), jax.random.PRNGKey(0)), 0)
  ctx = model.LayerCtx(*model.rope_cos_sin(cfg, jnp.broadcast_to(jnp.arange(5), (2, 5))), jnp.ones((2, 5, 5), bool))
  for t in rows:
    if t.producer is None:
      continue
    seen = set()

    class Recorder(dict):
      def __getitem__(self, key):
        seen.add(key)
        return super().__getitem__(key)

    out = model.OPS[t.producer](cfg, p, Recorder({n: jnp.ones(U.shape(n, sizes)) for n in U.CHECKPOINT_NAMES}), ctx)
    assert seen == set(t.reads), (t.producer, seen)
    assert out.shape == U.shape(t.name, sizes), t.name
