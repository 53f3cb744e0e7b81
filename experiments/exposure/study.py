"""The exposure studies' shared first phases: collect real rollout minibatches of a policy (several rollouts of
grpo.num_iterations passes; later passes are off-policy and clip), each with the params (and optimizer state) its
update saw, kept on disk; split them into calibration (the first minibatches) and held out (every later rollout);
calibrate on the first, each at its own params; measure every held-out minibatch's unit errors (one gradient each)
and its forward's per-token errors. experiments/exposure/run.py (the bench) and exposure_e1b.py (E1b) run on."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.exposure import spill
from experiments.common.config import ExposureBenchConfig
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.loop import step_hooks
from hilore_jax.memory import MemoryManager, calibration, probe
from hilore_jax.memory.config import GateConfig
from hilore_jax.rl import train_step

ALWAYS = GateConfig(mode="always")  # the exposure arms run buckets whatever the gate measured (it is reported)


@dataclasses.dataclass
class Record:
  """One minibatch as an update saw it: the policy's params (and optimizer state) then, the batch (host arrays),
  on a later pass the log-probs at those params (`logp`, else None: the batch's old ones), what describes it."""

  step: int
  pass_: int
  index: int
  kept_params: Any  # the params, or spill.Spilled: read back on each access of .params
  batch: Any
  describe: dict
  logp: np.ndarray | None = None
  kept_opt: Any = None
  params = property(lambda self: spill.load(self.kept_params))
  opt_state = property(lambda self: spill.load(self.kept_opt))


def without_gradients(refs: list, units) -> list:
  """The references, each without its exact gradient where every error it serves is read off its weight-read unit
  errors (calibration.set_error_of): 0.5 GB each for SmolLM2, and a bench holds dozens."""
  return [dataclasses.replace(r, grad=None)
          if r.weight_errors is not None and calibration.additive(units, r.available()) else r for r in refs]


def collect(trainer, steps: int, progress=print, opt_state: bool = True, spill_dir: str | None = None) -> list[Record]:
  """Warm-start (if set), then `steps` rollouts, each trained for grpo.num_iterations passes under the run's own
  step, recording every minibatch with the params (and optimizer state) its update saw: on disk under spill_dir."""
  c = trainer.config
  if c.train.warmstart_steps:
    trainer.warmstart()
    progress(f"warm-start loss {trainer.warmstart_losses[0]:.3f} -> {trainer.warmstart_losses[-1]:.3f}")
  if c.grpo.beta > 0:
    trainer.ref_params = jax.tree_util.tree_map(jnp.copy, trainer.state["params"])
  records = []
  for step in range(steps):
    roll = trainer.next_rollout()
    plan = trainer.plan_update(roll, np.random.default_rng([c.seed, step]), step)
    if not len(plan):  # every group's rewards equal and filtered out: nothing to update
      progress(f"rollout {step + 1}/{steps}: no update rows (every group zero-std and grpo.filter_zero_std)")
      continue
    plan = trainer.add_logprobs(plan)
    for it in range(c.grpo.num_iterations):
      for j, b in enumerate(plan.pass_batches(it, trainer.spec.use_old_logp)):
        where = None if spill_dir is None else os.path.join(spill_dir, f"{len(records)}")  # the step donates the state
        params = spill.keep(trainer.state["params"], where and where + "p")
        opt = spill.keep(trainer.state["opt_state"], where and where + "o") if opt_state else None
        trainer.state, m = trainer.stepper(trainer.spec, trainer.state, b)
        # its own log-probs (a forward at `params`), not the previous pass's (before its own update there)
        logp, rec = m.pop(train_step.TOKEN_LOGP), jax.device_get(b)
        mask = rec.mask
        records.append(Record(step, it, j, params, rec, {
            "zero_adv_share": float(np.mean(rec.adv == 0)), "clipfrac": float(m["clipfrac"]),
            "completion_len_mean": float(mask.sum(1).mean()), "completion_len_max": int(mask.sum(1).max()),
            "reward_mean": float(roll.rewards.mean())}, np.asarray(logp) if it > 0 else None, opt))
    progress(f"rollout {step + 1}/{steps}: reward {float(roll.rewards.mean()):.3f}, completion length "
             f"{float(roll.mask.sum(1).mean()):.1f} (max {int(roll.mask.sum(1).max())} of {roll.mask.shape[1]})")
  return records


def split(records: list[Record], calib: int) -> tuple[list[Record], list[Record]]:
  """(calibration, held out): the first `calib` minibatches, and every minibatch of a strictly later rollout (so
  no held-out minibatch shares a rollout, let alone a batch, with calibration)."""
  if calib >= len(records):
    raise ConfigError(f"bench_exposure.calib_minibatches ({calib}) leaves no held-out minibatch of {len(records)}")
  cal = records[:calib]
  last = max(r.step for r in cal)
  held = [r for r in records if r.step > last]
  if not held:
    raise ConfigError("no rollout after the calibration minibatches: raise bench_exposure.rollout_steps")
  return cal, held


def calibrate_on(manager: MemoryManager, cal: list[Record]):
  """Calibrate on the records, each measured at the params and optimizer state its own update saw."""
  contexts = [spill.KeptContext(r, r.logp) for r in cal]
  manager.setup(cal[0].params, [r.batch for r in cal], 0, contexts=contexts)


def measure_held_out(hooks, mc, held: list[Record], units, progress=print):
  """(records with a gradient, their references, {metric: [M, U] each unit's error alone}): every metric the
  records allow, units at memory.calib_layers' layers measured and the rest interpolated over depth."""
  layers = calibration.probed_layers(hooks.model_cfg.num_hidden_layers, mc.calib_layers)
  kept, refs, errs = [], [], []
  instrumented = mc.calib_decompose and calibration.additive(units, (mc.risk_metric,))  # one backward each
  for i, r in enumerate(held):
    # with an optimizer state every metric includes the update's, which needs probes: they compare against the
    # probe program's own gradient, never the instrumented one's
    ref = calibration.reference(hooks, calibration.UpdateContext(r.params, r.opt_state), r.batch, mc.risk_metric,
                                mc.lowp_format, mc.group_size,
                                instrumented and (r.opt_state is None or hooks.optimizer_update is None))
    if ref.grad_norm == 0:  # no gradient (every advantage zero, no KL yet): no error to measure
      continue
    kept.append(r)
    errs.append(calibration.measure_unit_errors(hooks, r.params, r.batch, units, mc.group_size, mc.lowp_format,
                                                ref, layers, ref.available(), mc.calib_decompose))
    refs += without_gradients([ref], units)  # every later error is read off the unit errors
    if (i + 1) % 5 == 0:
      progress(f"measured {i + 1}/{len(held)} held-out minibatches")
  err = np.stack(errs)  # [M, U, metrics]
  return kept, refs, {m: err[:, :, k] for k, m in enumerate(refs[0].available())}, layers


@dataclasses.dataclass
class Study:
  """What the phases after collection share: the records split into calibration and held out, the step's hooks and
  units, and the calibration every arm starts from (its measurements kept for refits)."""

  cfg: Config  # memory.calib_batches set to the calibration's minibatch count
  be: ExposureBenchConfig
  out_dir: str
  trainer: Any
  spec: Any  # the step's spec, reading each record's own log-probs (use_old_logp)
  hooks: Any
  records: list[Record]
  cal: list[Record]
  held: list[Record]  # the held-out minibatches (bench_exposure.held_out of them), before zero-gradient ones drop
  units: list
  calib_mm: MemoryManager  # calibrated on `cal` with memory.exposure's predictor and forward errors
  measured: Any  # its calibration.Measured, exact gradients dropped
  spill_dir: str
  t_start: float


@dataclasses.dataclass
class HeldOut:
  """The held-out pass: records with a gradient, their references, each unit's error alone per metric, the layers
  measured (None: all), and each record's forward per-token errors (the old-log-prob forward's)."""

  records: list[Record]
  refs: list
  err_by: dict[str, np.ndarray]
  layers: Any
  token_err: list
  skipped: int  # held-out minibatches without a gradient


def prepare(cfg: Config, be: ExposureBenchConfig, out_dir: str, progress=print, keep_state: bool = True) -> Study:
  """Check the settings, collect the rollouts (params spilled under out_dir/records), split them, and calibrate on
  the calibration minibatches, each at its own params. keep_state=False drops the trainer's params, optimizer state
  and reference params once collected (2.2 GB for SmolLM2; every record keeps its own params on disk)."""
  from hilore_jax.loop.trainer import Trainer

  if cfg.grpo.num_iterations < 2:
    raise ConfigError("bench_exposure needs grpo.num_iterations >= 2 (off-policy passes, where ratios clip)")
  if cfg.memory.risk_metric == "update" and not be.update_error:
    raise ConfigError("memory.risk_metric=update needs bench_exposure.update_error=true (optimizer states)")
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  trainer = Trainer(dataclasses.replace(cfg, out_dir=os.path.join(out_dir, "collect"),
                                        memory=dataclasses.replace(cfg.memory, policy="none")))
  spill_dir = os.path.join(out_dir, "records")  # removed at the end: a real model's params are GBs per rollout
  records = collect(trainer, be.rollout_steps, progress, be.update_error, spill_dir)
  if not keep_state:
    trainer.state, trainer.ref_params = None, None
  cal, held = split(records, be.calib_minibatches)
  cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, calib_batches=len(cal)))  # all of them
  spec = dataclasses.replace(trainer.spec, use_old_logp=True)
  hooks = step_hooks.memory_hooks(trainer.stepper, spec, cfg.optimizer.max_grad_norm)
  units = calibration.lowp_units(trainer.model_cfg.num_hidden_layers, cfg.memory.lowp_kinds)
  calib_mm, measured = calibrated(cfg.memory, hooks, cal, units)
  progress(f"calibrated on {len(cal)} minibatches ({cfg.memory.risk_metric} error), each at its own params")
  return Study(cfg, be, out_dir, trainer, spec, hooks, records, cal, held[:be.held_out or None], units, calib_mm,
               measured, spill_dir, t_start)


def calibrated(mc, hooks, cal: list[Record], units) -> tuple[MemoryManager, Any]:
  """(hilore calibrated on the records, exposure forced on, with forward errors; its measurements, exact gradients
  dropped): what every arm of a study starts from."""
  # the bench gives cotangent_forward the forward's errors (token_err below), and refits predictors on one measurement
  calib_mm = MemoryManager(dataclasses.replace(mc.at_budget(None, "hilore"), gate=ALWAYS), hooks,
                           probe=probe.StudyProbe(keep_measurements=True, forward_errors=True))
  calibrate_on(calib_mm, cal)
  measured = probe.measurements(calib_mm)
  measured.refs = without_gradients(measured.refs, units)  # kept for the predictors' fits, which read only norms
  if not any(r.grad_norm > 0 for r in measured.refs):
    raise ConfigError("no calibration minibatch has a gradient (rewards all equal, no KL yet): choose a task or "
                      "temperature with mixed rewards, or raise bench_exposure.calib_minibatches")
  return calib_mm, measured


def held_out(s: Study, progress=print) -> HeldOut:
  """Measure every held-out minibatch (one gradient each) and its forward's per-token errors."""
  mc = s.cfg.memory
  kept, refs, err_by, layers = measure_held_out(s.hooks, mc, s.held, s.units, progress)
  # per-token errors of the forward the step runs anyway: the old-log-prob forward at the rollout's first params
  start = {r.step: r for r in s.records if r.pass_ == 0 and r.index == 0}
  fwd = jax.jit(lambda p, b: calibration.token_errors(s.hooks, p, b, s.units, mc.group_size, mc.lowp_format))
  seen: dict = {}  # a row set's two passes are one batch at one rollout's params: one forward for both
  key = lambda r: (r.step, np.asarray(r.batch.tokens).tobytes(), np.asarray(r.batch.prompt_ids).tobytes())
  token_err = [seen[key(r)] if key(r) in seen else seen.setdefault(key(r), fwd(start[r.step].params, r.batch))
               for r in kept]
  return HeldOut(kept, refs, err_by, layers, token_err, len(s.held) - len(kept))


