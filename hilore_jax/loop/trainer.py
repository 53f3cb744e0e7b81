"""The GRPO loop: rollout -> rewards -> advantages -> minibatched updates on the typed train state
(rl/train_state.py), with side jobs (checkpoints, samples, evaluation, exports, plots) as hooks (loop/callbacks.py)
and each step's metrics row made of its parts' records (loop/records.py)."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model, runtime, sharding, tasks
from hilore_jax.loop import (adapters, callbacks, engine, evaluation, metrics, packed_step, preflight, records,
                             passes, run_checkpoint, step_hooks, update_plan)
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError, RunExists, TrainingDiverged
from hilore_jax.memory import MemoryManager, cache_key, methods
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.model import lora
from hilore_jax.rl import replay, rollout, rollout_engine, sft, train_state, train_step, update_batch
from hilore_jax.loop.shaped_memory import ShapedMemory
from hilore_jax.tasks import prompts

log = logging.getLogger(__name__)


def layer_policies(mc: MemoryConfig, cfg) -> tuple[model.LayerPolicy, ...]:
  """Per-layer remat choice of the fixed policies (planned methods start from none and allocate per step)."""
  return model.uniform(cfg.num_hidden_layers, methods.REGISTRY[mc.policy].fixed or model.NO_REMAT)


class Trainer:
  """Owns the train state, the compiled step, the hooks and the run directory of one GRPO run."""

  def __init__(self, config: Config):
    self.config = c = preflight.resolve_model(config)  # a known model's name becomes its local copy
    if c.mesh.distributed:
      runtime.init_distributed(c.mesh.coordinator_address, c.mesh.num_processes, c.mesh.process_id)
    # every process runs the same program on the same data; only the first writes metrics, summaries and exports
    self.primary = jax.process_index() == 0
    self.out_dir = c.out_dir
    preflight.check_paths(c)  # every path the config names, before any work
    self.tokenizer = preflight.load_tokenizer(preflight.tokenizer_key(c), c.tokenizer_path)
    # one read of the checkpoint (its config.json and weights), or the config's shape fields
    self.model_cfg, host_params = (preflight.load_hf("model.path", c.model.path, c.model) if c.model.path
                                   else (c.model.shape_config(), None))
    if len(self.tokenizer) > self.model_cfg.vocab_size:
      raise ConfigError(f"tokenizer has {len(self.tokenizer)} tokens but model.vocab_size is "
                        f"{self.model_cfg.vocab_size}")
    self.rng, init_key = jax.random.split(jax.random.PRNGKey(c.seed))
    self.base = None  # a LoRA run's frozen base on disk (loop/adapters.py)
    if c.lora.enabled:
      self.model_cfg, host_params, self.base = adapters.setup(c, self.model_cfg, host_params, init_key)
    self.task = tasks.build_task(c.task)
    self.prompter = prompts.build_prompter(self.tokenizer, c.task, c.tokenizer_path, c.model.path)
    self.sampler = rollout_engine.build(self.model_cfg, c.rollout, self.prompter.stop_ids,
                                        self.tokenizer.pad_token_id)  # rollout.engine: rollouts and evaluation
    self.last_rollout: rollout.Rollout | None = None
    mb = c.minibatch_size
    micro = c.train.microbatch_size or mb
    self.updates_per_step = update_batch.updates_per_step(c)
    self.replay = (replay.ReplayBuffer(c.replay, c.rollout.max_prompt_len, c.rollout.max_new_tokens)
                   if c.replay.enabled else None)
    # every update after a rollout's first runs on a policy that has moved since sampling, and a replayed row
    # always does: they need old_logp
    self.spec = train_step.StepSpec(
        self.model_cfg, c.grpo, layer_policies(c.memory, self.model_cfg), mb // micro, c.train.logprob_chunk,
        use_old_logp=self.updates_per_step > 1 or c.replay.enabled, use_ref_logp=c.grpo.beta > 0,
        temperature=c.rollout.temperature)
    self.engine, self.state = engine.build(c, self.model_cfg, c.train.steps * self.updates_per_step, host_params,
                                           init_key)
    self.n_shards = sharding.num_batch_shards(self.engine.mesh)
    if micro % self.n_shards:
      raise ConfigError(f"train.microbatch_size ({micro}) must be divisible by the {self.n_shards} devices of the "
                        f"mesh")
    self.packer = packed_step.build(c, self.stepper, self.n_shards)
    self.memory = None
    if methods.REGISTRY[c.memory.policy].fixed is None:
      hooks = step_hooks.memory_hooks(self.stepper, self.spec, c.optimizer.max_grad_norm)
      if c.train.max_tokens_per_microbatch:  # a plan per microbatch shape (not cached between runs)
        self.memory = ShapedMemory(lambda: MemoryManager(c.memory, hooks))
      else:
        self.memory = MemoryManager(c.memory, hooks, cache_key.run_store(c))
        self.memory.defer_fits = True  # a bucket met mid-step is fitted after it, not on the step's clock
    self.compiles = runtime.compile_stats()
    # the step's minibatches the memory manager works on after it (callbacks.memory_after_step), and that work's
    # record (its seconds), carried into the next step's row
    self.memory_work: passes.MemoryWork | None = None
    self.carried: dict = {}
    self.checkpoints = run_checkpoint.RunCheckpoints(self)
    self.user_hooks = callbacks.Hooks()
    self.ref_params = None
    self.start_step = 0
    self.data_position = 0
    self.eval_before: dict = {}
    self.warmstart_losses: list[float] = []

  @property
  def stepper(self) -> engine.Stepper:
    return self.engine.stepper

  @property
  def checkpointer(self):
    return self.checkpoints.checkpointer

  def add_hook(self, fn: Callable[[callbacks.StepInfo], dict | None], every: int = 0, at_end: bool = False):
    """A side job of the loop, run after the run's own (callbacks.Hooks.add); a step hook's record goes into the
    next step's row, an end hook's into the summary."""
    self.user_hooks.add(fn, every, at_end)

  def save(self, step: int):
    self.checkpoints.save(step)

  def restore_latest(self) -> bool:
    """Restore the newest intact checkpoint (a damaged newer one is reported and skipped); False if none."""
    return self.checkpoints.restore_latest()

  def place(self, batch):
    """A host pytree (an UpdateBatch, a dict of arrays) on the mesh in one transfer (engine.Engine.place)."""
    return self.engine.place(batch)

  # --------------------------------------------------------------------------- pieces

  def logprobs(self, params, batch: update_batch.UpdateBatch, micros: update_plan.Micros = None, spec=None):
    """A minibatch's log-probs under params (old or reference): packed into micros (its log-prob pass's)."""
    spec = spec or self.spec
    if micros is None:
      return self.stepper.logprobs(spec, params, batch)
    return self.packer.logprobs(spec, params, batch, micros)

  def reference_logprobs(self, batch: update_batch.UpdateBatch, micros: update_plan.Micros = None):
    """The KL reference's log-probs: a LoRA run's frozen base (its own params with the adapters off: no copy of the
    weights), else the params copied before the first step."""
    if self.model_cfg.lora is not None:
      return self.logprobs(self.state.params, batch, micros, adapters.reference_spec(self.spec))
    return self.logprobs(self.ref_params, batch, micros)

  def evaluate(self, params, rng) -> dict:
    c = self.config
    return evaluation.evaluate(self.model_cfg, params, self.prompter, self.task.test_examples[:c.eval.num_examples],
                               self.task.reward, max_prompt_len=c.rollout.max_prompt_len,
                               max_new_tokens=c.rollout.max_new_tokens, pass_k=c.eval.pass_k,
                               temperature=c.eval.temperature, batch_size=c.eval.batch_size, rng=rng,
                               sampler=self.sampler)

  def warmstart(self, progress=None):
    """Supervised steps on every weight of the model (a LoRA run's base, its adapters kept as they start)."""
    c = self.config
    split = self.state.split
    base = split.trainable if split.frozen is None else split.frozen
    params, self.warmstart_losses = sft.warmstart(
        self.model_cfg.replace(lora=None), base, self.prompter, self.task.train_example,
        steps=c.train.warmstart_steps, batch_size=c.train.warmstart_batch_size, lr=c.train.warmstart_lr,
        max_prompt_len=c.rollout.max_prompt_len, max_new_tokens=c.rollout.max_new_tokens, place=self.place,
        progress=progress)
    if split.frozen is not None:
      params = lora.Split(params, split.trainable).combined()
    params = jax.device_put(params, self.engine.param_shardings)
    self.state = train_state.create(params, self.engine.optimizer, self.engine.state_shardings)  # a fresh optimizer

  def plan_update(self, roll: rollout.Rollout, rng: np.random.Generator, step: int = 0) -> update_plan.UpdatePlan:
    """The rollout's update (loop/update_plan.py): minibatches built on the host, each placed in one transfer, with
    the token budget's microbatches and the step's stats."""
    return update_plan.build(self.config, roll, rng, self.replay, step, self.spec.use_old_logp, self.spec.microbatches,
                             self.n_shards, self.place)

  def add_logprobs(self, plan: update_plan.UpdatePlan) -> update_plan.UpdatePlan:
    """The plan with its reference and old log-probs filled in (update_plan.with_logprobs)."""
    return update_plan.with_logprobs(self.config, plan, self.state.params, self.logprobs,
                                     self.reference_logprobs if self.spec.use_ref_logp else None)

  def next_rollout(self) -> rollout.Rollout:
    """Sample and score the next prompts of the training stream under the current policy."""
    c = self.config
    examples = self.task.train_batch(self.data_position, c.rollout.num_prompts)
    self.data_position += c.rollout.num_prompts
    self.rng, key = jax.random.split(self.rng)
    return rollout.sample_completions(self.model_cfg, self.state.params, self.prompter, examples,
                                      c.rollout.num_generations, c.rollout.max_prompt_len, c.rollout.sampling(), key,
                                      self.task.reward, self.sampler)

  # --------------------------------------------------------------------------- loop

  def hooks(self, writer: metrics.MetricsWriter) -> callbacks.Hooks:
    """The run's side jobs (callbacks.standard), then the user's (add_hook)."""
    h = callbacks.standard(self, writer)
    h.hooks += self.user_hooks.hooks
    return h

  def start(self):
    """A new run's steps before GRPO: the warm-start, a LoRA run's base on disk, the KL reference, the evaluation
    before training, and checkpoint 0."""
    from tqdm.auto import tqdm

    c = self.config
    if c.train.warmstart_steps:
      bar = tqdm(total=c.train.warmstart_steps, desc="warm-start (SFT)", disable=not c.logging.progress)
      self.warmstart(progress=lambda s, loss: bar.update(1))
      bar.close()
      log.info("warm-start loss %.3f -> %.3f", self.warmstart_losses[0], self.warmstart_losses[-1])
    if c.lora.enabled and self.base is None:  # the run's own base, on disk before the first checkpoint
      self.base = adapters.write_base(c, self.model_cfg, self.state.params, self.tokenizer)
    if c.grpo.beta > 0 and not c.lora.enabled:  # a LoRA run's reference is its base: no copy
      self.ref_params = jax.tree_util.tree_map(jnp.copy, self.state.params)
    if c.eval.at_start:  # minutes at length on a CPU: say what runs before the first step's bar appears
      log.info("eval before GRPO: greedy on %d held-out problems, up to %d new tokens%s",
               min(c.eval.num_examples, len(self.task.test_examples)), c.rollout.max_new_tokens,
               f", and pass@{c.eval.pass_k}" if c.eval.pass_k else "")
      self.eval_before = self.evaluate(self.state.params, jax.random.PRNGKey(c.seed + 1))
      log.info("eval before GRPO: %s", {k: v for k, v in self.eval_before.items() if k != "eval/correct"})
    self.save(0)

  def train(self) -> dict:
    from tqdm.auto import tqdm

    c = self.config
    if not c.train.resume and self.checkpointer.latest_step() is not None:
      # never overwrite another run's checkpoints by accident
      raise RunExists(f"{self.checkpointer.directory} already holds checkpoints (latest step "
                      f"{self.checkpointer.latest_step()}): pass train.resume=true to continue that run, "
                      f"or choose a new out_dir")
    resumed = c.train.resume and self.restore_latest()
    if c.train.resume and not resumed:
      log.warning("train.resume=true but %s holds no checkpoint: starting from scratch", self.checkpointer.directory)
    if not resumed:
      self.start()
    writer = metrics.MetricsWriter(self.out_dir, self.start_step if resumed else None, c.logging.tensorboard,
                                   enabled=self.primary)
    hooks = self.hooks(writer)
    bar = tqdm(range(self.start_step, c.train.steps), initial=self.start_step, total=c.train.steps, desc="GRPO",
               disable=not c.logging.progress or not self.primary)
    row = None
    try:
      for step in bar:
        row = self.run_step(step)
        writer.write(row)
        self.carried = hooks.after_step(callbacks.StepInfo(step + 1, step + 1 == c.train.steps, row))
        bar.set_postfix({"reward": f"{row['reward/mean']:.3f}", "kl": f"{row['kl']:.4f}",
                         "tok/s": f"{row['throughput/update_tokens_per_s']:.0f}"})
    except TrainingDiverged as e:
      raise TrainingDiverged(f"{e}; the last good checkpoint is step {self.checkpoints.last_saved} in "
                             f"{self.checkpointer.directory}") from None
    finally:
      bar.close()
      writer.close()
    summary = hooks.at_end(callbacks.StepInfo(c.train.steps, True, row))
    self.checkpointer.close()
    return self.finish(summary)

  def run_step(self, step: int) -> dict:
    """One GRPO step: a rollout under the current policy (sampled and scored), then its update."""
    t0 = time.perf_counter()
    roll = self.next_rollout()
    self.last_rollout = roll  # what the model saw and said this step (samples.jsonl, tests)
    runtime.release_host_memory()  # the sampler's freed temporaries would count towards the update's peak
    t_rollout = time.perf_counter() - t0
    row = self.update(roll, step)
    row.update({"time/rollout_s": t_rollout, "time/step_s": time.perf_counter() - t0})
    return row

  def update(self, roll: rollout.Rollout, step: int) -> dict:
    """A rollout's update: advantages -> minibatches -> allocations (all minibatches at once) -> compiled steps ->
    the step's metrics row (its rollout's timings aside), read to host once."""
    c = self.config
    t1, compiles_before = time.perf_counter(), self.compiles.compiled
    plan = self.add_logprobs(self.plan_update(roll, np.random.default_rng([c.seed, step]), step))
    self.state, ran = passes.run(c, self.state, plan, step, self.spec, self.stepper, self.packer, self.memory)
    # the next rollout needs these params anyway, so waiting here costs nothing and times the update honestly
    updates = jax.device_get(ran.updates)
    t_update = time.perf_counter() - t1
    if ran.memory_work is not None:  # what the manager's work after the step reads, and the measured guard
      self.memory_work = ran.memory_work
      clean = self.compiles.compiled == compiles_before and not any(r["time/plan_fit_s"] or r["alloc/deferred"]
                                                                    for r in ran.alloc_rows)
      self.memory.observe(t_update / (len(ran.memory_work.batches) * c.grpo.num_iterations), clean,
                          [m["grad_norm"] for m in updates])  # ||g||: the drift sentinel's
    upd = records.UpdateRecord(updates, float(self.engine.lr_schedule(max(int(self.state.step) - 1, 0))), ran.peaks)
    upd.check_finite(step + 1)
    tokens = records.TokenRecord.of(plan, c.grpo.num_iterations, self.spec.microbatches, self.packer)
    run = records.RunRecord(t_update, tokens.unshared * tokens.passes,
                            {"compile/count": self.stepper.compile_count, "compile/probes": self.stepper.probe_compiles,
                             **self.compiles.metrics()}, runtime.host_memory_mib(), time.time() - runtime.STARTED_AT)
    # the memory manager's seconds after the previous step (time/memory_setup_s, time/recalibrate_s)
    carried, self.carried = self.carried, {}
    return records.row(step + 1, records.RolloutRecord.of(roll, self.data_position), plan.stats, upd,
                       records.AllocationRecord(ran.alloc_rows), tokens, run, carried)

  def finish(self, records_at_end: dict) -> dict:
    """The run's summary (steps, the evaluation before, the compile log, the warm-start's last loss, and what the
    end hooks recorded), written to summary.json by the first process."""
    summary = {"steps": self.config.train.steps, "eval_before": self.eval_before,
               "compile_log": self.stepper.compile_log, "warmstart_loss": self.warmstart_losses[-1:] or None,
               **records_at_end}
    if self.primary:
      metrics.write_json(os.path.join(self.out_dir, "summary.json"), summary)
    return summary
