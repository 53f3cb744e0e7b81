"""The JAX rollout engine: batched generation with a KV cache, stopping each row on any of several ids.

The decode runs in segments: each is one compiled while loop of up to `decode.segment` tokens on the device
(sampling fused in), and between two the host reads which rows finished. At each check the finished rows leave the
batch (the rest is gathered into the smallest row bucket that holds it: the batch size, and the powers of two and
their 1.5x below it), and a full cache grows into the next length bucket (completion capacity `cache_bucket`,
doubling, up to max_new_tokens). One program is compiled per (row bucket, cache length, filled attention chunks)
met, so a run compiles a handful. A decode step writes its keys and values into the cache in place and attends to
the chunks its segment fills only (model.decode_step). Each row draws from its own key (`jax.random.split(rng, B)`,
or `row_keys`), folded with the token's index: a row's tokens do not depend on which rows share its batch,
compaction included.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.model import ModelConfig
from hilore_jax.rl import sampling
from hilore_jax.rl.config import DecodeConfig, SamplingConfig

CHUNK_ALIGN = 8  # a short sequence's attention chunk is its length rounded up to this


@dataclasses.dataclass(frozen=True)
class Segment:
  """One decode program's run between two host checks."""

  start: int  # completion tokens drawn before it
  end: int  # completion tokens drawn after it
  rows: tuple[int, ...]  # each batch slot's completion row (-1: a slot padding the row bucket)
  cache_len: int  # the cache's allocated slots (prompt + completion capacity)
  seconds: float  # from its dispatch to its results on the host (a first use compiles)


class DecodeState(NamedTuple):
  """The decode's device state, one entry per batch slot."""

  k: jax.Array  # [L, R, S, K, H]
  v: jax.Array
  tok_R: jax.Array  # the last drawn token, fed next
  done_R: jax.Array  # drew a stop id (or pads the bucket)
  plen_R: jax.Array  # real prompt tokens: the completion's first position; its first key slot is P - plen
  keys_R: jax.Array  # the completion row's key


def left_align(ids_BP: jax.Array, mask_BP: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Move each row's real tokens to the right end (left padding), whatever the input padding side."""
  order = jnp.argsort(mask_BP.astype(jnp.int32), axis=-1, stable=True)
  return jnp.take_along_axis(ids_BP, order, -1), jnp.take_along_axis(mask_BP, order, -1)


def prefill(cfg: ModelConfig, params: dict, ids_BpP: jax.Array, mask_BpP: jax.Array) -> tuple[jax.Array, tuple]:
  """Last-token logits [Bp, V] and the prompt's KV cache [L, Bp, P, K, H] of left-aligned prompts."""
  Bp, P = ids_BpP.shape
  cache = model.init_cache(cfg, Bp, P)
  positions = model.default_positions(mask_BpP)
  if P > 1:  # prefill all but the last prompt token: its unused [Bp, P-1, V] logits are dead code, never allocated
    cache = model.forward_cached(cfg, params, ids_BpP[:, :-1], positions[:, :-1], mask_BpP, cache, 0)[1]
  logits, cache = model.forward_cached(cfg, params, ids_BpP[:, -1:], positions[:, -1:], mask_BpP, cache, P - 1)
  return logits[:, -1], cache


def attention_chunk(prompt_len: int, new_tokens: int, decode: DecodeConfig) -> int:
  """Cache slots per attention chunk: decode.attention_chunk, or a short sequence's whole length (aligned)."""
  return min(decode.attention_chunk, -(-(prompt_len + new_tokens) // CHUNK_ALIGN) * CHUNK_ALIGN)


def cache_lengths(prompt_len: int, new_tokens: int, decode: DecodeConfig) -> list[int]:
  """The cache's length buckets: prompt + completion capacity cache_bucket * 2^k (at most new_tokens), rounded up
  to whole attention chunks."""
  chunk = attention_chunk(prompt_len, new_tokens, decode)
  out, cap = [], decode.cache_bucket
  while True:
    length = -(-(prompt_len + min(cap, new_tokens)) // chunk) * chunk
    if not out or length > out[-1]:
      out.append(length)
    if cap >= new_tokens:
      return out
    cap *= 2


def filled_chunks(prompt_len: int, t0: int, steps: int, t_end: int, chunk: int) -> int:
  """Attention chunks a segment reads: those up to the slot of its last fed token (P + min(t0 + steps, t_end) - 1),
  so a step's attention follows the sequence so far, in whole chunks, one program per count met."""
  return -(-(prompt_len + min(t0 + steps, t_end)) // chunk)


def row_buckets(rows: int) -> list[int]:
  """The batch's row buckets, largest first: the batch itself and every power of two and its 1.5x below it (on the
  reasoning recipe's rollouts, 1.5x rungs ran 11% fewer row-steps than powers of two alone, for a few more
  programs)."""
  rungs = {p for k in range(rows.bit_length()) for p in (1 << k, 3 << max(k - 1, 0)) if p < rows}
  return [rows] + sorted(rungs, reverse=True)


@functools.partial(jax.jit, static_argnames=("cfg",))
def decode_params(cfg: ModelConfig, params: dict) -> dict:
  """params with stacked layers (the decode scans over them) in the decode's compute dtype, once per call."""
  cast = lambda x: x.astype(cfg.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree_util.tree_map(cast, {**params, "layers": model.stack_layers(params["layers"])})


@functools.partial(jax.jit, static_argnames=("cfg", "sc", "G", "S"))
def start(cfg: ModelConfig, sc: SamplingConfig, params: dict, ids_BpP, mask_BpP, keys_B, stop_S, G: int, S: int):
  """Prefill the distinct prompts, copy each one's cache, mask and last logits to its G rows in a cache of S slots,
  and draw every row's first token: (state, prompt ids [B, P], prompt mask, first tokens [B], their log-probs)."""
  ids_BpP, mask_BpP = left_align(ids_BpP, mask_BpP)
  mask_BpP = mask_BpP.astype(jnp.int32)
  P = ids_BpP.shape[1]
  last_BpV, cache = prefill(cfg, params, ids_BpP, mask_BpP)
  rows = lambda x, axis=0: x if G == 1 else jnp.repeat(x, G, axis=axis)  # prompt i -> rows i*G .. i*G+G-1
  k, v = (jnp.pad(rows(x, 1), [(0, 0), (0, 0), (0, S - P), (0, 0), (0, 0)]) for x in cache)
  tok, logp = sampling.pick(rows(last_BpV), keys_B, 0, sc)
  mask = rows(mask_BpP)
  state = DecodeState(k, v, tok, jnp.isin(tok, stop_S), mask.sum(-1), keys_B)
  return state, rows(ids_BpP), mask, tok, logp


@functools.partial(jax.jit, static_argnames=("cfg", "sc", "steps", "chunk", "P", "pad_id", "n_chunks"),
                   donate_argnames=("state",))
def decode_segment(cfg: ModelConfig, sc: SamplingConfig, params: dict, state: DecodeState, t0, t_end, stop_S,
                   steps: int, chunk: int, P: int, pad_id: int, n_chunks: int = 1):
  """Feed tokens t0, t0+1, ... (token t at cache slot P + t) and draw the next ones, at most `steps`, until token
  t_end is drawn or every row is done: (state, tokens [R, steps], log-probs, live [R, steps], tokens drawn).
  n_chunks: the attention chunks the segment's last token fills (filled_chunks)."""
  R = state.tok_R.shape[0]

  def cond(c):
    i, st = c[0], c[1]
    return (i < steps) & (t0 + i < t_end) & ~jnp.all(st.done_R)

  def body(c):
    i, st, toks, logps, live = c
    t = t0 + i
    logits, (k, v) = model.decode_step(cfg, params, st.tok_R, st.plen_R + t, (st.k, st.v), P + t, P - st.plen_R,
                                       chunk, n_chunks)
    tok, logp = sampling.pick(logits, st.keys_R, t + 1, sc)
    alive = ~st.done_R
    tok = jnp.where(alive, tok, pad_id)
    st = st._replace(k=k, v=v, tok_R=tok, done_R=st.done_R | jnp.isin(tok, stop_S))
    return (i + 1, st, toks.at[:, i].set(tok), logps.at[:, i].set(jnp.where(alive, logp, 0.0)),
            live.at[:, i].set(alive))

  init = (jnp.int32(0), state, jnp.full((R, steps), pad_id, jnp.int32), jnp.zeros((R, steps), jnp.float32),
          jnp.zeros((R, steps), bool))
  n, state, toks, logps, live = jax.lax.while_loop(cond, body, init)
  return state, toks, logps, live, n


@functools.partial(jax.jit, static_argnames=("S",))
def resize(state: DecodeState, idx_R: jax.Array, pad_R: jax.Array, S: int) -> DecodeState:
  """The batch slots idx_R (a row bucket; pad_R marks slots that only pad it) in a cache of S slots."""
  take = lambda x, axis=0: jnp.take(x, idx_R, axis)
  grow = [(0, 0), (0, 0), (0, S - state.k.shape[2]), (0, 0), (0, 0)]
  return DecodeState(jnp.pad(take(state.k, 1), grow), jnp.pad(take(state.v, 1), grow), take(state.tok_R),
                     take(state.done_R) | pad_R, take(state.plen_R), take(state.keys_R))


def generate(cfg: ModelConfig, params: dict, prompt_ids_BpP, prompt_mask_BpP, rng: jax.Array | None,
             sc: SamplingConfig, stop_ids: int | tuple[int, ...], pad_id: int, num_generations: int = 1,
             decode: DecodeConfig = DecodeConfig(), row_keys: jax.Array | None = None) -> dict:
  """Sample G completions of each of Bp prompts. Returns host arrays: left-aligned prompt ids/mask [B, P] and
  completion tokens/logprobs/mask [B, N], B = Bp * G, row i * G + g being prompt i's g-th completion, and `trace`,
  the decode's segments.

  Each prompt is prefilled once and its KV cache, last logits and mask copied to its G rows. Row r draws from
  row_keys[r] (default: jax.random.split(rng, B)), whatever rows share its batch. logprobs are under the sampling
  distribution (after temperature/top-k/top-p; plain softmax if greedy). The completion mask covers generated
  tokens up to and including the first stop id (eos, a chat end-of-turn).
  """
  if not (isinstance(num_generations, int) and num_generations >= 1):
    raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}")
  G, N = num_generations, sc.max_new_tokens
  Bp, P = np.shape(prompt_ids_BpP)
  B = Bp * G
  keys = jax.random.split(rng, B) if row_keys is None else jnp.asarray(row_keys)
  if keys.shape[0] != B:
    raise ValueError(f"row_keys holds {keys.shape[0]} keys for {B} completion rows")
  dcfg = cfg.replace(dtype=decode.dtype) if decode.dtype else cfg
  chunk, lengths = attention_chunk(P, N, decode), cache_lengths(P, N, decode)
  stop_S = jnp.asarray(stop_ids if isinstance(stop_ids, tuple) else (stop_ids,), jnp.int32)
  params = decode_params(dcfg, params)
  state, ids, mask, tok0, logp0 = start(dcfg, sc, params, prompt_ids_BpP, prompt_mask_BpP, keys, stop_S, G,
                                         lengths[0])
  tokens, logps = np.full((B, N), pad_id, np.int32), np.zeros((B, N), np.float32)
  live_mask = np.zeros((B, N), np.int32)
  tokens[:, 0], logps[:, 0], done = jax.device_get((tok0, logp0, state.done_R))
  live_mask[:, 0] = 1
  slots, S, t, trace = np.arange(B), lengths[0], 0, []
  steps, buckets = min(decode.segment, N - 1), row_buckets(B)
  while t < N - 1 and not done.all():
    live = ~done
    R = min(r for r in buckets if r >= live.sum()) if decode.compact else len(slots)
    grown = next(s for s in lengths if s > P + t)
    if R < len(slots) or grown > S:
      idx = np.flatnonzero(live) if R < len(slots) else np.arange(len(slots))
      pad = np.arange(R) >= len(idx)
      idx = np.concatenate([idx, np.full(R - len(idx), idx[0])]).astype(np.int32)
      state, S = resize(state, jnp.asarray(idx), jnp.asarray(pad), grown), grown
      slots, done = np.where(pad, -1, slots[idx]), done[idx] | pad
    t0 = time.perf_counter()
    t_end = min(N - 1, S - P)
    state, toks, lps, alive, n = decode_segment(dcfg, sc, params, state, t, t_end, stop_S, steps, chunk, P, pad_id,
                                                filled_chunks(P, t, steps, t_end, chunk))
    toks, lps, alive, n, done = jax.device_get((toks, lps, alive, n, state.done_R))
    real = slots >= 0
    tokens[slots[real], t + 1:t + 1 + n] = toks[real, :n]
    logps[slots[real], t + 1:t + 1 + n] = lps[real, :n]
    live_mask[slots[real], t + 1:t + 1 + n] = alive[real, :n]
    trace.append(Segment(t + 1, t + 1 + int(n), tuple(int(s) for s in slots), S, time.perf_counter() - t0))
    t += int(n)
  return {"prompt_ids": np.asarray(ids), "prompt_mask": np.asarray(mask), "tokens": tokens, "logprobs": logps,
          "mask": live_mask, "trace": tuple(trace)}
