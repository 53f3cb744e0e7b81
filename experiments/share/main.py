"""python -m experiments.share.main [--config configs/roofline_smollm2.yaml] [--prompts 8 --generations 8
--prompt-len 256 --completion-len 256] [--out runs/bench_share.json] [key.path=value ...]

The update's compiled FLOPs and peak with each group's prompt computed once against once per row
(experiments/share/run.py), at the config's model shape: compile-only, nothing runs."""

from hilore_jax import cli


def body(args):
  from experiments.common import config
  from experiments.share import run as share

  cfg, _ = config.load(args.config, args.overrides, "bench")  # the bench configs' YAML carries a bench section
  row = share.run(cfg, args.out, num_prompts=args.prompts, G=args.generations, prompt_len=args.prompt_len,
                  completion_len=args.completion_len, policies=tuple(args.policies.split(",")))
  print(share.table(row, tuple(args.policies.split(","))))
  print(f"written: {args.out}")


def main(argv=None):
  cli.main("Compiled FLOPs and peak of the update, prompt computed once per group vs once per row", body, argv,
           args=[cli.arg("--prompts", type=int, default=8), cli.arg("--generations", type=int, default=8),
                 cli.arg("--prompt-len", type=int, default=256), cli.arg("--completion-len", type=int, default=256),
                 cli.arg("--policies", default="none,gc", help="comma-separated remat policies: none, gc"),
                 cli.arg("--out", default="runs/bench_share.json", help="the figures as JSON")])


if __name__ == "__main__":
  main()
