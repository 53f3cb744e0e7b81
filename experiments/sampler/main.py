"""python -m experiments.sampler.main --config configs/smollm2-135m-reason.yaml --mode flat|rollouts|costs
[--new-tokens 1024] [--reps 2] [--rollouts 2] [--out DIR] [key.path=value ...]

The sampler at length (experiments/sampler/run.py), at the config's model, rollout and decode settings:
flat: per-token time over position of --new-tokens tokens on a synthetic prompt with stopping off (timed: a quiet
machine); rollouts: --rollouts real rollouts of the config's task, the rows each decode segment ran against the rows
still live (deterministic; wall times as guidance); costs: a decode step's FLOPs and bytes by position against
attending to the whole preallocated cache (compile-only)."""

import dataclasses
import json
import os
import time

from hilore_jax import cli, runtime


def _model(cfg):
  import jax

  from hilore_jax import model
  from hilore_jax.loop import engine, preflight

  if cfg.model.path:
    return preflight.load_hf("model.path", cfg.model.path, cfg.model)
  mc = engine.model_config(cfg)
  return mc, model.init_params(mc, jax.random.PRNGKey(cfg.seed), cfg.model.init_std)


def _rollouts(cfg, n: int) -> dict:
  import jax

  from experiments.sampler import run as sampler_bench
  from hilore_jax import tasks
  from hilore_jax.loop import preflight
  from hilore_jax.rl import rollout, rollout_engine
  from hilore_jax.tasks import prompts

  mc, params = _model(cfg)
  tok = preflight.load_tokenizer(preflight.tokenizer_key(cfg), cfg.tokenizer_path)
  prompter = prompts.build_prompter(tok, cfg.task, cfg.tokenizer_path, cfg.model.path)
  task = tasks.build_task(cfg.task)
  engine = rollout_engine.build(mc, cfg.rollout, prompter.stop_ids, tok.pad_token_id)
  r, rng, out = cfg.rollout, jax.random.PRNGKey(cfg.seed), []
  for i in range(n):
    rng, key = jax.random.split(rng)
    t0 = time.perf_counter()
    roll = rollout.sample_completions(mc, params, prompter, task.train_batch(i * r.num_prompts, r.num_prompts),
                                      r.num_generations, r.max_prompt_len, r.sampling(), key, task.reward, engine)
    work = sampler_bench.decode_work({"mask": roll.mask, "trace": roll.trace})
    out.append({**work, "wall_s": time.perf_counter() - t0, "lengths": roll.lengths.tolist()})
    cli.progress(f"rollout {i}: {work['completion_tokens']} completion tokens, longest {work['longest']}, "
                 f"row-steps run {work['row_steps_run']} / live {work['row_steps_live']} / whole batch "
                 f"{work['row_steps_whole_batch']}, {out[-1]['wall_s']:.1f} s (first: compiles)")
  return {"rollouts": out}


def body(args):
  from experiments.sampler import run as sampler_bench
  from hilore_jax.loop import preflight

  cfg = preflight.resolve_model(cli.load_config(args.config, args.overrides))
  runtime.enable_compilation_cache()
  r, decode = cfg.rollout, cfg.rollout.decoding()
  new_tokens = args.new_tokens or r.max_new_tokens
  if args.mode == "flat":
    mc, params = _model(cfg)
    result = sampler_bench.flat(mc, params, r.num_prompts, r.num_generations, r.max_prompt_len, new_tokens, decode,
                                reps=args.reps, progress=cli.progress)
    print(sampler_bench.flat_table(result))
  elif args.mode == "rollouts":
    result = _rollouts(cfg, args.rollouts)
  else:
    from hilore_jax.loop import engine

    mc = engine.model_config(cfg)
    mc = mc.replace(dtype=decode.dtype) if decode.dtype else mc
    result = {"costs": sampler_bench.step_costs(mc, r.num_prompts * r.num_generations, r.max_prompt_len, new_tokens,
                                                decode)}
    print(sampler_bench.costs_table(result["costs"]))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sampler_{args.mode}.json"), "w") as f:
      json.dump({"config": args.config, "overrides": args.overrides, "decode": dataclasses.asdict(decode),
                 **result}, f, indent=1)


def main(argv=None):
  cli.main("The sampler at length: per-token time over position, decode work of real rollouts, step costs", body,
           argv, args=[cli.arg("--mode", choices=("flat", "rollouts", "costs"), default="flat"),
                       cli.arg("--new-tokens", type=int, default=0, help="completion tokens (default: the config's)"),
                       cli.arg("--reps", type=int, default=2, help="flat: timed runs after the compiling one"),
                       cli.arg("--rollouts", type=int, default=2, help="rollouts: how many"),
                       cli.arg("--out", default="", help="directory for sampler_<mode>.json")])


if __name__ == "__main__":
  main()
