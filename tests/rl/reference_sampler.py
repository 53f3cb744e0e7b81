"""The sampler as it was before issue 49 (at ba4f6da): one jitted program, a KV cache preallocated at
prompt + max_new_tokens, attention over all of it, one key for the batch. Kept as the reference the rollout engine's
greedy tokens and log-probs are checked against (tests/rl/test_sampler.py), not as a second code path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hilore_jax import model
from hilore_jax.model import ModelConfig
from hilore_jax.rl.config import SamplingConfig
# the prompt's side did not change in issue 49: the engine's own left_align and prefill
from hilore_jax.rl.sampler import left_align, prefill


def process_logits(logits_BV: jax.Array, sc: SamplingConfig) -> jax.Array:
  """Logits of the sampling distribution: temperature, then top-k, then top-p (nucleus)."""
  neg = jnp.finfo(jnp.float32).min
  logits_BV = logits_BV.astype(jnp.float32) / sc.temperature
  if sc.top_k:
    kth = jax.lax.top_k(logits_BV, sc.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth, neg, logits_BV)
  if sc.top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(mass_before < sc.top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff, neg, logits_BV)
  return logits_BV


@functools.partial(jax.jit, static_argnames=("cfg", "sc", "stop_ids", "pad_id", "num_generations"))
def generate(cfg: ModelConfig, params: dict, prompt_ids_BpP: jax.Array, prompt_mask_BpP: jax.Array,
             rng: jax.Array, sc: SamplingConfig, stop_ids: int | tuple[int, ...], pad_id: int,
             num_generations: int = 1) -> dict:
  """Sample G completions of each of Bp prompts. Returns left-aligned prompt ids/mask [B, P] and completion
  tokens/logprobs/mask [B, N], B = Bp * G, row i * G + g being prompt i's g-th completion.

  Each prompt is prefilled once and its KV cache, last logits and mask copied to its G rows; the decode loop and
  its draws are those of np.repeat-ed prompts with G = 1, so the same key samples the same tokens up to float32
  rounding (the prefill's batch and cache length differ, which may move the last bits).
  logprobs are under the sampling distribution (after temperature/top-k/top-p; plain softmax if greedy).
  The completion mask covers generated tokens up to and including the first stop id (eos, a chat end-of-turn).
  """
  if not (isinstance(num_generations, int) and num_generations >= 1):
    raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}")
  G = num_generations
  stop_S = jnp.asarray(stop_ids if isinstance(stop_ids, tuple) else (stop_ids,), jnp.int32)
  # the decode loop scans over layers: stack their params once per call, not once per token
  params = {**params, "layers": model.stack_layers(params["layers"])}
  Bp, P = prompt_ids_BpP.shape
  B, N = Bp * G, sc.max_new_tokens
  ids_BpP, mask_BpP = left_align(prompt_ids_BpP, prompt_mask_BpP)
  mask_BpP = mask_BpP.astype(jnp.int32)
  last_BpV, (k_LBpPKH, v_LBpPKH) = prefill(cfg, params, ids_BpP, mask_BpP)
  rows = lambda x, axis=0: x if G == 1 else jnp.repeat(x, G, axis=axis)  # prompt i -> rows i*G .. i*G+G-1
  # The prompt's keys/values are copied to each of its G rows rather than shared by index: decode then stays one
  # attention over a contiguous [B, P + N] cache (forward_cached unchanged) that writes each row's own slots. The
  # copy holds the B-row cache that prefilling repeated prompts held too; sharing would save its prompt part's
  # (G-1)/G but needs a two-part attention (prompt keys per Bp, completion keys per B) in the decode step.
  fresh = jnp.zeros((cfg.num_hidden_layers, B, N, *k_LBpPKH.shape[3:]), k_LBpPKH.dtype)
  cache = tuple(jnp.concatenate([rows(x, 1), fresh], axis=2) for x in (k_LBpPKH, v_LBpPKH))
  ids, mask, logits = rows(ids_BpP), rows(mask_BpP), rows(last_BpV)
  key_mask = jnp.concatenate([mask, jnp.zeros((B, N), jnp.int32)], axis=1)
  lengths_B = mask.sum(-1)

  def pick(logits_BV, key):
    if sc.greedy:
      logp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), -1)
      tok = jnp.argmax(logits_BV, -1)
    else:
      logp = jax.nn.log_softmax(process_logits(logits_BV, sc), -1)
      tok = jax.random.categorical(key, logp, -1)
    return tok, jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]

  def body(carry):
    t, last_BV, cache, key_mask, done_B, toks, logps, rng = carry
    rng, key = jax.random.split(rng)
    tok, logp = pick(last_BV, key)
    live = ~done_B
    tok = jnp.where(live, tok, pad_id)
    toks = toks.at[:, t].set(tok)
    logps = logps.at[:, t].set(jnp.where(live, logp, 0.0))
    key_mask = key_mask.at[:, P + t].set(live.astype(jnp.int32))
    positions = (lengths_B + t)[:, None]
    logits, cache = model.forward_cached(cfg, params, tok[:, None], positions, key_mask, cache, P + t)
    done_B = done_B | jnp.isin(tok, stop_S)
    return t + 1, logits[:, -1], cache, key_mask, done_B, toks, logps, rng

  def cond(carry):
    return (carry[0] < N) & ~jnp.all(carry[4])

  init = (jnp.int32(0), logits, cache, key_mask, jnp.zeros((B,), bool),
          jnp.full((B, N), pad_id, jnp.int32), jnp.zeros((B, N), jnp.float32), rng)
  _, _, _, key_mask, _, toks, logps, _ = jax.lax.while_loop(cond, body, init)
  return {"prompt_ids": ids, "prompt_mask": mask, "tokens": toks, "logprobs": logps,
          "mask": key_mask[:, P:]}
