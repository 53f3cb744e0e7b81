"""The GRPO loop: rollout -> rewards -> advantages -> minibatched updates, with checkpoints and metrics.

Over 320 lines on purpose: the loop's phases (rollout, update batch, log-probs, per-pass allocation, compiled steps,
checkpoints) all act on one Trainer's sharded state and run directory; the numerics live elsewhere."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model, runtime, sharding, tasks
from hilore_jax.loop import (adapters, checkpointing, engine, evaluation, metrics, packed_step, preflight, step_hooks,
                             update_plan)
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError, RunExists, TrainingDiverged
from hilore_jax.memory import MemoryManager, methods
from hilore_jax.memory import store as stores
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.model import hf, lora
from hilore_jax.rl import prompt_share, replay, rollout, rollout_engine, sft, token_budget, train_step, update_batch
from hilore_jax.loop.shaped_memory import ShapedMemory
from hilore_jax.tasks import prompts

log = logging.getLogger(__name__)


# config sections that change nothing the memory manager measures or fits at set-up
_NOT_IN_MEMORY_KEY = ("out_dir", "logging", "eval", "checkpoint")


def memory_store(c: Config) -> stores.JsonStore | None:
  """Where this recipe's memory set-up is cached between runs (memory.cache): keyed by the config (less output,
  logging, evaluation and checkpoint settings, and the step count unless the risk is the optimizer update's), the
  model's files, the library's code, JAX's version, its devices and XLA flags."""
  if not c.memory.cache:
    return None
  d = {k: v for k, v in c.to_dict().items() if k not in _NOT_IN_MEMORY_KEY}
  d["train"] = {k: v for k, v in d["train"].items() if k not in ("resume", "steps") or
                (k == "steps" and c.memory.risk_metric == "update")}
  # how the run starts and checks the plans does not change what set-up measures
  d["memory"] = {k: v for k, v in d["memory"].items() if k not in ("cache", "warmup", "verify_steps")}
  model_dir = c.model.path
  if model_dir:
    d["model_files"] = stores.files_digest([os.path.join(model_dir, f) for f in os.listdir(model_dir)
                                            if os.path.isfile(os.path.join(model_dir, f))])
    d["model"] = {k: v for k, v in d["model"].items() if k != "path"}  # the files say which model it is
  # the whole package: a change in memory/ or model/ may measure other errors or compile other peaks
  d["code"] = stores.source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  devs = jax.devices()
  d["jax"] = [jax.__version__, devs[0].platform, devs[0].device_kind, len(devs), jax.process_count(),
              os.environ.get("XLA_FLAGS", "")]
  return stores.JsonStore(runtime.cache_dir("memory"), stores.digest(d))


def layer_policies(mc: MemoryConfig, cfg) -> tuple[model.LayerPolicy, ...]:
  """Per-layer remat choice of the fixed policies (planned methods start from none and allocate per step)."""
  return model.uniform(cfg.num_hidden_layers, methods.REGISTRY[mc.policy].fixed or model.NO_REMAT)


class Trainer:
  """Owns the sharded state, the compiled step and the run directory of one GRPO run."""

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
    total_updates = c.train.steps * self.updates_per_step
    self.replay = (replay.ReplayBuffer(c.replay, c.rollout.max_prompt_len, c.rollout.max_new_tokens)
                   if c.replay.enabled else None)
    # every update after a rollout's first runs on a policy that has moved since sampling, and a replayed row
    # always does: they need old_logp
    self.spec = train_step.StepSpec(
        self.model_cfg, c.grpo, layer_policies(c.memory, self.model_cfg), mb // micro, c.train.logprob_chunk,
        use_old_logp=self.updates_per_step > 1 or c.replay.enabled, use_ref_logp=c.grpo.beta > 0,
        temperature=c.rollout.temperature)
    self.engine, self.state = engine.build(c, self.model_cfg, total_updates, host_params, init_key)
    n_shards = sharding.num_batch_shards(self.engine.mesh)
    if micro % n_shards:
      raise ConfigError(f"train.microbatch_size ({micro}) must be divisible by the {n_shards} devices of the mesh")
    self.packer, self.n_shards = self._token_budget(n_shards), n_shards
    self.memory = None
    if methods.REGISTRY[c.memory.policy].fixed is None:
      hooks = step_hooks.memory_hooks(self.stepper, self.spec, c.optimizer.max_grad_norm)
      if c.train.max_tokens_per_microbatch:  # a plan per microbatch shape (not cached between runs)
        self.memory = ShapedMemory(lambda: MemoryManager(c.memory, hooks))
      else:
        self.memory = MemoryManager(c.memory, hooks, memory_store(c))
        self.memory.defer_fits = True  # a bucket met mid-step is fitted after it, not on the step's clock
    self.compiles = runtime.compile_stats()
    # the memory manager's work after a step (set-up after a warm-up step, drift checks and recalibration, buckets the
    # step deferred), its seconds reported in the next step's row; the step's minibatches it works on
    self._after_step_s, self._last_minibatches, self._last_logp = {}, None, None
    self.checkpointer = checkpointing.Checkpointer(os.path.join(self.out_dir, "checkpoints"), c.checkpoint.keep)
    self.ref_params = None
    self.start_step = 0
    self.data_position = 0
    self.eval_before: dict = {}
    self.warmstart_losses: list[float] = []

  def _token_budget(self, n_shards: int) -> packed_step.PackedStepper | None:
    """The token budget's programs (train.max_tokens_per_*), checked against the mesh; None when both are off."""
    c, tb = self.config, self.config.train
    if not (tb.max_tokens_per_microbatch or tb.max_tokens_per_logprob_pass):
      return None
    P, N = c.rollout.max_prompt_len, c.rollout.max_new_tokens
    row = N if tb.packing and tb.share_prompt else P + N  # a packed row: its completion, or prompt and completion
    for key in ("max_tokens_per_microbatch", "max_tokens_per_logprob_pass"):
      budget = getattr(tb, key)
      if budget and tb.packing and budget // n_shards < row:
        raise ConfigError(f"train.{key} ({budget}) gives each of the mesh's {n_shards} devices a packed buffer of "
                          f"{budget // n_shards} positions, fewer than a row at the cap ({row}): raise it to "
                          f"{n_shards * row} or more")
      if budget and not tb.packing and token_budget.rows_per_microbatch(budget, P, N, c.minibatch_size,
                                                                       n_shards) < 1:
        raise ConfigError(f"train.{key} ({budget}) holds fewer than the mesh's {n_shards} rows of "
                          f"{P} + {N} tokens ({n_shards * (P + N)})")
    return packed_step.PackedStepper(self.stepper)

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
      return self.logprobs(self.state["params"], batch, micros, adapters.reference_spec(self.spec))
    return self.logprobs(self.ref_params, batch, micros)

  @property
  def stepper(self) -> engine.Stepper:
    return self.engine.stepper

  def _checkpoint(self) -> tuple[dict, dict]:
    """(tree, shardings) of a checkpoint: train state, reference params (KL), replay buffer (host arrays)."""
    eng = self.engine
    replay_state = self.replay.state() if self.replay is not None else None  # the same on every process
    tree = checkpointing.run_tree(adapters.checkpoint_state(self.state), self.ref_params, replay_state)
    rep = sharding.replicated(eng.mesh)
    sh = checkpointing.run_tree(adapters.checkpoint_state(eng.state_shardings),
                                eng.param_shardings if self.ref_params is not None else None,
                                jax.tree.map(lambda _: rep, replay_state))
    return tree, sh

  def save(self, step: int):
    meta = {"step": step, "data_position": self.data_position,
            "rng": np.asarray(jax.random.key_data(self.rng)).tolist(), "eval_before": self.eval_before,
            "warmstart_losses": self.warmstart_losses, "config": self.config.to_dict(),
            "memory_manager": self.memory.state_json() if self.memory is not None else None,
            "lora": adapters.checkpoint_meta(self.model_cfg, self.base),
            checkpointing.LAYERS_KEY: checkpointing.STACKED}
    self.checkpointer.save(step, self._checkpoint()[0], meta)
    runtime.release_host_memory()  # the save's host copies, freed

  def restore_latest(self) -> bool:
    """Restore the newest intact checkpoint (a damaged newer one is reported and skipped); False if none."""
    latest = self.checkpointer.latest_step()
    if latest is not None:  # a checkpoint of another learner or base is refused, never restored onto this one
      adapters.check_checkpoint(self.checkpointer.restore_meta(latest), self.model_cfg, self.base, latest)
    if self.config.grpo.beta > 0 and not self.config.lora.enabled:
      self.ref_params = self.state["params"]  # shape donor; replaced by the restored reference
    tree, shardings = self._checkpoint()
    found = checkpointing.restore_train_layout(self.checkpointer, engine.abstract(tree, shardings), shardings)
    if found is None:
      self.ref_params = None
      return False
    _, tree, meta = found
    self.state = adapters.restored_state(self.state, tree["train"])
    self.ref_params = tree.get("ref")
    if self.replay is not None:
      self.replay = replay.ReplayBuffer.from_state(self.config.replay, jax.device_get(tree["replay"]))
    self.start_step = int(meta["step"])
    self.data_position = int(meta["data_position"])
    self.rng = jnp.asarray(np.asarray(meta["rng"], np.uint32))
    self.eval_before = meta.get("eval_before") or {}
    self.warmstart_losses = meta.get("warmstart_losses") or []
    if self.memory is not None and meta.get("memory_manager"):
      self.memory.load_state(meta["memory_manager"])
    log.info("resumed from step %d (data position %d)", self.start_step, self.data_position)
    return True

  # --------------------------------------------------------------------------- pieces

  def place(self, batch):
    """A host pytree (an UpdateBatch, a dict of arrays) on the mesh in one transfer: rows split over the batch axes
    where they divide, else replicated."""
    n = sharding.num_batch_shards(self.engine.mesh)
    split, rep = sharding.batch_sharding(self.engine.mesh), sharding.replicated(self.engine.mesh)
    shardings = (prompt_share.field_shardings(batch, split, rep) if isinstance(batch, update_batch.UpdateBatch)
                 else jax.tree.map(lambda v: split if v.shape[0] % n == 0 else rep, batch))  # prompt tables replicated
    if jax.process_count() == 1:
      return jax.device_put(batch, shardings)
    # every process holds the whole host batch and places only its own devices' rows: device_put would first
    # check that the processes agree, and NaN (old_logp's "to be filled in") never equals itself
    return jax.tree.map(lambda v, s: jax.make_array_from_callback(v.shape, s, lambda idx: v[idx]), batch, shardings)

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
    split = lora.partition(self.state["params"])
    base = split.trainable if split.frozen is None else split.frozen
    params, self.warmstart_losses = sft.warmstart(
        self.model_cfg.replace(lora=None), base, self.prompter, self.task.train_example,
        steps=c.train.warmstart_steps, batch_size=c.train.warmstart_batch_size, lr=c.train.warmstart_lr,
        max_prompt_len=c.rollout.max_prompt_len, max_new_tokens=c.rollout.max_new_tokens, place=self.place,
        progress=progress)
    if split.frozen is not None:
      params = lora.Split(params, split.trainable).combined()
    params = jax.device_put(params, self.engine.param_shardings)
    opt_state = jax.jit(self.engine.optimizer.init,
                        out_shardings=self.engine.state_shardings["opt_state"])(lora.trainable(params))
    self.state = {"params": params, "opt_state": opt_state, "step": self.state["step"]}

  def plan_update(self, roll: rollout.Rollout, rng: np.random.Generator, step: int = 0) -> update_plan.UpdatePlan:
    """The rollout's update (loop/update_plan.py): minibatches built on the host, each placed in one transfer, with
    the token budget's microbatches and the step's stats."""
    return update_plan.build(self.config, roll, rng, self.replay, step, self.spec.use_old_logp, self.spec.microbatches,
                             self.n_shards, self.place)

  def add_logprobs(self, plan: update_plan.UpdatePlan) -> update_plan.UpdatePlan:
    """The plan with ref_logp and old_logp filled in on the devices, and `current`: the current policy's log-probs
    of each minibatch where a forward computed them, else None. old_logp comes from the policy that sampled, which
    is the current one: every fresh row an update sees after the rollout's first update needs it; replayed rows
    keep the behaviour log-probs stored with them (their current log-probs are the exposure's ratio numerator)."""
    later = self.config.grpo.num_iterations > 1
    sampled = self.config.grpo.old_logp == "sampler"  # fresh rows carry the sampler's: no forward for them
    out, current = [], []
    for i, (b, micros) in enumerate(zip(plan.batches, plan.logp)):
      if self.spec.use_ref_logp:
        b = b.replace(ref_logp=self.reference_logprobs(b, micros))
      logp = None
      if update_batch.needs_old_forward(b, i, later) and not (sampled and b.replayed is None):
        logp = self.logprobs(self.state["params"], b, micros)
        if b.replayed is not None:  # replayed rows keep their stored behaviour log-probs
          b = b.replace(old_logp=jnp.where(b.replayed[:, None] > 0, b.old_logp, logp))
        else:  # every row: a later pass reads the on-policy rows' too
          b = b.replace(old_logp=logp)
      out.append(b)
      current.append(logp if b.replayed is not None else None)
    return plan.replace(batches=tuple(out), current=tuple(current))

  def next_rollout(self) -> rollout.Rollout:
    """Sample and score the next prompts of the training stream under the current policy."""
    c = self.config
    examples = self.task.train_batch(self.data_position, c.rollout.num_prompts)
    self.data_position += c.rollout.num_prompts
    self.rng, key = jax.random.split(self.rng)
    return rollout.sample_completions(self.model_cfg, self.state["params"], self.prompter, examples,
                                      c.rollout.num_generations, c.rollout.max_prompt_len, c.rollout.sampling(), key,
                                      self.task.reward, self.sampler)

  # --------------------------------------------------------------------------- loop

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
    progress = c.logging.progress
    if not resumed:
      if c.train.warmstart_steps:
        bar = tqdm(total=c.train.warmstart_steps, desc="warm-start (SFT)", disable=not progress)
        self.warmstart(progress=lambda s, loss: bar.update(1))
        bar.close()
        log.info("warm-start loss %.3f -> %.3f", self.warmstart_losses[0], self.warmstart_losses[-1])
      if c.lora.enabled and self.base is None:  # the run's own base, on disk before the first checkpoint
        self.base = adapters.write_base(c, self.model_cfg, self.state["params"], self.tokenizer)
      if c.grpo.beta > 0 and not c.lora.enabled:  # a LoRA run's reference is its base: no copy
        self.ref_params = jax.tree_util.tree_map(jnp.copy, self.state["params"])
      if c.eval.at_start:  # minutes at length on a CPU: say what runs before the first step's bar appears
        log.info("eval before GRPO: greedy on %d held-out problems, up to %d new tokens%s",
                 min(c.eval.num_examples, len(self.task.test_examples)), c.rollout.max_new_tokens,
                 f", and pass@{c.eval.pass_k}" if c.eval.pass_k else "")
        self.eval_before = self.evaluate(self.state["params"], jax.random.PRNGKey(c.seed + 1))
        log.info("eval before GRPO: %s", {k: v for k, v in self.eval_before.items() if k != "eval/correct"})
      self.save(0)
    writer = metrics.MetricsWriter(self.out_dir, self.start_step if resumed else None, c.logging.tensorboard,
                                   enabled=self.primary)
    bar = tqdm(range(self.start_step, c.train.steps), initial=self.start_step, total=c.train.steps, desc="GRPO",
               disable=not progress or not self.primary)
    last_saved = self.start_step
    try:
      for step in bar:
        row = self.run_step(step)
        writer.write(row)
        if self.memory is not None and self._last_minibatches is not None:  # after the row, off the step's clock
          self._after_step_s = self.memory.finish_step(self.state["params"], self._last_minibatches, step,
                                                       self._last_logp, self.state["opt_state"],
                                                       last=step + 1 == c.train.steps)
          self._last_minibatches = self._last_logp = None
          if self._after_step_s:
            runtime.release_host_memory()  # calibration's gradients and probe programs' temporaries, freed
        if c.logging.samples_every and (step + 1) % c.logging.samples_every == 0:  # the first prompt's group
          writer.write_samples(step + 1, rollout.sample_rows(self.prompter, self.last_rollout,
                                                             range(c.rollout.num_generations)))
        bar.set_postfix({"reward": f"{row['reward/mean']:.3f}", "kl": f"{row['kl']:.4f}",
                         "tok/s": f"{row['throughput/update_tokens_per_s']:.0f}"})
        if (step + 1) % c.checkpoint.every == 0 or step + 1 == c.train.steps:
          self.save(step + 1)
          last_saved = step + 1
    except TrainingDiverged as e:
      raise TrainingDiverged(f"{e}; the last good checkpoint is step {last_saved} in "
                             f"{self.checkpointer.directory}") from None
    finally:
      bar.close()
      writer.close()
    return self.finish()

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
    shuffle = np.random.default_rng([c.seed, step])
    plan = self.add_logprobs(self.plan_update(roll, shuffle, step))
    specs, plans = [self.spec] * len(plan), plan.grad
    alloc_rows, allocations, mem_batches, mem_logp = [], None, list(plan.batches), list(plan.current)
    if self.memory is not None and len(plan):
      # what the memory manager plans for: the minibatches, or with the token budget their microbatches
      mem_batches, mem_logp = plan.memory_batches(plan.batches, mem_logp)
      allocations = self.memory.step(self.state["params"], mem_batches, step, mem_logp, self.state["opt_state"])
    # hilore reallocates every later pass: its minibatches are off-policy, and the previous pass's log-probs (an
    # output of that pass's step, no extra forward) tell the exposure which tokens now clip
    per_pass = methods.REGISTRY[c.memory.policy].exposure
    step_metrics, peaks, token_logp = [], [], []
    for it in range(c.grpo.num_iterations):
      batches = plan.pass_batches(it, self.spec.use_old_logp)
      if allocations is not None:
        if it > 0 and per_pass:
          allocations = self.memory.allocate(*plan.memory_batches(batches, token_logp))
        specs = [dataclasses.replace(self.spec, policies=a.policies) for a in allocations]
        if plans[0] is not None:  # one spec per microbatch, grouped by minibatch
          ends = np.cumsum([len(m) for m in plans])
          specs = [specs[e - len(m):e] for e, m in zip(ends, plans)]
        alloc_rows += [a.metrics for a in allocations]
      token_logp = []
      for spec, b, micros in zip(specs, batches, plans):
        if micros is None:
          compiled = self.stepper.get(spec, b, reason=f"memory.policy={c.memory.policy}")
          self.state, m = compiled(self.state, b)
          peaks.append(compiled.peak_bytes)
        else:
          self.state, m, peak = self.packer.step(spec, self.state, b, micros)
          peaks.append(peak)
        token_logp.append(m.pop(train_step.TOKEN_LOGP))
        step_metrics.append(m)
    # the next rollout needs these params anyway, so waiting here costs nothing and times the update honestly
    step_metrics = jax.device_get(step_metrics)
    t_update = time.perf_counter() - t1
    if self.memory is not None and len(plan):  # what the manager's work after the step reads
      self._last_minibatches, self._last_logp = mem_batches, mem_logp
    if self.memory is not None and len(plan):  # the measured guard: GC's time against the plans'
      clean = self.compiles.compiled == compiles_before and not any(r["time/plan_fit_s"] or r["alloc/deferred"]
                                                                    for r in alloc_rows)
      self.memory.observe(t_update / (len(mem_batches) * c.grpo.num_iterations), clean,
                          [m["grad_norm"] for m in step_metrics])  # ||g||: the drift sentinel's
    row = {"step": step + 1, "reward/mean": float(roll.rewards.mean()), "reward/std": float(roll.rewards.std()),
           **plan.stats, "completion_len/mean": float(roll.mask.sum(1).mean()), **metrics.completion_lengths(roll),
           "prompts/truncated": roll.truncated_prompts, "data/position": self.data_position,
           "lr": float(self.engine.lr_schedule(max(int(self.state["step"]) - 1, 0))), "updates": len(step_metrics)}
    row.update(metrics.reduce_updates(step_metrics))
    if not all(np.isfinite(row[k]) for k in ("loss", "grad_norm")):
      raise TrainingDiverged(f"non-finite loss or gradient at step {step + 1} (loss={row['loss']}, "
                             f"grad_norm={row['grad_norm']})")
    row.update(metrics.reduce_allocations(alloc_rows))
    row.update(metrics.token_counts(*plan.tokens(), c.grpo.num_iterations))
    tokens = row["tokens/unshared"]
    row.update(self.budget_metrics(plan))
    if peaks:
      row["memory/compiled_bytes"] = max(peaks)
    row.update({"time/update_s": t_update, "throughput/update_tokens_per_s": tokens / t_update if t_update > 0 else 0.0,
                "memory/peak_bytes": peaks[-1] if peaks else 0, "compile/count": self.stepper.compile_count,
                "compile/probes": self.stepper.probe_compiles, **self.compiles.metrics(), **runtime.host_memory_mib(),
                "time/elapsed_s": time.time() - runtime.STARTED_AT})
    row.update(self._after_step_s)  # time/memory_setup_s, time/recalibrate_s: the previous step's
    self._after_step_s = {}
    return row

  def budget_metrics(self, plan: update_plan.UpdatePlan) -> dict:
    """budget/*: the update's padded share of the positions it holds (with the token budget on: its microbatches,
    and the distinct microbatch shapes compiled so far)."""
    out = {"budget/padding_frac": plan.padding_frac()}
    if self.packer is not None:
      micro = sum(self.spec.microbatches if m is None else len(m) for m in plan.grad)
      out.update({"budget/microbatches": micro * self.config.grpo.num_iterations,
                  "budget/compiled_shapes": len(self.packer.shapes)})
    return out

  def finish(self) -> dict:
    c = self.config
    summary = {"steps": c.train.steps, "eval_before": self.eval_before, "compile_log": self.stepper.compile_log,
               "warmstart_loss": self.warmstart_losses[-1:] or None}
    if c.eval.at_end:
      summary["eval_after"] = self.evaluate(self.state["params"], jax.random.PRNGKey(c.seed + 1))
      if self.eval_before:
        summary["accuracy_gain_pp"] = 100 * (summary["eval_after"]["eval/accuracy"] -
                                             self.eval_before["eval/accuracy"])
        if "eval/correct" in self.eval_before:  # a run resumed from an older checkpoint may lack it
          summary["accuracy_gain_ci95_pp"] = evaluation.paired_gain_ci(self.eval_before["eval/correct"],
                                                                       summary["eval_after"]["eval/correct"])
    params = sharding.gather_to_host(self.state["params"]) if c.checkpoint.export_hf or self.base else None
    if self.base is not None and self.primary:
      summary["peft_export"] = adapters.export_peft(self.out_dir, self.model_cfg, params, self.base)
    if c.checkpoint.export_hf and self.primary:
      for stale in glob.glob(os.path.join(self.out_dir, ".tmp-hf*")):  # left by an export killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
      cfg, params = adapters.export_params(self.model_cfg, params)  # a LoRA model merged
      cfg = cfg.replace(eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                        bos_token_id=self.tokenizer.bos_token_id)
      summary["hf_export"] = hf.save_hf(cfg, params, os.path.join(self.out_dir, "hf"), tokenizer=self.tokenizer)
      prompts.write_generation_config(summary["hf_export"], self.prompter, c.model.path)
    if self.primary:
      if c.logging.plot:
        summary.update(metrics.plot_run(self.out_dir, c.train.steps, self.eval_before, summary.get("eval_after")))
      metrics.write_json(os.path.join(self.out_dir, "summary.json"), summary)
    self.checkpointer.close()
    return summary
