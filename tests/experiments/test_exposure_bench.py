"""The exposure bench's own parts (experiments/exposure/): its split of records, its calibration on each record's
update, collect's log-probs at each pass's params, the report's arm comparison and unit error level, and the sweep's
crossing of the violation target."""

import jax
import numpy as np
import pytest

from experiments.exposure import run as bench_exposure
from experiments.exposure import sweep as exposure_sweep


def test_split_holds_out_whole_later_rollouts():
  rec = lambda step, it, j: bench_exposure.Record(step, it, j, None, {}, {})
  records = [rec(s, it, j) for s in range(3) for it in range(2) for j in range(2)]
  cal, held = bench_exposure.split(records, 2)  # rollout 0's first pass calibrates; its second pass is dropped
  assert [(r.step, r.pass_, r.index) for r in cal] == [(0, 0, 0), (0, 0, 1)]
  assert {r.step for r in held} == {1, 2} and len(held) == 8
  cal, held = bench_exposure.split(records, 5)  # reaches into rollout 1: held out starts at rollout 2
  assert {r.step for r in held} == {2}
  with pytest.raises(Exception, match="no rollout after"):
    bench_exposure.split(records, 9)
  with pytest.raises(Exception, match="leaves no held-out"):
    bench_exposure.split(records, 12)


def test_arm_comparison_and_where_it_varies_by_hand():
  from experiments.exposure import report as rep

  arm = lambda t, flops_pct, gain: {"round_times_s": [t, t], "recompute_removed_pct": flops_pct,
                                    "gain_vs_gc_pct": gain}
  arms = {"optimal_hr": arm(1.0, 10.0, 0.0), "hilore_static": arm(2.0, 20.0, 1.0),
          "hilore_exposure_off": arm(2.0, 21.0, 1.0), "hilore_exposure_on": arm(1.6, 23.0, 2.0),
          "oracle": arm(1.0, 26.0, 5.0)}
  pairs, closed = rep.compare_arms(arms)
  on_static = pairs["hilore_exposure_on vs hilore_static"]
  assert on_static["gain_pct"] == pytest.approx(25.0)  # 2.0 / 1.6 - 1
  assert on_static["recompute_removed_points"] == pytest.approx(3.0)
  assert closed["recompute_removed_pct"] == pytest.approx(0.5) and closed["gain_vs_gc_pct"] == pytest.approx(0.25)
  arms["oracle"]["recompute_removed_pct"] = 15.0  # the oracle gains nothing over static: nothing to close
  assert np.isnan(rep.compare_arms(arms)[1]["recompute_removed_pct"])

  err_MU = np.array([[1.0, 4.0], [2.0, 2.0], [3.0, 0.0]])  # unit means 2 and 2; minibatch means 2.5, 2, 1.5
  v = rep.where_it_varies([{"clip": 0.3, "len": 5}, {"clip": 0.2, "len": 5}, {"clip": 0.1, "len": 5}], [0, 1, 1],
                          err_MU)
  assert v["clip"]["spearman_vs_unit_error"] == pytest.approx(1.0) and v["clip"]["min"] == pytest.approx(0.1)
  assert v["len"]["spearman_vs_unit_error"] is None  # constant: no rank correlation
  assert v["pass"]["second_pass_share"] == pytest.approx(2 / 3)
  assert v["unit_error_spread_p10_p90"] == pytest.approx([np.quantile([0.5, 2, 1, 1, 1.5, 0], q) for q in (0.1, 0.9)])


def test_unit_error_level_weighs_every_kind_alike():
  """Defect 5: the minibatch's mean unit error followed the kind with the largest errors (attn_probs); each unit is
  now taken relative to its own mean, a kind's units by their median, and kinds averaged."""
  from experiments.exposure import report as rep

  # kind "big" (errors ~1000x) falls over the three minibatches while both "small" units rise
  err = np.array([[1.0, 2.0, 3000.0], [2.0, 4.0, 2000.0], [3.0, 6.0, 1000.0]])
  kinds = ["small", "small", "big"]
  # relative to unit means (2, 4, 2000): small [.5, 1, 1.5] (both), big [1.5, 1, .5]; kind mean: [1, 1, 1]
  np.testing.assert_allclose(rep.unit_error_level(err, kinds), [1.0, 1.0, 1.0])
  err[:, 1] = [4.0, 4.0, 4.0]  # one small unit flat: the kind's median is (.5+1)/2, 1, (1.5+1)/2
  np.testing.assert_allclose(rep.unit_error_level(err, kinds), [(0.75 + 1.5) / 2, 1.0, (1.25 + 0.5) / 2])
  v = rep.where_it_varies([{"clip": 0.1}, {"clip": 0.2}, {"clip": 0.3}], [0, 0, 1], err, kinds)
  assert v["clip"]["spearman_vs_unit_error"] == pytest.approx(-1.0)  # a plain mean (3001.5, 2006, 1011) agrees
  # the big kind falls by 1% while the small ones rise by half: a plain mean over units (1015, 1011, 1007) / 3 falls
  err[:, 2] = [1010.0, 1005.0, 1000.0]
  v = rep.where_it_varies([{"clip": 0.1}, {"clip": 0.2}, {"clip": 0.3}], [0, 0, 1], err, kinds)
  assert v["clip"]["spearman_vs_unit_error"] == pytest.approx(1.0)


def test_the_bench_calibrates_each_record_at_its_own_update():
  """Defect 1, the bench's side: calibration receives every record's own params, optimizer state and log-probs."""
  seen = {}

  class Manager:
    def setup(self, params, batches, step, **kw):
      seen.update(kw, batches=batches)

  recs = [bench_exposure.Record(0, 0, j, f"params{j}", f"batch{j}", {}, f"logp{j}", f"opt{j}") for j in range(3)]
  bench_exposure.calibrate_on(Manager(), recs)
  assert [(c.params, c.opt_state, c.logp) for c in seen["contexts"]] == [
      (f"params{j}", f"opt{j}", f"logp{j}") for j in range(3)]
  assert seen["batches"] == ["batch0", "batch1", "batch2"]


def test_at_violation_by_hand():
  pt = lambda d, v, r: {"delta": d, "violation_rate": v, "recompute_removed_pct": r, "predicted_removed_pct": 2 * r}
  pts = [pt(0.0, 0.0, 10.0), pt(1.0, 0.02, 20.0), pt(2.0, 0.10, 30.0), pt(4.0, 0.5, 40.0)]
  e = exposure_sweep.at_violation(pts, 0.05)  # 3/8 of the way from 0.02 to 0.10
  assert e["interpolated"] and e["delta"] == pytest.approx(1.375) and e["violation_rate"] == 0.05
  assert e["recompute_removed_pct"] == pytest.approx(23.75) and e["predicted_removed_pct"] == pytest.approx(47.5)
  # never crosses: undefined, not the last point's figure (issue 47: E1 read every arm at its memory-bound end)
  e = exposure_sweep.at_violation(pts[:2], 0.05)
  assert not e["interpolated"] and np.isnan(e["recompute_removed_pct"]) and np.isnan(e["delta"])
  e = exposure_sweep.at_violation([pt(1.0, 0.2, 5.0)], 0.05)  # over it from the start: no crossing seen either
  assert not e["interpolated"] and np.isnan(e["recompute_removed_pct"])


def test_a_later_pass_is_scored_with_the_log_probs_at_its_own_params(tmp_path):
  """Defect (a): a pass-1 record carried the log-probs of its pass-0 step, taken before that minibatch's own update
  (the first minibatch's ratio exactly 1, nothing clipped); it now carries those at the params its update runs at."""
  from hilore_jax.loop.trainer import Trainer
  from tests.trainer_util import tiny_config

  t = Trainer(tiny_config(tmp_path, "train.minibatch_size=6", "grpo.filter_zero_std=false", "train.warmstart_steps=0",
                          "optimizer.lr=0.05", "grpo.num_iterations=2", "grpo.beta=0"))
  t.task.reward = lambda text, ref: float(ord(text[0]) % 2) if text else 0.0  # varied rewards from a random policy
  records = bench_exposure.collect(t, 1, progress=lambda *a: None, opt_state=False)
  assert [(r.pass_, r.index) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert records[0].logp is None and records[1].logp is None  # pass 0 reads the batch's old log-probs
  for r in records[2:]:
    fresh = np.asarray(t.stepper.logprobs(t.spec, r.params, jax.device_put(r.batch)))  # an independent forward
    mask = r.batch.mask > 0
    np.testing.assert_allclose(r.logp[mask], fresh[mask], atol=1e-5)
  # the old value, the log-probs before minibatch 0's own pass-0 update, are the rollout's: ratio 1
  stale = np.asarray(t.stepper.logprobs(t.spec, records[0].params, jax.device_put(records[2].batch)))
  assert np.abs(stale - records[2].logp)[records[2].batch.mask > 0].max() > 1e-3
