"""The memory manager as the lab sees it: what a study may ask of a manager beyond setup, allocate and its state.
A study gives its options to the manager's constructor as a `StudyProbe` (keep calibration's measurements, score
with a forward's per-token errors, or plan from given errors: a perfect predictor) and reads what the manager
measured or scores through the functions below. experiments/ reaches the manager's insides only through these,
never its private attributes (tests/test_layout.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from hilore_jax.memory import calibrate, predictors

if TYPE_CHECKING:
  from hilore_jax.memory.manager import MemoryManager


@dataclasses.dataclass
class StudyProbe:
  """A study's options for one manager (`MemoryManager(mc, hooks, probe=StudyProbe(...))`), and what it hands back."""

  # calibrations keep their measurements (they hold exact gradients: memory), in `measured`, to refit a predictor
  keep_measurements: bool = False
  # calibrate and score with the per-token errors of a forward pass that allocate is given (cotangent_forward; the
  # trainer does not pass them), so calibration fits the predictor to the score it will run
  forward_errors: bool = False
  # the run-time unit scores are `errors_U`, set by `give_errors` before each allocate: a perfect predictor (scores
  # asked with other inputs, as calibration does, are the usual ones)
  oracle: bool = False
  errors_U: np.ndarray | None = None
  measured: calibrate.Measured | None = None  # the last calibration's measurements (keep_measurements), else None


def measurements(mm: MemoryManager) -> calibrate.Measured | None:
  """The last calibration's measurements (None unless the manager's probe keeps them)."""
  return mm.probe.measured


def scores(mm: MemoryManager, batches: list, inputs: predictors.ScoreInputs, sw, logp, token_err) -> np.ndarray:
  """[M, U] raw scores of predictor sw of the minibatches, at the normalisation the manager runs with."""
  return mm.scorer(batches, inputs, sw, mm.normalisation, logp, token_err)


def l1(mm: MemoryManager, batches: list, sw, logp) -> np.ndarray:
  """The manager's scorer's gradient-scale statistic of the minibatches (predictors.Scorer.l1)."""
  return mm.scorer.l1(batches, sw, logp)


def give_errors(mm: MemoryManager, errors_U: np.ndarray):
  """The per-unit errors an oracle manager's next allocations score their minibatches with."""
  if not mm.probe.oracle:
    raise TypeError("give_errors needs a manager given StudyProbe(oracle=True)")
  mm.probe.errors_U = errors_U
