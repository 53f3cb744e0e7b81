"""python -m experiments.paired.main --config configs/smollm2-135m-arith.yaml --a train.share_prompt=false
--b train.share_prompt=true --rollouts 3 --reps 2 [--floor] --out runs/paired memory.policy=gc

Arm B's update time against arm A's on the same rollouts from the same state, paired, with bootstrap CIs
(experiments/paired/run.py); --floor also times arm A compiled a second time (the noise floor); --sampler also times
each group's prompt prefilled once against once per row.
Each arm is the config plus the trailing overrides plus its own (--a / --b, comma-separated)."""

from hilore_jax import cli


def body(args):
  from experiments.paired import run as paired

  split = lambda s: tuple(x for x in s.split(",") if x)
  out = paired.run(args.config, list(args.overrides), paired.Arm(args.a_name, split(args.a)),
                   paired.Arm(args.b_name, split(args.b)), args.rollouts, args.reps, args.out, args.sampler,
                   args.floor)
  print(paired.table(out))


def main(argv=None):
  cli.main("Paired update (and sampler) timing of two settings on the same rollouts", body, argv, args=[
      cli.arg("--a", default="", help="arm A's overrides, comma-separated"),
      cli.arg("--b", default="", help="arm B's overrides, comma-separated"),
      cli.arg("--a-name", default="a"), cli.arg("--b-name", default="b"),
      cli.arg("--rollouts", type=int, default=3), cli.arg("--reps", type=int, default=2),
      cli.arg("--sampler", action="store_true", help="also time the sampler's prompt layouts"),
      cli.arg("--floor", action="store_true", help="also time arm A compiled a second time: the noise floor"),
      cli.arg("--out", default="runs/paired", help="directory for paired.json and the arms' run directories")])


if __name__ == "__main__":
  main()
