"""The loop's side jobs as hooks (levanter's `add_hook(fn, every=n)`): each is registered with how often it runs and
returns its typed part of what the run records.

After step s (1-based) a hook runs where `every` divides s; a hook `at_end` runs once more after the loop (given the
final step). A hook's record (a dict, or None) goes where its caller puts it: a step hook's into the next step's
metrics row (the memory manager's seconds after a step), an end hook's into the run's summary. The standard side
jobs: the memory manager's work after a step, sample completions, checkpoints (loop/run_checkpoint.py), and at the
end the evaluation, the exports (PEFT, merged HF) and the plots.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
from typing import TYPE_CHECKING, Callable

import jax

from hilore_jax import runtime, sharding
from hilore_jax.loop import adapters, evaluation, metrics
from hilore_jax.model import hf
from hilore_jax.rl import rollout
from hilore_jax.tasks import prompts

if TYPE_CHECKING:
  from hilore_jax.loop.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """What a hook is given: the steps done, whether the run's steps are all done, the last step's metrics row (None
  where the loop ran no step), and the records of the hooks that ran before it this time."""

  step: int
  last: bool
  row: dict | None = None
  records: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Hook:
  """A side job: fn(info) -> its record or None, run after every `every`-th step (0: never mid-run) and, with
  at_end, once after the loop."""

  fn: Callable[[StepInfo], dict | None]
  every: int = 0
  at_end: bool = False


class Hooks:
  """The run's hooks in the order they were added (the order they run in)."""

  def __init__(self):
    self.hooks: list[Hook] = []

  def add(self, fn: Callable[[StepInfo], dict | None], every: int = 0, at_end: bool = False):
    if every < 0:
      raise ValueError(f"a hook's every must be >= 0, got {every}")
    self.hooks.append(Hook(fn, every, at_end))

  def after_step(self, info: StepInfo) -> dict:
    """Run the hooks due after info.step; their records, merged."""
    return self._run([h for h in self.hooks if h.every and info.step % h.every == 0], info)

  def at_end(self, info: StepInfo) -> dict:
    """Run the end hooks once the loop is done; their records, merged."""
    return self._run([h for h in self.hooks if h.at_end], info)

  @staticmethod
  def _run(hooks: list[Hook], info: StepInfo) -> dict:
    out = {}
    for h in hooks:
      out.update(h.fn(dataclasses.replace(info, records=dict(out))) or {})
    return out


# ----------------------------------------------------------------------------- the standard side jobs


def standard(t: Trainer, writer: metrics.MetricsWriter) -> Hooks:
  """A trainer's side jobs, in the order they run: after a step the memory manager's work (before a checkpoint,
  which saves the manager's state), samples and checkpoints; at the end the last checkpoint, the evaluation, the
  exports and the plots (which mark the evaluation after)."""
  c, h = t.config, Hooks()
  if t.memory is not None:
    h.add(memory_after_step(t), every=1)
  h.add(samples(t, writer), every=c.logging.samples_every)
  h.add(t.checkpoints.hook, every=c.checkpoint.every, at_end=True)
  if c.eval.at_end:
    h.add(evaluate_after(t), at_end=True)
  h.add(export(t), at_end=True)
  if c.logging.plot and t.primary:
    h.add(plots(t), at_end=True)
  return h


def memory_after_step(t: Trainer) -> Callable[[StepInfo], dict]:
  """The memory manager's work after a step, off its clock (set-up after a warm-up step, drift checks and
  recalibration, buckets the step deferred): its seconds (time/memory_setup_s, time/recalibrate_s), for the next
  row."""

  def run(info: StepInfo) -> dict:
    work, t.memory_work = t.memory_work, None
    if work is None:
      return {}
    out = t.memory.finish_step(t.state.params, work.batches, info.step - 1, work.logp, t.state.opt_state,
                               last=info.last)
    if out:
      runtime.release_host_memory()  # calibration's gradients and probe programs' temporaries, freed
    return out

  return run


def samples(t: Trainer, writer: metrics.MetricsWriter) -> Callable[[StepInfo], None]:
  """The last rollout's first prompt's group of decoded completions, appended to samples.jsonl."""
  return lambda info: writer.write_samples(info.step, rollout.sample_rows(t.prompter, t.last_rollout,
                                                                          range(t.config.rollout.num_generations)))


def evaluate_after(t: Trainer) -> Callable[[StepInfo], dict]:
  """The greedy evaluation after training and its gain over the one before (a paired interval where both have the
  per-example results)."""

  def run(info: StepInfo) -> dict:
    out = {"eval_after": t.evaluate(t.state.params, jax.random.PRNGKey(t.config.seed + 1))}
    if t.eval_before:
      out["accuracy_gain_pp"] = 100 * (out["eval_after"]["eval/accuracy"] - t.eval_before["eval/accuracy"])
      if "eval/correct" in t.eval_before:  # a run resumed from an older checkpoint may lack it
        out["accuracy_gain_ci95_pp"] = evaluation.paired_gain_ci(t.eval_before["eval/correct"],
                                                                 out["eval_after"]["eval/correct"])
    return out

  return run


def export(t: Trainer) -> Callable[[StepInfo], dict]:
  """The policy written out by the first process: a LoRA run's adapters as a PEFT directory, and with
  checkpoint.export_hf the merged model as an HF directory with its generation config. Every process gathers."""

  def run(info: StepInfo) -> dict:
    c, out = t.config, {}
    if not (c.checkpoint.export_hf or t.base):
      return out
    params = sharding.gather_to_host(t.state.params)  # a collective: every process takes part
    if t.base is not None and t.primary:
      out["peft_export"] = adapters.export_peft(t.out_dir, t.model_cfg, params, t.base)
    if c.checkpoint.export_hf and t.primary:
      for stale in glob.glob(os.path.join(t.out_dir, ".tmp-hf*")):  # left by an export killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
      cfg, params = adapters.export_params(t.model_cfg, params)  # a LoRA model merged
      tok = t.tokenizer
      cfg = cfg.replace(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
      out["hf_export"] = hf.save_hf(cfg, params, os.path.join(t.out_dir, "hf"), tokenizer=tok)
      prompts.write_generation_config(out["hf_export"], t.prompter, c.model.path)
    return out

  return run


def plots(t: Trainer) -> Callable[[StepInfo], dict]:
  """reward.png and lengths.png from metrics.jsonl, with the evaluations before and after (an earlier end hook's)."""
  return lambda info: metrics.plot_run(t.out_dir, t.config.train.steps, t.eval_before, info.records.get("eval_after"))
