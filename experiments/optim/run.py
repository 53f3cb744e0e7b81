"""Optimizer memory: optimizer-state, gradient and compiled-step bytes of AdamW vs LoGRA at several ranks (and
LoGRA with predicted-KL control), under full checkpointing (GC) and a HiLoRe plan, plus the bytes a policy update
ships to a separate sampler as sketches vs dense. Deterministic: array sizes and XLA's compiled memory figures.

Total step memory = params + optimizer state + the step's peak beyond them (gradients between the two programs +
the larger program's temp: activations, and the optimizer's or the KL's working set). The HiLoRe plan is made once,
with AdamW's stepper, and reused, as is each policy's gradient program: it does not depend on the optimizer; only the
update program is compiled per optimizer."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import optax

from hilore_jax import model
from hilore_jax.loop import engine, step_hooks
from hilore_jax.capacity import synthetic
from experiments.common import engines
from experiments.common.config import BenchConfig
from experiments.common.engines import nbytes
from hilore_jax.config import Config
from hilore_jax.memory import MemoryManager
from hilore_jax.optim import logra
from hilore_jax.rl import train_step

MiB = 2**20


def state_2d_bytes(params, opt_state) -> int:
  """Optimizer-state bytes for the params with >= 2 dims (also embeddings, lm head, attention biases): AdamW's
  two moments, or LoGRA's moments and P."""
  kinds = (logra.LograState, optax.ScaleByAdamState)
  (st,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kinds)) if isinstance(s, kinds)]
  treedef = jax.tree_util.tree_structure(params)
  proj = treedef.flatten_up_to(st.proj) if isinstance(st, logra.LograState) else [None] * treedef.num_leaves
  # a stacked layer axis (the train layout) is a batch of each layer's param, not one of its dims
  dims = [len(x.shape) - (model.is_stacked(params) and getattr(path[0], "key", None) == "layers")
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
  return sum(nbytes(m) + nbytes(v) + (0 if p is None else nbytes(p))
             for d, m, v, p in zip(dims, treedef.flatten_up_to(st.mu), treedef.flatten_up_to(st.nu), proj) if d >= 2)


def _arms(cfg: Config, ranks, hidden: int) -> list[tuple[str, Config]]:
  oc = cfg.optimizer
  kl_off = dataclasses.replace(oc.kl_control, target=0.0)
  arms = [("adamw", dataclasses.replace(oc, kind="adamw", kl_control=kl_off))]
  for r in ranks:
    arms.append((f"logra r={r}", dataclasses.replace(oc, kind="logra", kl_control=kl_off,
                                                     logra=dataclasses.replace(oc.logra, rank=r))))
  kl = dataclasses.replace(oc.kl_control, target=oc.kl_control.target or 0.01)
  r8 = max(1, hidden // 8)
  arms.append((f"logra r={r8} + kl", dataclasses.replace(oc, kind="logra", kl_control=kl,
                                                        logra=dataclasses.replace(oc.logra, rank=r8))))
  return [(name, dataclasses.replace(cfg, optimizer=o)) for name, o in arms]


def run(cfg: Config, bc: BenchConfig, out_dir: str, ranks=(), memories=("gc", "hilore"), progress=print) -> dict:
  """Every (optimizer, memory policy) pair's bytes; writes optim.json and optim.md into out_dir."""
  mcfg = engine.model_config(cfg)
  D = mcfg.hidden_size
  ranks = tuple(ranks) or tuple(sorted({max(1, D // 16), max(1, D // 8), max(1, D // 4)}))
  os.makedirs(out_dir, exist_ok=True)
  completion = bc.seq_len - bc.prompt_len
  spec = train_step.StepSpec(mcfg, dataclasses.replace(cfg.grpo, max_completion_len=completion),
                             model.uniform(mcfg.num_hidden_layers, model.FULL_REMAT), 1, cfg.train.logprob_chunk,
                             use_old_logp=True, use_ref_logp=cfg.grpo.beta > 0)
  arms = _arms(cfg, ranks, D)
  base, base_state = engines.build(arms[0][1], mcfg)
  rng = np.random.default_rng(cfg.seed)
  K = cfg.memory.calib_batches if "hilore" in memories else 0
  batches = [synthetic.grpo_batch(mcfg, base_state["params"], rng, bc.batch_size, bc.prompt_len, completion,
                                  bc.group_size, bc.zero_adv_frac, bc.logp_noise) for _ in range(1 + K)]
  if not spec.use_ref_logp:
    batches = [b.replace(ref_logp=None) for b in batches]
  policies = {"gc": spec.policies}
  if "hilore" in memories:
    progress(f"optim bench: HiLoRe plan (calibration on {K} batches, budget {cfg.memory.budget_ratio}x GC)")
    mm = MemoryManager(dataclasses.replace(cfg.memory, policy="hilore"), step_hooks.memory_hooks(base.stepper, spec))
    mm.setup(base_state["params"], batches, 0)
    policies["hilore"] = mm.allocate(batches[:1])[0].policies
  batch = batches[0]
  specs = {mem: dataclasses.replace(spec, policies=policies[mem]) for mem in memories}
  grad_steps = {mem: base.stepper.get(specs[mem], batch, reason=f"optim bench {mem}") for mem in memories}
  rows = []
  for name, acfg in arms:
    eng, state = (base, base_state) if acfg is arms[0][1] else engines.build(acfg, mcfg)
    params, opt_state = state["params"], state["opt_state"]
    ship = logra.sketch_bytes(opt_state) if acfg.optimizer.kind == "logra" else {}
    for mem in memories:
      step = eng.stepper.with_update_of(grad_steps[mem], specs[mem], batch)
      row = {"optimizer": name, "memory": mem, "params_bytes": nbytes(params), "opt_state_bytes": nbytes(opt_state),
             "opt_2d_bytes": state_2d_bytes(params, opt_state), "grad_bytes": int(step.grad_bytes),
             "grad_temp_bytes": step.grad_temp_bytes, "update_temp_bytes": step.update_temp_bytes,
             "peak_bytes": step.peak_bytes}
      row["total_bytes"] = row["params_bytes"] + row["opt_state_bytes"] + row["peak_bytes"]
      if ship:
        refresh = acfg.optimizer.logra.refresh_every
        row["ship_dense_bytes"] = ship["logra/update_bytes"]
        row["ship_sketch_bytes"] = ship["logra/factor_bytes"] + (ship["logra/sketch_bytes"]
                                                                 - ship["logra/factor_bytes"]) / refresh
      rows.append(row)
      progress(f"optim bench: {name} / {mem}: state {row['opt_state_bytes'] / MiB:.2f} MiB, peak "
               f"{row['peak_bytes'] / MiB:.2f} MiB, total {row['total_bytes'] / MiB:.2f} MiB")
    if acfg.optimizer.kind == "logra":
      st = logra.state_bytes(opt_state)
      for r in rows[-len(memories):]:
        r.update({"sketched_state_bytes": st["logra/sketched_bytes"],
                  "sketched_adam_bytes": st["logra/sketched_adam_bytes"]})
  ref = next(r for r in rows if r["optimizer"] == "adamw" and r["memory"] == "gc")
  for r in rows:
    r["total_vs_adamw_gc_pct"] = 100 * (r["total_bytes"] / ref["total_bytes"] - 1)
    r["opt_2d_vs_adamw_pct"] = 100 * r["opt_2d_bytes"] / ref["opt_2d_bytes"]
    if "sketched_state_bytes" in r:
      r["sketched_vs_adamw_pct"] = 100 * r["sketched_state_bytes"] / r["sketched_adam_bytes"]
  result = {"model": dataclasses.asdict(mcfg), "batch": [bc.batch_size, bc.seq_len], "ranks": list(ranks),
            "refresh_every": cfg.optimizer.logra.refresh_every, "rows": rows}
  with open(os.path.join(out_dir, "optim.json"), "w") as f:
    json.dump(result, f, indent=2, default=str)
  with open(os.path.join(out_dir, "optim.md"), "w") as f:
    f.write(report(result) + "\n")
  return result


def report(result: dict) -> str:
  """The table, MiB, and the two target ratios."""
  m = result["model"]
  lines = [f"# Optimizer memory: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, minibatch "
           f"{result['batch'][0]} x {result['batch'][1]} tokens, LoGRA refresh every {result['refresh_every']}", "",
           "| optimizer | memory | opt state | matrices' state vs Adam | 2-D state vs AdamW | grads | grad temp | "
           "update temp | step peak | total | vs AdamW+GC | sampler sync / update (sketch vs dense) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  mib = lambda b: f"{b / MiB:.2f}"
  for r in result["rows"]:
    sk = f"{r['sketched_vs_adamw_pct']:.1f}%" if "sketched_vs_adamw_pct" in r else "100%"
    sync = (f"{mib(r['ship_sketch_bytes'])} vs {mib(r['ship_dense_bytes'])}" if "ship_sketch_bytes" in r
            else "dense")
    lines.append(f"| {r['optimizer']} | {r['memory']} | {mib(r['opt_state_bytes'])} | {sk} | "
                 f"{r['opt_2d_vs_adamw_pct']:.1f}% | {mib(r['grad_bytes'])} | {mib(r['grad_temp_bytes'])} | "
                 f"{mib(r['update_temp_bytes'])} | {mib(r['peak_bytes'])} | {mib(r['total_bytes'])} | "
                 f"{r['total_vs_adamw_gc_pct']:+.1f}% | {sync} |")
  lines += ["", "MiB. matrices' state: LoGRA's moments + P of the sketched weight matrices over Adam's two moments "
            "of the same matrices; 2-D state: every leaf with >= 2 dims (embeddings, lm head and attention biases "
            "stay dense AdamW). step peak = gradients + the larger program's temp; total = params + opt state + "
            "step peak. Sampler sync: the r x N factors each update plus P [M, r] amortised over the refresh "
            "period, dense leaves whole; dense: the whole float32 update."]
  return "\n".join(lines)
