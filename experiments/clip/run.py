"""The compiled step's memory with and without gradient clipping: one fused program vs the shipped two programs.

Compile only (abstract shapes, nothing runs), so it prints the same bytes on any CPU. The fused program is what a
single `jax.jit(train_step)` compiles to; the split one is `engine.Step` as the trainer runs it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hilore_jax import model, optim, sharding
from hilore_jax.loop import engine
from hilore_jax.capacity import synthetic
from experiments.common.config import BenchConfig
from hilore_jax.config import Config
from hilore_jax.rl import train_state, train_step

MIB = 2 ** 20


def plans(layers: int) -> dict[str, tuple[model.LayerPolicy, ...]]:
  """Full checkpointing, no remat, and a mixed plan (every other layer keeps its MLP gate)."""
  keep_gate = model.LayerPolicy(remat=True, save=(model.MLP_GATE,))
  return {"gc": model.uniform(layers, model.FULL_REMAT), "none": model.uniform(layers, model.NO_REMAT),
          "mixed": tuple(model.FULL_REMAT if i % 2 else keep_gate for i in range(layers))}


def abstract_batch(cfg: Config, b: BenchConfig):
  """The bench minibatch's shapes (prompt + completion ids and masks, advantages, reference log-probs)."""
  host = synthetic.token_batch(2, np.random.default_rng(0), b.batch_size, b.prompt_len, b.seq_len - b.prompt_len)
  if cfg.grpo.beta > 0:
    host = host.replace(ref_logp=np.zeros(host.tokens.shape, np.float32))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)


def _state(params, optimizer):
  return train_state.abstract(params, optimizer)


def _temp(compiled) -> int:
  return int(compiled.memory_analysis().temp_size_in_bytes)


def clip_rows(cfg: Config, bc: BenchConfig, progress=print) -> list[dict]:
  """Per plan: fused temp without and with clipping, and the split step's parts and peak (bytes)."""
  mcfg = engine.model_config(cfg)
  params = jax.eval_shape(lambda k: model.init_params(mcfg, k), jax.random.PRNGKey(0))
  batch = abstract_batch(cfg, bc)
  clip = optim.make_optimizer(cfg.optimizer, 1000)
  no_clip = optim.make_optimizer(dataclasses.replace(cfg.optimizer, max_grad_norm=0.0), 1000)
  mesh = sharding.make_mesh(1, 1)
  rows = []
  for name, pols in plans(mcfg.num_hidden_layers).items():
    spec = train_step.StepSpec(mcfg, cfg.grpo, pols, 1, cfg.train.logprob_chunk, use_ref_logp=cfg.grpo.beta > 0)
    row = {"plan": name}
    for key, opt in (("fused_no_clip", no_clip), ("fused_clip", clip)):
      fused = jax.jit(lambda s, b, opt=opt: train_step.train_step(s, b, spec, opt), donate_argnums=0)
      row[key] = _temp(fused.lower(_state(params, opt), batch).compile())
    state = _state(params, clip)
    shardings = jax.tree_util.tree_map(lambda _: sharding.replicated(mesh), state)
    step = engine.Stepper(mesh, clip, state, shardings).get(spec, batch, count=False)
    row.update(grad_temp=step.grad_temp_bytes, update_temp=step.update_temp_bytes, grad_bytes=step.grad_bytes,
               split_peak=step.peak_bytes)
    rows.append(row)
    progress(f"{name}: fused no clip {row['fused_no_clip'] / MIB:.1f} MiB, fused clip "
             f"{row['fused_clip'] / MIB:.1f} MiB, split {row['split_peak'] / MIB:.1f} MiB")
  return rows


def clip_table(rows: list[dict]) -> str:
  """Markdown: the fused program's temp with and without clipping against the split step's peak (MiB)."""
  head = ["| plan | fused, no clip | fused, clip | split: gradient temp | update temp | gradients | split peak "
          "| split / (no clip + gradients) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  body = [f"| {r['plan']} | {r['fused_no_clip'] / MIB:.1f} | {r['fused_clip'] / MIB:.1f} | {r['grad_temp'] / MIB:.1f} "
          f"| {r['update_temp'] / MIB:.1f} | {r['grad_bytes'] / MIB:.1f} | {r['split_peak'] / MIB:.1f} "
          f"| {r['split_peak'] / (r['fused_no_clip'] + r['grad_bytes']):.3f} |" for r in rows]
  return "\n".join(head + body)
