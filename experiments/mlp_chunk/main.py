"""python -m experiments.mlp_chunk.main [--shape smollm2-135m] [--layers 2] [--rows 8] [--positions 2048]
[--chunk 512] [--reps 6] [--out DIR]

What model.mlp_chunk_len costs and saves: the gradient of `--layers` layers of a shape under full checkpointing
(bf16, blockwise attention), the MLP chunked against whole. Deterministic figures first: each program's compiled
peak and HLO instructions. Then seconds, paired per repetition in one process (arms in rotating order), with a
second compilation of the whole-MLP program as the noise floor; ratios' means with bootstrap CIs (hilore_jax/stats)."""

import json
import os
import time

from hilore_jax import cli


def _program(cfg, params, ids):
  import jax
  import jax.numpy as jnp

  from hilore_jax import model

  pols = model.uniform(cfg.num_hidden_layers, model.FULL_REMAT)
  loss = lambda p: jnp.sum(model.hidden_states(cfg, p, ids, layer_policies=pols).astype(jnp.float32))
  return jax.jit(jax.grad(loss)).lower(params).compile()


def body(args):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from hilore_jax import model, stats
  from hilore_jax.capacity import measure as capacity

  base = capacity.load_shape(args.shape, capacity.Settings()).replace(num_hidden_layers=args.layers,
                                                                         attention="blockwise")
  params = model.stacked(model.init_params(base, jax.random.PRNGKey(0)))
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  ids = (jnp.arange(args.rows * args.positions).reshape(args.rows, args.positions) * 7) % base.vocab_size
  arms = {"whole": 0, "chunked": args.chunk, "whole_again": 0}  # whole_again: its own compilation (the floor)
  progs, out = {}, {"shape": args.shape, "layers": args.layers, "rows": args.rows, "positions": args.positions,
                    "chunk": args.chunk, "programs": {}}
  for name, chunk in arms.items():
    progs[name] = _program(base.replace(mlp_chunk_len=chunk), params, ids)
    m = progs[name].memory_analysis()
    out["programs"][name] = {"peak_bytes": m.temp_size_in_bytes + m.output_size_in_bytes,
                             "hlo_instructions": sum(" = " in line for line in progs[name].as_text().splitlines())}
    jax.block_until_ready(progs[name](params))  # warm
  cli.progress(json.dumps(out["programs"]))
  seconds = {name: [] for name in arms}
  names = list(arms)
  for r in range(args.reps):
    for name in names[r % 3:] + names[:r % 3]:
      t0 = time.perf_counter()
      jax.block_until_ready(progs[name](params))
      seconds[name].append(time.perf_counter() - t0)
    cli.progress(f"rep {r + 1}/{args.reps}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names))
  whole = np.asarray(seconds["whole"])
  out["seconds"] = seconds
  out["chunked_over_whole"] = stats.summary(np.asarray(seconds["chunked"]) / whole)
  out["floor"] = stats.summary(np.asarray(seconds["whole_again"]) / whole)
  out["peak_ratio"] = out["programs"]["chunked"]["peak_bytes"] / out["programs"]["whole"]["peak_bytes"]
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mlp_chunk.json"), "w") as f:
      json.dump(out, f, indent=1)
  fmt = lambda s: f"{s['mean']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
  print(f"peak chunked / whole {out['peak_ratio']:.3f}; seconds chunked / whole {fmt(out['chunked_over_whole'])}, "
        f"floor (whole again / whole) {fmt(out['floor'])}; median whole {np.median(whole):.2f} s")


def main(argv=None):
  cli.main("What the MLP in chunks of the sequence costs and saves (model.mlp_chunk_len)", body, argv, config=False,
           args=[cli.arg("--shape", default="smollm2-135m", help="configs/shapes name"),
                 cli.arg("--layers", type=int, default=2),
                 cli.arg("--rows", type=int, default=8),
                 cli.arg("--positions", type=int, default=2048),
                 cli.arg("--chunk", type=int, default=512, help="model.mlp_chunk_len of the chunked arm"),
                 cli.arg("--reps", type=int, default=6),
                 cli.arg("--out", help="directory for mlp_chunk.json")])


if __name__ == "__main__":
  main()
