"""python -m experiments.budget.fill --config configs/smollm2-135m-reason.yaml --rollouts 2
[--arm name:key=value,key=value]... [overrides]

How full each setting's update is on the same rollouts, deterministic (no timing): the rollouts are sampled once
(the config's seed, from the start of its data, after its warm-start as a run), then each arm builds its update
plan on the host and counts tokens/computed, tokens/real, tokens/fill and tokens/unshared over the rollouts (one
gradient pass each), with the buffer or bucket shapes it used. Default arms: rows padded, the config's length
buckets, packed (train.packing; all three need the config's train.max_tokens_per_microbatch)."""

import json

import numpy as np

from hilore_jax import cli

# padded and buckets pin packing off: a config that packs (the reasoning recipe) would refuse a budget of 0
DEFAULT_ARMS = ("padded:train.packing=false,train.max_tokens_per_microbatch=0", "buckets:train.packing=false",
                "packed:train.packing=true")


def fill(config_path, base: list[str], arms: list[tuple[str, tuple[str, ...]]], rollouts: int) -> dict:
  """{arm: {computed, real, unshared, fill, shapes, packed_frac}} over the rollouts the base config samples (summed;
  packed_frac: the share of minibatches packed, with train.packing)."""
  from hilore_jax.loop import update_plan
  from hilore_jax.loop.trainer import Trainer

  t = Trainer(cli.load_config(config_path, [*base, "logging.progress=false"]))
  if t.config.train.warmstart_steps:  # as a run starts: the rollouts of its first steps
    t.warmstart()
  rolls = [t.next_rollout() for _ in range(rollouts)]
  out = {"completion_len_p50": [float(np.median(r.mask.sum(1))) for r in rolls], "arms": {}}
  for name, overrides in arms:
    c = cli.load_config(config_path, [*base, *overrides])
    split = c.minibatch_size // (c.train.microbatch_size or c.minibatch_size)
    tot, shapes, packed = np.zeros(3, np.int64), set(), []
    for step, roll in enumerate(rolls):  # the trainer's shuffle of each step
      plan = update_plan.build(c, roll, np.random.default_rng([c.seed, step]), None, step, True, split, 1,
                               lambda b: b)
      tot += plan.tokens()
      shapes |= {m.shape for micros in plan.grad if micros for m in micros}
      packed.append(plan.packed_frac())
    computed, real, unshared = (int(x) for x in tot)
    out["arms"][name] = {"computed": computed, "real": real, "unshared": unshared, "fill": real / computed,
                         "shapes": sorted(shapes), "packed_frac": float(np.mean(packed))}
  return out


def body(args):
  arms = []
  for text in args.arm or DEFAULT_ARMS:
    name, _, rest = text.partition(":")
    arms.append((name, tuple(o for o in rest.split(",") if o)))
  out = fill(args.config, list(args.overrides), arms, args.rollouts)
  print(f"rollouts' completion length p50: {out['completion_len_p50']}")
  print("| arm | tokens/computed | tokens/real | fill | computed / unshared | packed | shapes |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
  for name, a in out["arms"].items():
    print(f"| {name} | {a['computed']:,} | {a['real']:,} | {a['fill']:.3f} | {a['computed'] / a['unshared']:.3f} | "
          f"{a['packed_frac']:.2f} | {a['shapes']} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)


def main(argv=None):
  cli.main("Tokens computed, real and fill of several settings on the same rollouts (no timing)", body, argv,
           args=[cli.arg("--rollouts", type=int, default=2),
                 cli.arg("--arm", action="append", default=[], help="name:key=value,key=value (default: padded, "
                         "buckets, packed)"),
                 cli.arg("--out", default="", help="a JSON file for the figures")])


if __name__ == "__main__":
  main()
