"""The memory manager as the lab sees it: what a study may ask of a manager beyond setup, allocate and its state
(measure, score with another predictor, force the scores a plan is made from). experiments/ reaches the manager's
insides only through these functions, never its private attributes (tests/test_layout.py)."""

from __future__ import annotations

import numpy as np

from hilore_jax.memory import calibrate, predictors
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.manager import MemoryManager


def keep_measurements(mm: MemoryManager):
  """The manager's next calibrations keep their measurements (exact gradients: memory) for `measurements`."""
  mm._keep_measured = True


def use_forward_errors(mm: MemoryManager):
  """Calibrate and score with the per-token errors of a forward pass that allocate is given (cotangent_forward)."""
  mm._forward_errors = True


def measurements(mm: MemoryManager) -> calibrate.Measured | None:
  """The last calibration's measurements (None unless `keep_measurements` came before it)."""
  return mm._measured


def scores(mm: MemoryManager, batches: list, inputs: predictors.ScoreInputs, sw, logp, token_err) -> np.ndarray:
  """[M, U] raw scores of predictor sw of the minibatches, at the normalisation the manager runs with."""
  return mm._scorer(batches, inputs, sw, mm._normalisation, logp, token_err)


def l1(mm: MemoryManager, batches: list, sw, logp) -> np.ndarray:
  """The manager's scorer's gradient-scale statistic of the minibatches (predictors.Scorer.l1)."""
  return mm._scorer.l1(batches, sw, logp)


class _Oracle(MemoryManager):
  """hilore whose run-time unit scores are the errors given by `give_errors` (inputs given: the usual scores)."""

  _errors: np.ndarray | None = None

  def unit_scores(self, minibatches, logp=None, token_err=None, inputs=None):
    if inputs is not None:
      return super().unit_scores(minibatches, logp, token_err, inputs)
    return np.atleast_2d(self._errors)


def oracle(mc: MemoryConfig, hooks: StepHooks) -> MemoryManager:
  """A manager that plans from given per-unit errors (`give_errors` before allocate): a perfect predictor."""
  return _Oracle(mc, hooks)


def give_errors(mm: MemoryManager, errors_U: np.ndarray):
  """The per-unit errors an `oracle` manager's next allocations score their minibatches with."""
  if not isinstance(mm, _Oracle):
    raise TypeError("give_errors needs a manager made by probe.oracle")
  mm._errors = errors_U
