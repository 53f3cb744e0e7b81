"""FLOPs of the sampler with each GRPO group's prompt prefilled once, against once per row (compile-only).

Two counts, neither runs anything, of the sampler's start program (the prefill, its cache copied to the G rows of
each prompt, the first draw: `sampler.start`) and of the prefill alone, on the distinct prompts (Bp rows) and on every
row (B = Bp * G). XLA's cost analysis of a compiled program counts every while loop's body once, the layer scan's
too, so its prefill is one layer's; the jaxpr's matmul count (capacity/flops.py) multiplies the layer scan by its
length. A whole call is estimated from the matmul counts as the start + N - 1 decode steps, a step being one
`model.decode_step` on the B rows (its attention's chunk loop counted once: one chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hilore_jax import model
from hilore_jax.capacity import flops
from hilore_jax.model import ModelConfig
from hilore_jax.rl import sampler
from hilore_jax.rl.config import DecodeConfig, SamplingConfig


def sampler_flops(cfg: ModelConfig, num_prompts: int, num_generations: int, prompt_len: int,
                  new_tokens: int) -> dict:
  """FLOPs of one rollout's sampling with shared and repeated prefill, from abstract params."""
  params = jax.eval_shape(lambda: sampler.decode_params(cfg, model.init_params(cfg, jax.random.PRNGKey(0))))
  sc, decode = SamplingConfig(new_tokens), DecodeConfig()
  Bp, G, N = num_prompts, num_generations, new_tokens
  B, S = Bp * G, sampler.cache_lengths(prompt_len, N, decode)[0]
  sds = lambda b: jax.ShapeDtypeStruct((b, prompt_len), jnp.int32)
  keys = jnp.zeros((B, 2), jnp.uint32)
  start = lambda g: lambda p, i, m: sampler.start(cfg, sc, p, i, m, keys, jnp.zeros((1,), jnp.int32), g, S)
  pre = lambda p, i, m: sampler.prefill(cfg, p, i, m)
  xla = lambda fn, b: float(jax.jit(fn).lower(params, sds(b), sds(b)).compile().cost_analysis()["flops"])
  matmul = lambda fn, b: flops.program_flops(fn, params, sds(b), sds(b))
  row = {"prompts": Bp, "generations": G, "prompt_len": prompt_len, "new_tokens": N}
  for name, count in (("matmul", matmul), ("xla", xla)):
    row[f"{name}/prefill_shared"], row[f"{name}/prefill_repeated"] = count(pre, Bp), count(pre, B)
    row[f"{name}/start_shared"], row[f"{name}/start_repeated"] = count(start(G), Bp), count(start(1), B)
  kv = jax.ShapeDtypeStruct((cfg.num_hidden_layers, B, S, cfg.num_key_value_heads, cfg.head_size), cfg.compute_dtype)
  chunk = sampler.attention_chunk(prompt_len, N, decode)
  step = flops.program_flops(lambda p, c, t: model.decode_step(cfg, p, t, t, c, 0, t, chunk), params, (kv, kv),
                             jax.ShapeDtypeStruct((B,), jnp.int32))
  row["matmul/decode_step"] = step
  for mode in ("shared", "repeated"):
    row[f"matmul/call_{mode}"] = row[f"matmul/start_{mode}"] + (N - 1) * step
  row["matmul/call_saved_pct"] = 100 * (1 - row["matmul/call_shared"] / row["matmul/call_repeated"])
  return row


def table(row: dict) -> str:
  """Markdown table of one sampler_flops row, in GFLOP."""
  g = lambda k: f"{row[k] / 1e9:.4g}" if k in row else "-"
  lines = [f"{row['prompts']} prompts x G={row['generations']}, prompt {row['prompt_len']}, "
           f"{row['new_tokens']} new tokens: GFLOP, compile-only", "",
           "| count | prompt prefilled | prefill | start (prefill, copy to G rows, first draw) | whole call: start + "
           "N - 1 steps |",
           "|---|---|---|---|---|"]
  for name, label in (("matmul", "jaxpr matmuls"), ("xla", "XLA cost analysis (every loop body once)")):
    for mode in ("shared", "repeated"):
      what = "once per group" if mode == "shared" else "once per row"
      lines.append(f"| {label} | {what} | {g(f'{name}/prefill_{mode}')} | {g(f'{name}/start_{mode}')} | "
                   f"{g(f'{name}/call_{mode}')} |")
  lines += ["", f"one decode step: {g('matmul/decode_step')} GFLOP of matmuls; prefilling once per group saves "
            f"{row['matmul/call_saved_pct']:.1f}% of a whole call's"]
  return "\n".join(lines)
