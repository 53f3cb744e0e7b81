"""python -m experiments.lora.sampler --config configs/smollm2-135m-arith-lora.yaml --rollouts 6 [overrides]

A LoRA run's sampler, timed both ways on the same prompts and keys, interleaved (the order alternates): merged
weights (W + scale * A B computed once per rollout under jit, what the trainer runs: model/lora.py sampling_model)
against the base plus its adapters in every decode step; sampler.generate either way, the merge timed with it.
The adapters are the run's fresh ones with B moved off zero (seeded), so both ways sample a policy other than the
base; each way's first rollout compiles and is not timed. Also prints the largest gap between the log-probs the
trainer's (merged) sampler reports and the unmerged forward's.
"""

from __future__ import annotations

import json
import os
import time

from hilore_jax import cli


def body(args):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from hilore_jax import stats
  from hilore_jax.loop.trainer import Trainer
  from hilore_jax.model import lora
  from hilore_jax.rl import rollout, sampler, train_step
  from hilore_jax.rl.update_batch import UpdateBatch

  cfg = cli.load_config(args.config, [*args.overrides, f"out_dir={args.out}", "logging.progress=false"])
  if not cfg.lora.enabled:
    raise SystemExit("config error: lora.rank is 0: nothing to merge")
  t = Trainer(cfg)
  keys = iter(jax.random.split(jax.random.PRNGKey(args.seed), 1 << 12))
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: 0.01 * jax.random.normal(next(keys), x.shape, x.dtype) if jax.tree_util.keystr(p).endswith(
          "['B']") else x, t.state["params"])
  c, mcfg = cfg.rollout, t.model_cfg
  examples = t.task.train_batch(0, c.num_prompts)
  ids, mask, _ = t.prompter.encode(examples, c.max_prompt_len)
  sc = c.sampling()

  def generate(model_cfg, p, key):
    return jax.block_until_ready(sampler.generate(model_cfg, p, ids, mask, key, sc, t.prompter.stop_ids,
                                                  t.prompter.tokenizer.pad_token_id,
                                                  num_generations=c.num_generations))

  # the merge is part of the merged way's time: once per rollout, as the trainer runs it
  ways = {"merged": lambda key: generate(*lora.sampling_model(mcfg, params), key),
          "unmerged": lambda key: generate(mcfg, params, key)}
  for fn in ways.values():  # compile
    fn(jax.random.PRNGKey(0))
  times = {k: [] for k in ways}
  for r in range(args.rollouts):
    for name in (("merged", "unmerged") if r % 2 == 0 else ("unmerged", "merged")):
      t0 = time.perf_counter()
      ways[name](jax.random.PRNGKey(r + 1))
      times[name].append(time.perf_counter() - t0)
  roll = rollout.sample_completions(mcfg, params, t.prompter, examples, c.num_generations, c.max_prompt_len, sc,
                                    jax.random.PRNGKey(1), t.task.reward)  # the trainer's path: merged
  batch = UpdateBatch(*(jnp.asarray(x) for x in (roll.prompt_ids, roll.prompt_mask, roll.tokens, roll.mask)))
  logp = np.asarray(train_step.completion_logprobs(mcfg, params, batch, temperature=sc.temperature)[0])
  m = roll.mask > 0
  out = {"config": args.config, "overrides": list(args.overrides), "rollouts": args.rollouts, "seconds": times,
         "ratio_merged_over_unmerged": stats.summary(np.asarray(times["merged"]) / np.asarray(times["unmerged"])),
         "max_abs_logp_gap": float(np.abs(logp[m] - roll.sample_logprobs[m]).max()) if m.any() else 0.0,
         "trained_params": int(sum(x.size for x in jax.tree.leaves(lora.trainable(params))))}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "lora_sampler.json"), "w") as f:
    json.dump(out, f, indent=1)
  r = out["ratio_merged_over_unmerged"]
  print(f"rollout seconds, median: merged {np.median(times['merged']):.2f}, unmerged {np.median(times['unmerged']):.2f}"
        f"; merged / unmerged {r['mean']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] (n = {r['n']})")
  print(f"merged sampler's log-probs against the unmerged forward: max |gap| {out['max_abs_logp_gap']:.2e}")


def main(argv=None):
  cli.main("A LoRA run's sampler, merged weights against base plus adapters, timed on the same prompts", body, argv,
           args=[cli.arg("--out", default="runs/lora_sampler"), cli.arg("--rollouts", type=int, default=6),
                 cli.arg("--seed", type=int, default=0)])


if __name__ == "__main__":
  main()
