"""The GRPO actor update as pure functions of an `UpdateBatch`: chunked log-probs, the loss, microbatched gradients
(the gradient program) and clipping + optimizer, optionally with predicted-KL step control (the update program).
`engine.Stepper` compiles them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from hilore_jax import model
from hilore_jax.model import LayerPolicy, ModelConfig, lora
from hilore_jax.optim.config import KLControlConfig
from hilore_jax.rl import grpo, kl_control, logprobs, packing
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.train_state import TrainState
from hilore_jax.rl.update_batch import UpdateBatch


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about the compiled step; a new value means a new compilation."""

  model_cfg: ModelConfig
  loss_cfg: GRPOConfig
  policies: tuple[LayerPolicy, ...]
  microbatches: int = 1
  logprob_chunk: int = 128
  # False: one update per rollout, old = stop_gradient(logp) (ratio == 1). True: the batch carries old_logp [B, N]
  # and on_policy [B] int32: rows flagged 1 use stop_gradient(logp) instead (a runtime flag, so the first update of
  # a rollout, provably on-policy, needs no old-policy forward and no second compilation)
  use_old_logp: bool = False
  use_ref_logp: bool = False
  # log-probs of softmax(logits / T), the distribution rollouts were sampled from; the sampler's top-k/top-p
  # truncation is not applied here (as in TRL and verl)
  temperature: float = 1.0
  # (format, group size): every unit read in backward as exact + mix * (decoded - exact), the mix [L, units] an
  # argument of the gradient program (risk calibration: one program measures any set of L units)
  lowp_probe: tuple[str, int] | None = None


def sequence_inputs(batch: UpdateBatch) -> tuple[jax.Array, jax.Array]:
  """Prompt (left-padded) + completion (right-padded) ids and attention mask [B, P+N]."""
  ids = jnp.concatenate([batch.prompt_ids, batch.tokens], axis=1)
  mask = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  return ids, mask


def completion_positions(x_BT, batch: UpdateBatch):
  """x at the positions that predict the completion tokens (position t predicts token t+1: completion token j is
  predicted at P - 1 + j), [B, N, ...] of a [B, P+N, ...] array."""
  P, N = batch.prompt_len, batch.completion_len
  return x_BT[:, P - 1:P + N - 1]


def completion_logprobs(cfg: ModelConfig, params, batch: UpdateBatch, policies=None, chunk: int = 128,
                        temperature: float = 1.0, probe=None):
  """(log pi(completion token), entropy) [B, N] with chunked log-softmax over the vocabulary; a batch with a
  prompt table computes each distinct prompt once (model.shared_hidden_states; a calibration probe reads every
  row's own); a packed one runs its buffer (rl/packing.py) and is 0 outside the buffer's rows."""
  if batch.packing is not None and probe is None:
    return packing.completion_logprobs(cfg, params, batch, policies, chunk, temperature)
  if batch.prompt_index is not None and probe is None:
    h = model.shared_hidden_states(cfg, params, batch.prompt_table, batch.prompt_table_mask, batch.prompt_index,
                                   batch.tokens, batch.mask, policies)
  else:
    ids, mask = sequence_inputs(batch)
    h = completion_positions(model.hidden_states(cfg, params, ids, mask, layer_policies=policies, probe=probe), batch)
  return logprobs.token_logprobs(h, model.lm_head_weight(cfg, params), batch.tokens, chunk, temperature)


def sequence_logprobs(spec: StepSpec, params, batch: UpdateBatch) -> jax.Array:
  """log pi(completion token) [B, N] at spec's temperature, forward only, spec.microbatches row slices at a time
  (as the gradient program holds them): the old and reference log-probs."""
  B, N = batch.tokens.shape
  logp = jax.lax.map(lambda b: completion_logprobs(spec.model_cfg, params, b, None, spec.logprob_chunk,
                                                   spec.temperature)[0], batch.sequences().split(spec.microbatches))
  return logp.reshape(B, N)


def old_logprobs(logp: jax.Array, batch: UpdateBatch, spec: StepSpec) -> jax.Array:
  """The ratio's denominator: batch's old_logp, or stop_gradient(logp) on rows flagged on_policy (or always)."""
  current = jax.lax.stop_gradient(logp)
  if not spec.use_old_logp:
    return current
  if batch.on_policy is None:
    return batch.old_logp
  return jnp.where(batch.on_policy[:, None] > 0, current, batch.old_logp)


def loss_and_stats(params, batch: UpdateBatch, spec: StepSpec, num_seqs, num_tokens, probe_mix=None):
  probe = (*spec.lowp_probe, probe_mix) if spec.lowp_probe else None
  if spec.model_cfg.lora is not None and spec.model_cfg.lora.dropout:  # the adapters' dropout: training only
    params = lora.with_dropout(params, batch_key(batch))
  logp, entropy = completion_logprobs(spec.model_cfg, params, batch, spec.policies, spec.logprob_chunk,
                                      spec.temperature, probe)
  old = old_logprobs(logp, batch, spec)
  ref = batch.ref_logp if spec.use_ref_logp else jax.lax.stop_gradient(logp)
  loss, stats = grpo.grpo_loss(logp, old, ref, batch.adv, batch.mask, spec.loss_cfg, num_seqs, num_tokens)
  stats["entropy_sum"] = jnp.sum(jnp.where(batch.mask > 0, entropy, 0.0))
  stats["loss"] = loss
  # per token, for the next pass's exposure (its ratio and clip state) without another forward
  stats["token_logp"] = jax.lax.stop_gradient(logp)
  return loss, stats


def batch_key(batch: UpdateBatch) -> jax.Array:
  """A PRNG key of the rows' tokens (LoRA dropout's masks): the same rows draw the same masks, so a resumed run and
  a probe of the same minibatch see the gradient the step saw."""
  ids, mask = sequence_inputs(batch)
  weights = jnp.arange(1, ids.shape[1] + 1, dtype=jnp.uint32)
  return jax.random.PRNGKey(jnp.sum(ids.astype(jnp.uint32) * mask.astype(jnp.uint32) * weights))


def grads_and_stats(params, batch: UpdateBatch, spec: StepSpec, probe_mix=None, norm=None, wrt_probe: bool = False):
  """Gradient of the minibatch loss with respect to what trains (lora.partition: the adapters of a LoRA model, else
  every parameter), accumulated over spec.microbatches slices (normalisers are global); probe_mix [L, units] (with
  spec.lowp_probe) is per layer, not per row: every microbatch reads all of it. norm: the (num_seqs, num_tokens)
  normalisers of the minibatch batch is part of (default: batch's own). wrt_probe: the gradient is (trained
  params', probe_mix's): a probe_mix with error channels (model/lowp.py) returns each one's error."""
  num_seqs, num_tokens = grpo.normalisers(batch.mask) if norm is None else norm
  parts = lora.partition(params)
  if parts.frozen is not None:  # the frozen base is no argument of the gradient: autodiff forms no weight gradient
    loss_fn = lambda t, *args: loss_and_stats(parts.combined(t), *args)
    params = parts.trainable
  else:
    loss_fn = loss_and_stats
  grad_fn = jax.grad(loss_fn, argnums=(0, 5) if wrt_probe else 0, has_aux=True)
  if spec.microbatches == 1:
    return grad_fn(params, batch, spec, num_seqs, num_tokens, probe_mix)
  split = batch.split(spec.microbatches)

  def body(acc, mb):
    g, s = grad_fn(params, mb, spec, num_seqs, num_tokens, probe_mix)
    logp = s.pop("token_logp")  # per row: stacked, not summed
    return jax.tree_util.tree_map(jnp.add, acc, (g, s)), logp

  first = jax.tree_util.tree_map(lambda x: x[0], split)
  shapes = jax.eval_shape(lambda p, b: grad_fn(p, b, spec, num_seqs, num_tokens, probe_mix), params, first)
  shapes[1].pop("token_logp")
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  (grads, stats), logp = jax.lax.scan(body, zeros, split)
  stats["token_logp"] = logp.reshape(-1, logp.shape[-1])
  return grads, stats


def step_metrics(stats: dict) -> dict:
  """Per-token means of the minibatch's loss statistics (computed in the gradient program)."""
  tokens = jnp.maximum(stats["tokens"], 1.0)
  return {"loss": stats["loss"], "clipfrac": stats["clipped_tokens"] / tokens, "kl": stats["kl_sum"] / tokens,
          "entropy": stats["entropy_sum"] / tokens, "tokens": stats["tokens"],
          "abs_log_ratio": stats["abs_log_ratio_sum"] / tokens, TOKEN_LOGP: stats["token_logp"]}


TOKEN_LOGP = "token_logp"  # the gradient program's per-token log-probs [B, N] (sharded like the batch)
SCALAR_METRICS = ("loss", "clipfrac", "kl", "entropy", "tokens", "abs_log_ratio")


def gradient_step(params, batch: UpdateBatch, spec: StepSpec):
  """The gradient program: (grads, metrics) of one minibatch under spec's remat policies."""
  grads, stats = grads_and_stats(params, batch, spec)
  return grads, step_metrics(stats)


def packed_gradient(params, batch: UpdateBatch, idx: dict, norm, acc, spec: StepSpec, layout):
  """The packed gradient program (the token budget): one microbatch of batch (layout.gather of its arrays idx: a
  bucket's rows, token_budget.Columns, or a packed buffer, packing.Packed; with its prompt table where it has one)
  added to acc = (grads, loss sums, token log-probs [B, N] written back to the minibatch's rows); norm = the whole
  minibatch's (num_seqs, num_tokens), so the sum over its microbatches is the unpacked minibatch's gradient and
  loss."""
  mb = layout.gather(batch, idx)
  grads, stats = grads_and_stats(params, mb, spec, norm=(norm[0], norm[1]))
  logp = stats.pop(TOKEN_LOGP)
  acc_grads, acc_stats, acc_logp = acc
  grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_grads, grads)
  stats = jax.tree.map(jnp.add, acc_stats, stats)
  return grads, stats, layout.scatter(acc_logp, idx, logp)


def packed_start(params, batch: UpdateBatch):
  """(a packed minibatch's empty accumulator: zero gradients, loss sums and token log-probs; its normalisers)."""
  stats = {k: jnp.zeros((), jnp.float32) for k in STAT_SUMS}
  acc = jax.tree.map(jnp.zeros_like, lora.trainable(params)), stats, jnp.zeros(batch.tokens.shape, jnp.float32)
  return acc, jnp.stack(grpo.normalisers(batch.mask))


def packed_logprobs(spec: StepSpec, params, batch: UpdateBatch, idx: dict, acc_BN, layout):
  """The packed log-prob forward: one microbatch's log-probs written into acc [B, N] at its rows."""
  mb = layout.gather(batch.sequences(), idx)
  logp = completion_logprobs(spec.model_cfg, params, mb, None, spec.logprob_chunk, spec.temperature)[0]
  return layout.scatter(acc_BN, idx, logp)


# the loss sums a packed minibatch accumulates over its microbatches (grads_and_stats' stats but token_logp)
STAT_SUMS = ("clipped_tokens", "kl_sum", "tokens", "abs_log_ratio_sum", "entropy_sum", "loss")


def kl_functions(spec: StepSpec, batch: UpdateBatch):
  """(hidden_fn, head_fn) for kl_control: final hidden states at the positions predicting the completion tokens,
  and the lm head divided by spec's temperature, so the KL is that of the distribution rollouts sample from (the
  one GRPO's ratio is taken under). No remat: the KL's forward and JVP have no backward. A prompt table is read
  as the gradient program reads it (each prompt once)."""
  if batch.prompt_index is not None:
    hidden_fn = lambda p: model.shared_hidden_states(spec.model_cfg, p, batch.prompt_table, batch.prompt_table_mask,
                                                     batch.prompt_index, batch.tokens, batch.mask)
  else:
    ids, mask = sequence_inputs(batch)
    hidden_fn = lambda p: completion_positions(model.hidden_states(spec.model_cfg, p, ids, mask), batch)
  if spec.temperature == 1.0:
    return hidden_fn, lambda p: model.lm_head_weight(spec.model_cfg, p)
  return hidden_fn, lambda p: model.lm_head_weight(spec.model_cfg, p) / spec.temperature


def minibatch_kl(kl_fn, spec: StepSpec, params, updates, batch: UpdateBatch, chunk: int) -> jax.Array:
  """kl_fn's mean over the minibatch's completion tokens, spec.microbatches row slices at a time (as the gradient
  program holds them): each slice's mean weighted by its token count. updates are shaped like what trains
  (lora.partition): the KL's JVP runs along the adapters of a LoRA model."""
  parts = lora.partition(params)

  def one(b):
    hidden_fn, head_fn = kl_functions(spec, b)
    hidden, head = (lambda t: hidden_fn(parts.combined(t))), (lambda t: head_fn(parts.combined(t)))
    return kl_fn(hidden, head, parts.trainable, updates, b.mask, chunk) * jnp.sum(b.mask).astype(jnp.float32)

  split = batch.sequences().split(spec.microbatches)
  return jnp.sum(jax.lax.map(one, split)) / jnp.maximum(jnp.sum(batch.mask).astype(jnp.float32), 1.0)


def update_step(state: TrainState, grads, optimizer: optax.GradientTransformation, batch: UpdateBatch | None = None,
                spec: StepSpec | None = None, kl: KLControlConfig | None = None):
  """The update program: clipping and the optimizer on finished gradients -> (new state, metrics).

  With kl (target > 0; then batch and spec too) the optimizer's update is scaled by s = min(1, sqrt(target /
  predicted)) before it is applied, predicted the second-order mean per-token KL on the batch's completion tokens;
  the optimizer's state advances as without the control. Without kl the program is the plain one.
  """
  # clipping and the optimizer see what trains (a LoRA model's adapters)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
  metrics = {"grad_norm": optax.tree.norm(grads)}
  if kl is not None:
    predicted = minibatch_kl(kl_control.predicted_kl, spec, state.params, updates, batch, kl.chunk)
    s = kl_control.control_scale(predicted, kl.target)
    updates = jax.tree.map(lambda u: (u * s).astype(u.dtype), updates)
    realized = minibatch_kl(kl_control.realized_kl, spec, state.params, updates, batch, kl.chunk)
    metrics.update({"kl_control/predicted": predicted, "kl_control/scale": s, "kl_control/realized": realized})
  return state.take_step(updates, opt_state), metrics


def train_step(state: TrainState, batch: UpdateBatch, spec: StepSpec, optimizer: optax.GradientTransformation,
               kl: KLControlConfig | None = None):
  """One optimizer update on a minibatch -> (new state, metrics), as one function (what the two programs compute).

  The trainer runs it as two compiled programs (`Step`): with global-norm clipping in the same program as the
  backward, XLA:CPU, which drops the optimization barriers that order remat, hoists recomputation into the forward
  and keeps most of what remat was meant to free.
  """
  grads, metrics = gradient_step(state.params, batch, spec)
  state, m = update_step(state, grads, optimizer, batch, spec, kl)
  return state, {**metrics, **m}
