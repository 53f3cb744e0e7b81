"""The sampler at length (issue 49): per-token time over position with stopping off, real rollouts' decode work
(rows decoded against rows still live), and a decode step's cost by position, compile-only.

Timing is for a quiet machine: `flat` runs generate once to compile, then times `reps` runs, each segment's seconds
from its dispatch to its results on the host. The decode-work and cost figures are deterministic: the rows each
segment ran (the engine's trace) and the jaxpr's matmul FLOPs plus the bytes a step reads.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.capacity import flops
from hilore_jax.model import ModelConfig
from hilore_jax.rl import sampler
from hilore_jax.rl.config import DecodeConfig, SamplingConfig


def synthetic_prompts(num_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Random token ids [Bp, P], every token real (ids from 3 up: clear of the usual special ids)."""
  ids = np.random.default_rng(seed).integers(3, vocab, (num_prompts, prompt_len)).astype(np.int32)
  return ids, np.ones_like(ids)


def windows(trace, window: int) -> list[dict]:
  """ms per token in windows of `window` completion tokens, from segments' seconds (a segment spread evenly)."""
  end = max(s.end for s in trace)
  secs, toks = np.zeros(end + 1), np.zeros(end + 1)
  for s in trace:
    secs[s.start:s.end] += s.seconds / (s.end - s.start)
    toks[s.start:s.end] += 1
  out = []
  for a in range(1, end, window):
    b = min(a + window, end)
    out.append({"tokens": [a, b], "ms_per_token": 1e3 * secs[a:b].sum() / max(toks[a:b].sum(), 1)})
  return out


def flat(cfg: ModelConfig, params, num_prompts: int, num_generations: int, prompt_len: int, new_tokens: int,
         decode: DecodeConfig, reps: int = 2, window: int = 128, progress=print) -> dict:
  """Per-token time over position of new_tokens tokens from a synthetic prompt with stopping off (no stop id):
  every row runs to the cap, so the batch and the work per token change only with the position."""
  ids, mask = synthetic_prompts(num_prompts, prompt_len, cfg.vocab_size)
  sc = SamplingConfig(new_tokens, temperature=1.0)
  run = lambda: sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, (), 0,
                                 num_generations=num_generations, decode=decode)
  t0 = time.perf_counter()
  run()
  progress(f"compiled and ran once: {time.perf_counter() - t0:.1f} s")
  runs = []
  for rep in range(reps):
    t0 = time.perf_counter()
    out = run()
    wall = time.perf_counter() - t0
    w = windows(out["trace"], window)
    runs.append({"wall_s": wall, "windows": w, "last_over_first": w[-1]["ms_per_token"] / w[0]["ms_per_token"],
                 "segments": [dataclasses.asdict(s) for s in out["trace"]]})
    progress(f"rep {rep}: {wall:.1f} s, last {window} / first {window} tokens: {runs[-1]['last_over_first']:.2f}x")
  return {"rows": num_prompts * num_generations, "prompt_len": prompt_len, "new_tokens": new_tokens,
          "decode": dataclasses.asdict(decode), "runs": runs}


def flat_table(r: dict) -> str:
  """Markdown: ms per token by window, one column per timed run."""
  lines = [f"{r['rows']} rows, prompt {r['prompt_len']}, {r['new_tokens']} new tokens, stopping off", "",
           "| tokens | " + " | ".join(f"rep {i} ms/token" for i in range(len(r["runs"]))) + " |",
           "|---|" + "---:|" * len(r["runs"])]
  for i, w in enumerate(r["runs"][0]["windows"]):
    lines.append(f"| {w['tokens'][0]}-{w['tokens'][1] - 1} | "
                 + " | ".join(f"{run['windows'][i]['ms_per_token']:.1f}" for run in r["runs"]) + " |")
  lines.append("| last / first | " + " | ".join(f"{run['last_over_first']:.2f}x" for run in r["runs"]) + " |")
  return "\n".join(lines)


def decode_work(out: dict) -> dict:
  """What a generate call decoded: row-steps run (every segment's row bucket x its tokens), row-steps of rows still
  live, and what one loop over the whole batch to the longest completion (the sampler before issue 49) ran."""
  lengths = np.asarray(out["mask"]).sum(1)
  B, longest = len(lengths), int(lengths.max())
  run = sum(len(s.rows) * (s.end - s.start) for s in out["trace"])
  live = int(np.maximum(lengths - 1, 0).sum())  # a row's first token comes from the prefill
  whole = B * (longest - 1)
  return {"rows": B, "longest": longest, "completion_tokens": int(lengths.sum()), "row_steps_run": run,
          "row_steps_live": live, "row_steps_whole_batch": whole,
          "stopped_share_whole_batch": 1 - live / max(whole, 1), "stopped_share_run": 1 - live / max(run, 1),
          "segments": len(out["trace"]), "host_checks": len(out["trace"]) + 1}


def step_costs(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, decode: DecodeConfig,
               positions=(1, 128, 256, 512, 1024)) -> list[dict]:
  """A decode step's matmul FLOPs and the bytes it must read (weights + the keys and values it attends to) at
  completion positions, against one that attends to the whole preallocated cache (prompt + new_tokens slots)."""
  params = jax.eval_shape(lambda: sampler.decode_params(cfg, model.init_params(cfg, jax.random.PRNGKey(0))))
  chunk = sampler.attention_chunk(prompt_len, new_tokens, decode)
  S = sampler.cache_lengths(prompt_len, new_tokens, decode)[-1]
  kv = jax.ShapeDtypeStruct((cfg.num_hidden_layers, rows, S, cfg.num_key_value_heads, cfg.head_size),
                            cfg.compute_dtype)
  r = jax.ShapeDtypeStruct((rows,), jnp.int32)
  # the jaxpr counts the attention's chunk loop once: one chunk per layer, added back per chunk read
  one = flops.program_flops(lambda p, c, t: model.decode_step(cfg, p, t, t, c, 0, t, chunk), params, (kv, kv), r)
  L, N, H = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_size
  chunk_flops = 4 * rows * N * H * chunk * L
  weight_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  slot_bytes = 2 * L * rows * cfg.num_key_value_heads * H * jnp.dtype(cfg.compute_dtype).itemsize
  out = []
  for t in sorted({p for p in positions if p < new_tokens} | {new_tokens - 1}):
    filled = prompt_len + t + 1
    read = -(-filled // chunk) * chunk
    whole = prompt_len + new_tokens
    out.append({"position": t, "slots_read": read, "slots_whole_cache": whole,
                "gflop": (one + (read // chunk - 1) * chunk_flops) / 1e9,
                "gflop_whole_cache": (one + (whole / chunk - 1) * chunk_flops) / 1e9,
                "gb_read": (weight_bytes + read * slot_bytes) / 1e9,
                "gb_read_whole_cache": (weight_bytes + whole * slot_bytes) / 1e9})
  return out


def costs_table(rows: list[dict]) -> str:
  lines = ["| position | cache slots read | GFLOP (matmuls) | GB read | whole cache: slots | GFLOP | GB |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['position']} | {r['slots_read']} | {r['gflop']:.2f} | {r['gb_read']:.3f} | "
                 f"{r['slots_whole_cache']} | {r['gflop_whole_cache']:.2f} | {r['gb_read_whole_cache']:.3f} |")
  return "\n".join(lines)
