"""hilore's static calibrated risk and the exposure gate (memory/gate.py): the gate's decision as a pure function of
calibration's arrays, both ways, and through the manager."""

import dataclasses

import jax
import numpy as np
import manager_util
import pytest

from hilore_jax import config
from hilore_jax.errors import ConfigError
from hilore_jax.memory import MemoryManager, gate, manager, probe, warmup
from hilore_jax.memory.config import GateConfig, MemoryConfig

U = 13  # units in the hand-made arrays: odd, so medians are single units
K = 5


def _regime(sigma: float, rng, noise: float = 0.05):
  """[K, U] measured errors with within-unit log-spread sigma around fixed per-unit levels, and a predictor's raw
  scores that track them (a per-unit factor, small noise)."""
  level_U = np.exp(rng.normal(0, 2, U))
  err = level_U * np.exp(rng.normal(0, sigma, (K, U)))
  raw = err / rng.uniform(0.5, 2.0, U) * np.exp(rng.normal(0, noise, (K, U)))
  return err, raw


def test_gate_inputs_by_hand():
  err = np.array([[1, 2, 0], [2, 4, 0], [3, 6, 0], [4, 8, 0], [5, 10, 0]], float)  # the third unit: never any error
  # p90 4.6, p10 1.4 per unit (x2 for the second): 3.29x; the error-free unit does not count
  assert gate.within_unit_spread(err) == pytest.approx(4.6 / 1.4)
  np.testing.assert_allclose(gate.unit_quantile(err, 0.9), [4.6, 9.2, 0.0])
  assert gate.within_unit_spread([[0.0, 1.0], [0.0, 1.0], [2.0, 1.0]]) == np.inf  # p10 0 under p90 > 0: unbounded
  assert gate.unclipped_share([0.5, 2.0, 0.9, 3.0], 1.0) == 0.5
  assert gate.unclipped_share([14.0, 15.0], 0.0) == 1.0  # no clip divides anything away
  raw = err[:, :2] * [3.0, 0.5]  # a per-unit factor never changes a within-unit ranking
  assert gate.loo_within_unit_rho(raw, err[:, :2]) == pytest.approx(1.0)
  assert gate.loo_within_unit_rho(raw[::-1], err[:, :2]) == pytest.approx(-1.0)
  assert np.isnan(gate.loo_within_unit_rho(raw[:2], err[:2, :2]))  # 2 minibatches rank nothing


def test_large_within_unit_spread_switches_the_gate_on():
  err, raw = _regime(sigma=1.0, rng=np.random.default_rng(0))
  rec = gate.evaluate(err, raw, grad_norms=[0.4, 0.7, 1.3, 0.2, 0.9], max_grad_norm=1.0, gc=GateConfig())
  assert rec["spread"] >= 2.0 and rec["unclipped_share"] == 0.8 and rec["loo_rho"] >= 0.4
  assert rec["passed"] == {"spread": True, "unclipped": True, "loo_rho": True} and rec["on"] and rec["measured_on"]
  assert gate.gate_metrics(rec)["memory/gate/on"] == 1.0
  assert not gate.evaluate(err, raw, [0.4] * K, 1.0, GateConfig(), buckets=1)["on"]  # one bucket: nothing to switch


def test_smollm2_like_regime_leaves_the_gate_off():
  # SmolLM2 arithmetic: errors steady within a unit (p90/p10 ~1.3x), ||g|| ~14 against a clip of 1, and a predictor
  # that does not rank them (its scores independent of the errors)
  rng = np.random.default_rng(1)
  err, _ = _regime(sigma=0.1, rng=rng)
  raw = np.exp(rng.normal(0, 0.1, (K, U)))
  rec = gate.evaluate(err, raw, grad_norms=rng.normal(14, 1, K), max_grad_norm=1.0, gc=GateConfig())
  assert rec["spread"] < 1.5 and rec["unclipped_share"] == 0.0
  assert rec["passed"]["spread"] is False and rec["passed"]["unclipped"] is False and not rec["on"]
  # each test alone keeps it off, given the other two pass
  big, raw_big = _regime(sigma=1.0, rng=np.random.default_rng(0))
  assert not gate.evaluate(big, raw_big, [14.0] * K, 1.0, GateConfig())["on"]  # always clipped
  assert not gate.evaluate(big, raw_big[::-1], [0.5] * K, 1.0, GateConfig())["on"]  # the predictor ranks wrongly
  assert not gate.evaluate(err, err, [0.5] * K, 1.0, GateConfig())["on"]  # a perfect predictor of nothing
  # forced either way, the measured decision still recorded
  forced = gate.evaluate(err, raw, [14.0] * K, 1.0, GateConfig(mode="always"))
  assert forced["on"] and not forced["measured_on"]
  assert not gate.evaluate(big, raw_big, [0.5] * K, 1.0, GateConfig(mode="never"))["on"]


def test_the_gate_never_decides_on_fewer_minibatches_than_it_needs():
  err, raw = _regime(sigma=1.0, rng=np.random.default_rng(0))
  every = GateConfig(spread_min=0.0, unclipped_min=0.0, rho_min=-1.0)  # thresholds any measurement passes
  for k in (1, 2, 3):
    rec = gate.evaluate(err[:k], raw[:k], [0.5] * k, 1.0, every)
    assert rec["undecided"] and not rec["on"] and not rec["measured_on"] and rec["batches"] == k
    assert gate.gate_metrics(rec)["memory/gate/undecided"] == 1.0
  assert gate.describe(gate.evaluate(err[:1], raw[:1], [0.5], 1.0, every)).startswith(
      "gate auto: undecided: 1 minibatch, it needs 4")
  decided = gate.evaluate(err[:4], raw[:4], [0.5] * 4, 1.0, every)
  assert not decided["undecided"] and decided["on"] and "undecided" not in gate.describe(decided)
  assert gate.evaluate(err[:2], raw[:2], [0.5] * 2, 1.0, GateConfig(mode="always"))["on"]  # forced: the arms' way
  assert not gate.evaluate(err[:3], raw[:3], [0.5] * 3, 1.0, dataclasses.replace(every, min_batches=4))["on"]
  assert gate.evaluate(err[:3], raw[:3], [0.5] * 3, 1.0, dataclasses.replace(every, min_batches=3))["on"]


def test_a_risk_budget_that_does_not_bind_keeps_the_gate_off():
  # issue 47: where memory alone binds, every risk score gives the same plan, so the gate stays off however well the
  # predictor ranks; unmeasured (None) it is no test, as before
  err, raw = _regime(sigma=1.0, rng=np.random.default_rng(0))
  norms = [0.4, 0.7, 1.3, 0.2, 0.9]
  assert gate.evaluate(err, raw, norms, 1.0, GateConfig(), risk_binds=True)["on"]
  off = gate.evaluate(err, raw, norms, 1.0, GateConfig(), risk_binds=False)
  assert not off["on"] and not off["measured_on"] and off["passed"]["risk_binds"] is False
  assert off["risk_binds"] is False and off["passed"]["spread"] and off["passed"]["loo_rho"]
  unknown = gate.evaluate(err, raw, norms, 1.0, GateConfig())
  assert unknown["on"] and unknown["risk_binds"] is None and "risk_binds" not in unknown["passed"]


def test_gate_and_calibration_settings_are_validated():
  for bad in ({"mode": "maybe"}, {"unclipped_min": 1.5}, {"rho_min": 2.0}, {"spread_min": -1.0},
              {"min_batches": 2}):
    with pytest.raises(ConfigError, match="memory.gate"):
      GateConfig(**bad)
  for bad, key in (({"calib_quantile": 0.0}, "calib_quantile"), ({"calib_rollouts": 0}, "calib_rollouts"),
                   ({"drift_grad_ratio": 1.0}, "drift_grad_ratio"), ({"drift_check_every": -1}, "drift_check"),
                   ({"min_l_gain": 1.0}, "min_l_gain"), ({"min_l_gain": -0.1}, "min_l_gain")):
    with pytest.raises(ConfigError, match=key):
      MemoryConfig(**bad)
  c = config.from_dict({}, ["memory.gate.rho_min=0.5", "memory.calib_rollouts=3"])
  assert c.memory.gate.rho_min == 0.5 and c.memory.calib_rollouts == 3
  with pytest.raises(ConfigError, match="unknown config key 'memory.gate.rho'"):
    config.from_dict({}, ["memory.gate.rho=0.5"])


def test_collector_takes_minibatches_in_turn_from_each_rollout():
  col = warmup.Collector(count=4, rollouts=2)
  params = {"w": jax.numpy.ones(3)}
  col.add(params, ["a0", "a1", "a2"])
  assert not col.ready()  # one rollout, however many minibatches
  params["w"] = params["w"] * 2  # the collector holds copies
  col.add(params, ["b0", "b1", "b2"], logp=[None, "lp", None])
  assert col.ready()
  batches, contexts = col.take()
  assert batches == ["a0", "b0", "a1", "b1"] and contexts[3].logp == "lp"
  assert float(contexts[0].params["w"][0]) == 1.0 and float(contexts[1].params["w"][0]) == 2.0
  assert col.by_rollout == [] and warmup.Collector(count=1, rollouts=2).rollouts == 1


@pytest.fixture(scope="module")
def tiny():
  hooks, params = manager_util.hooks()
  rng = np.random.default_rng(0)
  adv = [1.5, -0.5, -1.0, 1.0, 0.5, -1.5]
  batches = [manager_util.batch(rng, np.asarray(adv) * s) for s in (1.0, 3.0, 0.3, 1.7)]  # K = 4 of different scales
  # min_l_gain 0: any predicted gain calibrates (these tests are of the gate, not of that decision)
  mc = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, calib_sets=2, budget_probes=2, buckets=3,
                    warmup="none", cache=False, verify_steps=0, drift_check_every=0, min_l_gain=0.0)
  return hooks, params, batches, mc


@pytest.mark.slow  # a calibrated manager over four minibatches (the gate by hand above stays in the quick tier)
@pytest.mark.usefixtures("fixed_op_times")
def test_the_allocator_receives_each_units_p90_over_the_calibration_minibatches(tiny, monkeypatch):
  hooks, params, batches, mc = tiny
  mc = dataclasses.replace(mc, gate=GateConfig(mode="never"))
  seen = []
  plan = manager.methods.plan
  monkeypatch.setattr(manager.methods, "plan", lambda *a, **kw: seen.append(kw.get("risk_of")) or plan(*a, **kw))
  m = MemoryManager(mc, hooks)
  allocs = m.step(params, batches, 0)
  cal = m.state.calibration
  assert cal.calib_batches == 4 and np.shape(cal.unit_errors) == (4, len(m.lowp_ids))
  p90 = np.quantile(np.asarray(cal.unit_errors), 0.9, axis=0)
  assert np.all(p90 > np.mean(cal.unit_errors, axis=0))  # p90, not the mean the static baseline reads
  np.testing.assert_allclose(cal.static_risk, p90)
  assert {a.bucket for a in allocs} == {0} and m.state.buckets == [[]]  # exposure off: one bucket
  expected = dict(zip([tuple(u) for u in m.lowp_ids], cal.coherence * p90))
  seen = [r for r in seen if r]  # the risk-free subset's plans (the budget fit's floor) read no risks
  assert seen and all(r.keys() == expected.keys() for r in seen)
  for r in seen:
    np.testing.assert_allclose([r[k] for k in expected], list(expected.values()), rtol=1e-12)
  # the gate's inputs are measured and logged even where the decision is forced
  assert allocs[0].metrics["memory/gate/on"] == 0.0 and cal.gate["mode"] == "never"
  assert {"memory/gate/spread", "memory/gate/unclipped_share", "memory/gate/loo_rho"} <= set(allocs[0].metrics)


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")
def test_the_manager_runs_exposure_buckets_only_where_the_gate_passes(tiny):
  hooks, params, batches, mc = tiny
  m = MemoryManager(mc, hooks, probe=probe.StudyProbe(keep_measurements=True))
  m.setup(params, batches, 0)
  cal, meas = m.state.calibration, probe.measurements(m)
  # the record is the pure gate of calibration's own arrays (no clip here: every minibatch counts as unclipped)
  raw = np.asarray(m.unit_scores(meas.batches)) / np.asarray(cal.susceptibility)
  live = np.asarray(cal.susceptibility) > 0
  again = gate.evaluate(np.asarray(cal.unit_errors)[:, live], raw[:, live], cal.grad_norms, 0.0, mc.gate, 3)
  assert cal.gate["unclipped_share"] == 1.0 and cal.gate["spread"] == pytest.approx(again["spread"])
  assert m.exposure_on == cal.gate["on"]
  # thresholds every calibration meets: buckets by exposure; one no calibration meets: the static bucket only
  for gc, on in ((GateConfig(spread_min=0.0, unclipped_min=0.0, rho_min=-1.0), True),
                 (GateConfig(spread_min=1e9), False)):
    other = MemoryManager(dataclasses.replace(mc, gate=gc), hooks)
    other.setup(params, batches, 0, calibration_state=other.fit_calibration(meas))
    assert other.state.calibration.gate["on"] is on and other.exposure_on is on
    allocs = other.allocate(batches[:2])
    assert all(bool(other.state.buckets[a.bucket]) is on for a in allocs)  # a level vector, or the static bucket


def test_the_measured_smollm2_recipe_leaves_the_gate_off():
  # E1's measured gate inputs (docs/data/exposure_e1.json, SmolLM2 arithmetic at 256 tokens) under the default
  # thresholds: the recipe runs static calibrated risk
  import json
  import pathlib

  rec = json.loads((pathlib.Path(__file__).parents[2] / "docs/data/exposure_e1.json").read_text())["gate_decision"]
  again = gate.decide(rec["spread"], rec["unclipped_share"], rec["loo_rho"], GateConfig())
  assert not again["on"] and again["on"] == rec["on"]
