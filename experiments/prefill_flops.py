"""FLOPs of the sampler with each GRPO group's prompt prefilled once, against once per row (compile-only).

Two counts, neither runs anything. XLA's cost analysis of the compiled program counts every while loop's body once:
the decode loop's and the layer scan's too, so its prefill is one layer's. The jaxpr's matmul count
(capacity/flops.py) multiplies the layer scan by its length but still counts the decode loop's body once. The prefill
is therefore also traced alone, on the distinct prompts (Bp rows) and on every row (B = Bp * G), and a whole call is
estimated from the matmul counts as prefill + N decode steps, a step being the rest of `generate`'s count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hilore_jax import model
from hilore_jax.capacity import flops
from hilore_jax.model import ModelConfig
from hilore_jax.rl import sampler
from hilore_jax.rl.config import SamplingConfig


def sampler_flops(cfg: ModelConfig, num_prompts: int, num_generations: int, prompt_len: int,
                  new_tokens: int) -> dict:
  """FLOPs of one rollout's sampling with shared and repeated prefill, from abstract params."""
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.PRNGKey(0)))
  sc = SamplingConfig(new_tokens)
  Bp, G, N = num_prompts, num_generations, new_tokens
  sds = lambda b: jax.ShapeDtypeStruct((b, prompt_len), jnp.int32)
  gen = lambda g: lambda p, i, m: sampler.generate(cfg, p, i, m, jax.random.PRNGKey(0), sc, 0, 0, num_generations=g)
  pre = lambda p, i, m: sampler.prefill(cfg, {**p, "layers": model.stack_layers(p["layers"])}, i, m)
  xla = lambda fn, b: float(jax.jit(fn).lower(params, sds(b), sds(b)).compile().cost_analysis()["flops"])
  matmul = lambda fn, b: flops.program_flops(fn, params, sds(b), sds(b))
  row = {"prompts": Bp, "generations": G, "prompt_len": prompt_len, "new_tokens": N}
  for name, count in (("matmul", matmul), ("xla", xla)):
    row[f"{name}/prefill_shared"], row[f"{name}/prefill_repeated"] = count(pre, Bp), count(pre, Bp * G)
    row[f"{name}/generate_shared"], row[f"{name}/generate_repeated"] = count(gen(G), Bp), count(gen(1), Bp * G)
  step = row["matmul/generate_repeated"] - row["matmul/prefill_repeated"]  # one decode loop body
  row["matmul/decode_step"] = step
  for mode in ("shared", "repeated"):
    row[f"matmul/call_{mode}"] = row[f"matmul/prefill_{mode}"] + N * step
  row["matmul/call_saved_pct"] = 100 * (1 - row["matmul/call_shared"] / row["matmul/call_repeated"])
  return row


def table(row: dict) -> str:
  """Markdown table of one sampler_flops row, in GFLOP."""
  g = lambda k: f"{row[k] / 1e9:.4g}" if k in row else "-"
  lines = [f"{row['prompts']} prompts x G={row['generations']}, prompt {row['prompt_len']}, "
           f"{row['new_tokens']} new tokens: GFLOP, compile-only", "",
           "| count | prompt prefilled | prefill | generate (decode loop body once) | whole call: prefill + N steps |",
           "|---|---|---|---|---|"]
  for name, label in (("matmul", "jaxpr matmuls"), ("xla", "XLA cost analysis (every loop body once)")):
    for mode in ("shared", "repeated"):
      what = "once per group" if mode == "shared" else "once per row"
      lines.append(f"| {label} | {what} | {g(f'{name}/prefill_{mode}')} | {g(f'{name}/generate_{mode}')} | "
                   f"{g(f'{name}/call_{mode}')} |")
  lines += ["", f"one decode step: {g('matmul/decode_step')} GFLOP of matmuls; prefilling once per group saves "
            f"{row['matmul/call_saved_pct']:.1f}% of a whole call's"]
  return "\n".join(lines)
