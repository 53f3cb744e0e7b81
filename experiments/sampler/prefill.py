"""python -m experiments.sampler.prefill --config configs/roofline_smollm2.yaml rollout.num_prompts=8
rollout.num_generations=8 rollout.max_prompt_len=48 rollout.max_new_tokens=16

The sampler's compiled FLOPs with each group's prompt prefilled once against once per row
(experiments/sampler/prefill_flops.py), at the config's model shape and rollout: compile-only, nothing runs."""

from hilore_jax import cli


def body(args):
  from hilore_jax.loop import engine
  from experiments.common import config
  from experiments.sampler import prefill_flops

  cfg, _ = config.load(args.config, args.overrides, "bench")  # the bench configs' YAML carries a bench section
  r = cfg.rollout
  print(prefill_flops.table(prefill_flops.sampler_flops(engine.model_config(cfg), r.num_prompts, r.num_generations,
                                                        r.max_prompt_len, r.max_new_tokens)))


def main(argv=None):
  cli.main("Compiled FLOPs of the sampler, prompt prefilled once per group vs once per row", body, argv)


if __name__ == "__main__":
  main()
