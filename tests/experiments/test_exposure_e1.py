"""Issue 36's E1 summary (experiments/exposure/e1.py) on tiny synthetic arrays: values by hand, CIs over row sets."""

import json

import numpy as np
import pytest

from experiments.exposure import e1 as exposure_e1, report as exposure_report
from experiments.common.config import E1Criteria

R, S, U = 3, 2, 7  # rollouts, row sets per rollout, units; each row set seen by 2 passes: M = 12 minibatches


def _arrays(spread: float, seed: int = 0):
  rng = np.random.default_rng(seed)
  rollouts = np.repeat(np.arange(R), 2 * S)
  clusters = [f"{r}:{j}" for r in range(R) for _ in range(2) for j in range(S)]
  level = np.exp(rng.normal(0, 1, U))
  err = level * np.exp(rng.normal(0, spread, (len(rollouts), U)))
  return err, rollouts, clusters


def _sweep(removed: float, err_scale: float, M: int):
  """An arm's sweep: at delta d, every minibatch removes removed * d points with error d * err_scale (tol 1)."""
  return [{"delta": d, "per_minibatch": {"err": [d * err_scale] * M, "removed_pct": [removed * d] * M}}
          for d in (0.0, 0.5, 1.0, 2.0)]


def test_cluster_bootstrap_resamples_whole_row_sets():
  clusters = ["a", "a", "b", "b", "c", "c"]
  x = np.array([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
  est = exposure_e1.cluster_bootstrap(lambda i: x[i].mean(), clusters, 200)
  assert est["value"] == 2.0 and est["n_eff"] == 3 and 1.0 <= est["ci_low"] <= 2.0 <= est["ci_high"] <= 3.0
  # a statistic of whole clusters only: any resample keeps each cluster's two members together
  pairs = exposure_e1.cluster_bootstrap(lambda i: float(len(i) % 2), clusters, 50)
  assert pairs["ci_low"] == pairs["ci_high"] == 0.0


def test_summary_by_hand_and_as_json(tmp_path):
  err, rollouts, clusters = _arrays(spread=1.0)
  M = len(err)
  sweeps = {"oracle": _sweep(30.0, 0.6, M), "hilore_exposure_off": _sweep(20.0, 0.6, M),
            "hilore_exposure_on": _sweep(26.0, 0.6, M)}
  arrays = {"err_by": {"clipped": err, "relative": err * 2}, "metric": "clipped", "score_MU": err * 3.0,
            "scores": {"run-time score": err, "static per unit": np.tile(err.mean(0), (M, 1))},
            "clusters": clusters, "rollouts": rollouts, "sweeps": sweeps, "tol": 1.0, "violation_target": 0.05}
  gate = {"on": True, "spread": 3.0}
  out = exposure_e1.summary("configs/exposure_e1_smollm2.yaml", "python -m experiments.exposure.main", arrays,
                            E1Criteria(), gate, n_boot=100)
  p1 = out["P1"]
  assert p1["value"] == pytest.approx(np.median(np.quantile(err, 0.9, 0) / np.quantile(err, 0.1, 0)))
  assert p1["per_metric"]["relative"]["value"] == pytest.approx(p1["value"])  # scale-free
  assert p1["n_eff"] == R * S and p1["met"] == (p1["value"] >= 2.5) and p1["target"] == 2.5
  # errors 0.6 d against tol 1 over d in (0, 0.5, 1, 2): 0 violations up to d = 1, all at 2, so each arm crosses
  # 5% between d = 1 and 2, 1/20 of the way: removal (1 + 0.05) x its rate
  assert out["P2"]["value"] == pytest.approx(1.05 * 30 - 1.05 * 20) and out["P2"]["met"]
  assert out["P2"]["periodic"]["met"] is None  # the periodic-static arm did not run: not counted as missed
  assert out["P3"]["value"] == pytest.approx(1.0) and out["P3"]["headroom_share"] == pytest.approx(0.6)
  assert out["P3"]["met"]
  # no arm reaches the target (errors a quarter of tol at most): P2 and P3's share are undefined, neither met nor
  # missed (E1's "0 points" and "nan >= 0.5: MISSED", issue 47)
  flat = {a: _sweep(r, 0.125, M) for a, r in (("oracle", 30.0), ("hilore_exposure_off", 20.0),
                                               ("hilore_exposure_on", 26.0))}
  undef = exposure_e1.summary("c.yaml", "cmd", {**arrays, "sweeps": flat}, E1Criteria(), gate, n_boot=50)
  assert undef["P2"]["met"] is None and np.isnan(undef["P2"]["value"]) and "never crossed" in undef["P2"]["note"]
  assert undef["P3"]["met"] is None and np.isnan(undef["P3"]["headroom_share"])
  md_undef = exposure_report.e1_markdown(json.loads(json.dumps(undef, default=float))).splitlines()
  assert next(x for x in md_undef if x.startswith("| P2 headroom")).endswith("| undefined |")
  assert next(x for x in md_undef if x.startswith("| P3 prediction")).endswith("| headroom share undefined |")
  # a perfect score ranks units perfectly, per minibatch and pooled; the paper's figures beside it
  assert out["P4"]["table"]["run-time score"]["averaged"]["spearman"] == pytest.approx(1.0)
  assert out["P4"]["value"] == pytest.approx(1.0) and out["P4"]["paper"]["auroc"] == 0.89 and out["P4"]["met"]
  assert out["gate_decision"] == gate and out["held_out"] == {"minibatches": M, "clusters": R * S}
  path = tmp_path / "exposure_e1.json"
  path.write_text(json.dumps(out, default=float))
  back = json.loads(path.read_text())
  for k in ("P1", "P2", "P3", "P4"):
    assert {"value", "ci_low", "ci_high", "target", "met"} <= set(back[k])
  # the tables docs/exposure.md carries, from the same record: each criterion's row with its verdict
  md = exposure_report.e1_markdown(back).splitlines()
  row = lambda start: next(line for line in md if line.startswith(start))
  assert row("| P2 headroom").endswith("| met |") and f"{1.05 * 30 - 1.05 * 20:.3g} [" in row("| P2 headroom")
  assert row("| P2, oracle - periodic").endswith("| not run |")
  assert row("| P3 prediction").endswith("| met |") and row("| P4 cross-unit").endswith("| met |")
  assert row("| the paper |") == "| the paper | 0.78 | 0.81 | 0.89 |"
  assert md[-1].endswith(": on.")


def test_low_spread_is_nothing_to_predict():
  err, rollouts, clusters = _arrays(spread=0.05)
  arrays = {"err_by": {"clipped": err}, "metric": "clipped", "score_MU": err[::-1], "scores": {"s": err[::-1]},
            "clusters": clusters, "rollouts": rollouts, "tol": 1.0, "violation_target": 0.05}
  out = exposure_e1.summary("c.yaml", "cmd", arrays, E1Criteria(), {"on": False}, n_boot=50)
  assert out["P1"]["verdict"] == "nothing to predict" and not out["P1"]["met"]
  assert out["P1"]["per_metric"]["clipped"]["between_rollouts"] < 1.5
  assert not out["P3"]["met"] and out["P2"] == {"met": None}


def test_write_assembles_the_benchmark_run_into_the_summary_file(tmp_path, monkeypatch):
  import dataclasses
  import types

  from experiments.common.config import ExposureBenchConfig

  err, rollouts, clusters = _arrays(spread=1.0)
  M = len(err)
  held = [types.SimpleNamespace(step=int(r), index=int(c.split(":")[1])) for r, c in zip(rollouts, clusters)]
  lengths = np.array([[1] * 2 + [0] * 38, [1] * 40])  # completion lengths 2 and 40 tokens
  mask = np.repeat(lengths, 4, axis=0)
  cal = [types.SimpleNamespace(pass_=p, describe={"clipfrac": 0.05 * p}, batch=types.SimpleNamespace(mask=mask))
         for p in (0, 1)]
  extra = np.ones((M, 2))  # two units not measured (interpolated): left out by mu
  table = {"exposure_v1": (np.hstack([err, extra]), np.full(U + 2, 2.0)),
           "baseline: static per unit": (np.tile(np.hstack([err.mean(0), [1, 1]]), (M, 1)), np.ones(U + 2))}
  sweeps = {"oracle": _sweep(30.0, 0.5, M), "hilore_exposure_off": _sweep(20.0, 0.5, M),
            "hilore_exposure_on": _sweep(26.0, 0.5, M)}
  be = dataclasses.replace(ExposureBenchConfig(bootstrap=50), e1_json=str(tmp_path / "data" / "exposure_e1.json"))
  monkeypatch.setattr("sys.argv", ["bench_exposure", "--config", "configs/exposure_e1_smollm2.yaml", "--out", "x"])
  units = [(u % 3, "qkv"[u % 2]) for u in range(U + 2)]  # 3 layers, 2 kinds
  static = np.exp(np.array([l for l, _ in units]) + 2.0 * np.array([k == "q" for _, k in units]))  # kind x layer
  cal_state = types.SimpleNamespace(gate={"mode": "always", "on": True, "measured_on": False},
                                    recon_rms=list(np.arange(1.0, U + 3)), static_error=list(static))
  np.testing.assert_allclose(exposure_e1.prior_scores(cal_state, units)["type/layer prior"], static)
  out = exposure_e1.write(be, "clipped", cal, held, {"clipped": np.hstack([err, extra])}, units, list(range(U)),
                          table, "exposure_v1", sweeps, cal_state, 1.0)
  saved = json.loads((tmp_path / "data" / "exposure_e1.json").read_text())
  assert saved["config"] == "configs/exposure_e1_smollm2.yaml" and saved["command"].endswith("--out x")
  assert saved["regime"] == {"clipfrac_second_pass": 0.05, "length_p90_p10": 20.0, "met": True}
  assert saved["P3"]["value"] == pytest.approx(1.0) and saved["held_out"]["clusters"] == R * S
  assert set(saved["P4"]["table"]) == {"run-time score", "baseline: static per unit", "type/layer prior",
                                       "reconstruction RMS"}
  # the arms' forced gate is not the recipe's: its measured decision is
  assert saved["gate_decision"] == {"mode": "auto", "on": False, "measured_on": False} and out["P1"]["n_eff"] == R * S


def test_the_committed_e1_config_holds_the_pre_registered_settings():
  import os

  import repo

  from experiments.common import config as bench_config

  cfg, be = bench_config.load(os.path.join(repo.ROOT, "configs", "exposure_e1_smollm2.yaml"), [], "bench_exposure")
  r, g, o = cfg.rollout, cfg.grpo, cfg.optimizer
  assert (r.max_new_tokens, r.temperature, r.num_prompts, r.num_generations) == (256, 1.0, 4, 8)
  assert (cfg.train.minibatch_size, g.num_iterations, o.lr, g.beta, o.max_grad_norm) == (8, 2, 2e-5, 0.02, 1.0)
  # rollout 0 calibrates (both passes of its 4 row sets), rollout 4 recalibrates, rollouts 1-8 held out
  assert (be.rollout_steps, be.calib_minibatches, be.recalibrate_rollout) == (9, 8, 4)
  assert be.criteria == E1Criteria() and be.e1_json == "docs/data/exposure_e1.json"
  assert cfg.task.arithmetic.format == "word" and cfg.memory.gate.spread_min == 2.0
