"""python -m experiments.budget.attention [--reps 9] [--buffer 2816] [--cap 256] [--prompt 96] [--prompts 2]
[--block 64] [--out FILE]

One layer's attention, forward and backward, at SmolLM2-135M's attention shape (9 query heads on 3 kv heads of 64),
on one packed buffer of completions after a table of prompts (lengths 40 to the cap, nearly half at the cap, packed
in decreasing order until the buffer is full) against the same rows padded to the cap: blockwise with the segments'
bound (the band, what packed passes run), blockwise without it (every key block visited, the invisible ones skipped
one by one), xla over the buffer ([L, table + L] scores), and the padded rows under xla (rows x cap queries over
prompt + cap keys). The arms alternate, in reverse order every other round; medians, paired ratios and XLA's
compiled temp bytes (deterministic)."""

import json
import time

import numpy as np

from hilore_jax import cli

N, K, H = 9, 3, 64


def buffer_rows(L: int, cap: int, seed: int = 0) -> list[int]:
  """Completion lengths, longest first, that fill a buffer of L positions: each at the cap with probability 0.45,
  else uniform in [40, cap)."""
  rng, lens = np.random.default_rng(seed), []
  while True:
    n = cap if rng.random() < 0.45 else int(rng.integers(min(40, cap - 1), cap))
    if sum(lens) + n > L:
      return sorted(lens, reverse=True)
    lens.append(n)


def arms(L: int, cap: int, P: int, U: int, block: int, seed: int = 0) -> tuple[dict, dict, list[int]]:
  """({arm: (jitted value-and-gradient of sum(attention * cotangent), its (q, k, v))}, {arm: positions}, lengths)."""
  import jax
  import jax.numpy as jnp

  from hilore_jax.model.attention import (Segments, attention_context, attention_probs, blockwise_attention,
                                          segment_mask)

  lens = buffer_rows(L, cap, seed)
  seg = np.zeros(L, np.int32)
  seg[:sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
  entry = np.where(seg > 0, (seg - 1) % U, -1)
  table_mask = np.arange(P)[None] >= np.random.default_rng(seed).integers(P // 8, P // 4 + 1, (U, 1))  # left pads
  ids = (seg[None], (-1 - entry)[None], np.concatenate([-1 - np.repeat(np.arange(U), P), seg])[None])
  ids = tuple(jnp.asarray(x, jnp.int32) for x in ids)
  key_mask = jnp.asarray(np.concatenate([table_mask.reshape(-1), seg > 0])[None])
  S0 = U * P
  mask = jnp.asarray(np.arange(S0 + L)[None, :] <= S0 + np.arange(L)[:, None])[None] & key_mask[:, None]
  mask = mask & segment_mask(Segments(*ids))
  B = len(lens)
  pad_mask = jnp.asarray(np.arange(P + cap)[None, :] <= P + np.arange(cap)[:, None])[None] & jnp.asarray(
      np.concatenate([np.repeat(table_mask, -(-B // U), 0)[:B], np.arange(cap)[None] < np.array(lens)[:, None]],
                     1))[:, None]
  keys = jax.random.split(jax.random.PRNGKey(seed), 8)
  qkv = lambda T, S, rows, i: (jax.random.normal(keys[i], (rows, T, N, H)), jax.random.normal(keys[i + 1],
                               (rows, S, K, H)), jax.random.normal(keys[i + 2], (rows, S, K, H)))
  packed, padded = qkv(L, S0 + L, 1, 0), qkv(cap, P + cap, B, 3)
  ct = jax.random.normal(keys[6], packed[0].shape) * jnp.asarray(seg > 0)[None, :, None, None]
  ct_pad = jax.random.normal(keys[7], padded[0].shape) * jnp.asarray(np.arange(cap)[None] < np.array(lens)[:, None])[
      ..., None, None]
  grad = lambda f, c: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * c), argnums=(0, 1, 2)))
  blk = lambda bound: lambda q, k, v: blockwise_attention(q, k, v, key_mask, S0, block, block, Segments(*ids, bound))
  out = {"band": (grad(blk(cap), ct), packed), "dense": (grad(blk(None), ct), packed),
         "xla_buffer": (grad(lambda q, k, v: attention_context(attention_probs(q, k, mask), v), ct), packed),
         "padded_xla": (grad(lambda q, k, v: attention_context(attention_probs(q, k, pad_mask), v), ct_pad), padded)}
  return out, {a: (B * cap if a == "padded_xla" else L) for a in out}, lens


def run(L: int, cap: int, P: int, U: int, block: int, reps: int, seed: int = 0, skip=("xla_buffer",)) -> dict:
  """Medians, paired ratios to the padded arm and compiled temp bytes of every arm (`skip`: compiled, not timed)."""
  import jax

  fns, positions, lens = arms(L, cap, P, U, block, seed)
  temp = {a: int(f.lower(*x).compile().memory_analysis().temp_size_in_bytes) for a, (f, x) in fns.items()}
  timed = [a for a in fns if a not in skip]
  want = fns["xla_buffer"][0](*fns["xla_buffer"][1])[1]
  err = {a: max(float(np.abs(np.asarray(g) - np.asarray(w)).max() / np.abs(np.asarray(w)).max())
                for g, w in zip(fns[a][0](*fns[a][1])[1], want)) for a in ("band", "dense")}
  times = {a: [] for a in timed}
  for r in range(reps + 1):  # the first round warms up
    for a in (timed if r % 2 == 0 else timed[::-1]):
      t0 = time.perf_counter()
      jax.block_until_ready(fns[a][0](*fns[a][1]))
      if r:
        times[a].append(time.perf_counter() - t0)
  med = {a: float(np.median(t)) for a, t in times.items()}
  ratio = lambda a, b: float(np.median(np.array(times[a]) / np.array(times[b])))
  return {"lengths": lens, "positions": positions, "median_s": med,
          "us_per_position": {a: 1e6 * med[a] / positions[a] for a in timed},
          "paired_vs_padded": {a: ratio(a, "padded_xla") for a in timed},
          "paired_vs_dense": {a: ratio(a, "dense") for a in timed}, "temp_bytes": temp,
          "max_grad_err_vs_xla": err, "times_s": times}


def body(args):
  out = run(args.buffer, args.cap, args.prompt, args.prompts, args.block, args.reps)
  print(f"{len(out['lengths'])} completions, {sum(out['lengths'])} tokens in {args.buffer} positions")
  print("| arm | positions | median s | us / position | paired / padded | paired / dense | compiled temp MB |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
  for a, b in out["temp_bytes"].items():
    t = (f"{out['median_s'][a]:.3f} | {out['us_per_position'][a]:.1f} | {out['paired_vs_padded'][a]:.3f} | "
         f"{out['paired_vs_dense'][a]:.3f}" if a in out["median_s"] else "not timed | | |")
    print(f"| {a} | {out['positions'][a]:,} | {t} | {b / 1e6:.1f} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)


def main(argv=None):
  cli.main("Packed attention's time per position: the band, every key block, xla, padded rows", body, argv,
           args=[cli.arg("--reps", type=int, default=9), cli.arg("--buffer", type=int, default=2816),
                 cli.arg("--cap", type=int, default=256), cli.arg("--prompt", type=int, default=96),
                 cli.arg("--prompts", type=int, default=2), cli.arg("--block", type=int, default=64),
                 cli.arg("--out", default="", help="a JSON file for the figures")], config=False)


if __name__ == "__main__":
  main()
