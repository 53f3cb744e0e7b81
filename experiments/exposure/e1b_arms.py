"""Issue 47's E1b, its arms phase (experiments/exposure/e1b.py runs it after the regime check): every arm's planner over
the held-out minibatches at the shared byte allowance (no plan compiled), each arm swept over delta by doubling until
its violation rate crosses the target (experiments/exposure/e1b_criteria.py reads it), the criteria, and the
predictors' held-out scores and rankings. Every realised error is exact from the units' own errors."""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.exposure import e1 as exposure_e1, study as exposure_study
from experiments.exposure import e1b_criteria as crit
from experiments.exposure.sweep import PlanFlops, lowp_set, removed_pct
from hilore_jax import model
from hilore_jax.memory import MemoryManager, calibration, gate, predictors, probe, risk

ARMS = ("hilore_exposure_off", "static_clip", "hilore_exposure_on", "oracle_bucketed", "oracle")
STATIC_DELTA = ("hilore_exposure_off", "static_clip", "oracle")  # arms whose risks are errors: static's delta
BIG = 1 << 50  # bytes: an allowance no plan reaches (does memory bind a plan?)


def mask(lsets, U: int) -> np.ndarray:
  out = np.zeros((len(lsets), U), bool)
  for i, ls in enumerate(lsets):
    out[i, list(ls)] = True
  return out


def assume_fitted(mm: MemoryManager, bucket: int, allowance: int):
  """The bucket's plan fitted at the shared allowance, as a restored state would carry it: no compile."""
  mm.state.allowance[str(bucket)] = allowance
  mm.state.verified = sorted(set(mm.state.verified) | {bucket})


@dataclasses.dataclass
class Planners:
  """Each arm's plan of held-out minibatch i at (delta, allowance) as (plan, policies), the bucketed arms' managers
  with each minibatch's bucket, the exposure-on arm's manager (its scores) and each minibatch's g_hat."""

  plan_of: dict
  buckets: dict
  on_mm: MemoryManager
  g_hat: np.ndarray


def planners(s: exposure_study.Study, h: exposure_study.HeldOut, b: dict, err_MU: np.ndarray) -> Planners:
  """Every arm's planner over the held-out minibatches at the shared allowance (allocated once: no plan compiled)."""
  hooks, held, allowance, cals = s.hooks, h.records, b["allowance"], b["cals"]
  static_mm, sw = b["static_mm"], s.cfg.memory.exposure
  buckets = {}
  for arm in ("hilore_exposure_on", "oracle_bucketed"):
    mm = MemoryManager(dataclasses.replace(b["mc_tol"], gate=exposure_study.ALWAYS), hooks,
                       probe=probe.StudyProbe(forward_errors=True, oracle=arm == "oracle_bucketed"))
    mm.setup(s.cal[0].params, [r.batch for r in s.cal], 0, calibration_state=cals["always"])
    assume_fitted(mm, 0, allowance)
    mm.defer_fits = True  # a new bucket takes the shared allowance (below), never a fit of its own
    ids = []
    for i, r in enumerate(held):
      if arm == "oracle_bucketed":
        probe.give_errors(mm, err_MU[i])
      ids.append(mm.allocate([r.batch], [r.logp], [h.token_err[i]])[0].bucket)
      assume_fitted(mm, ids[-1], allowance)
    buckets[arm] = (mm, ids)
  # the oracle: each minibatch planned from its own measured unit errors, no buckets (whose sqrt(2) grid floors a
  # unit at a quarter of its calibration level: the most any predictor could know); oracle_bucketed is E1's oracle
  exact = []
  for i, r in enumerate(held):
    mm = MemoryManager(dataclasses.replace(b["mc_tol"], buckets=1), hooks)
    mm.setup(s.cal[0].params, [q.batch for q in s.cal], 0,
             calibration_state=dataclasses.replace(cals["never"], static_risk=err_MU[i].tolist()))
    assume_fitted(mm, 0, allowance)
    mm.allocate([r.batch])  # its shape known: plans at any delta without a compile
    exact.append(mm)
  on_mm = buckets["hilore_exposure_on"][0]
  g_hat = cals["always"].grad_scale * probe.l1(on_mm, [r.batch for r in held], sw, [r.logp for r in held])
  f = risk.clip_scale(g_hat, hooks.max_grad_norm)
  # static_clip's risks are static's times f_i, so its plan at delta is static's at delta / f_i (the MILP's risk
  # row scaled), exactly; f_i = 0 (no updated token) lets every unit be L
  plan_of = {"hilore_exposure_off": lambda i, d, a: static_mm.plan_at(0, d, a),
             "static_clip": lambda i, d, a: static_mm.plan_at(0, d / f[i] if f[i] > 0 else float("inf"), a),
             "oracle": lambda i, d, a: exact[i].plan_at(0, d, a),
             **{arm: (lambda i, d, a, mm=mm, ids=ids: mm.plan_at(ids[i], d, a)) for arm, (mm, ids) in buckets.items()}}
  return Planners(plan_of, buckets, on_mm, g_hat)


def sweep_arms(s: exposure_study.Study, b: dict, plan_of: dict, err_MU: np.ndarray, flops: PlanFlops,
               gc: tuple[float, float], progress=print) -> tuple[dict, dict, dict, dict]:
  """Each arm swept over delta by doubling until its violation rate crosses the target, read there (with the budgets
  active either side of the crossing) and at its calibrated delta: (sweeps, status, reads, at_cal)."""
  mc, e, units, M = s.cfg.memory, s.be.e1b, s.units, len(err_MU)
  tol, allowance, cals, (gc_flops, gc_s) = b["regime"]["tolerance"], b["allowance"], b["cals"], gc
  rtol = max(1e-6, mc.mip_gap)

  def point_at(arm: str, d: float) -> dict:
    plans = [plan_of[arm](i, d, allowance) for i in range(M)]
    lsets = [lowp_set(pols, units) for _, pols in plans]
    err = [float(calibration.set_error_of(err_MU[i], [list(ls)])[0]) for i, ls in enumerate(lsets)]
    rem = [removed_pct(flops(pols), gc_flops, flops.none) for _, pols in plans]
    frac_l = [p.fractions()["frac_L"] for p, _ in plans]
    free = [plan_of[arm](i, float("inf"), allowance)[1] for i in range(M)]
    return {"delta": float(d), "violation_rate": float(np.mean(np.asarray(err) > tol)), "err_mean": float(np.mean(err)),
            "recompute_removed_pct": float(np.mean(rem)), "frac_L": float(np.mean(frac_l)),
            "l_units": float(np.mean([len(ls) for ls in lsets])),
            "predicted_removed_pct": 100 * (gc_s - float(np.mean([p.time_s for p, _ in plans]))) / max(gc_s, 1e-12),
            "saturated": all(pols == fr for (_, pols), fr in zip(plans, free)),
            "per_minibatch": {"err": err, "removed_pct": rem, "frac_L": frac_l}, "_lsets": lsets}

  def active_at(arm: str, d: float) -> dict:  # which budget binds each minibatch's plan (as the manager reports)
    out: dict = {}
    for i in range(M):
      t = plan_of[arm](i, d, allowance)[0].time_s * (1 - rtol) - 1e-12
      mem = plan_of[arm](i, d, BIG)[0].time_s < t
      rsk = plan_of[arm](i, float("inf"), allowance)[0].time_s < t
      k = "both" if mem and rsk else "memory" if mem else "risk" if rsk else "none"
      out[k] = out.get(k, 0) + 1
    return out

  sweeps, status, reads, at_cal = {}, {}, {}, {}
  delta0 = cals["never"].delta
  for arm in ARMS:
    progress(f"E1b: sweeping {arm} from {e.sweep_start:g} x delta {delta0:.3g}, doubling")
    sweeps[arm], status[arm] = crit.sweep_until(lambda d, a=arm: point_at(a, d), delta0, e)
    reads[arm] = crit.read(sweeps[arm], e.violation_target)
    d_cal = cals["never" if arm in STATIC_DELTA else "always"].delta
    at_cal[arm] = {k: v for k, v in point_at(arm, d_cal).items() if k not in ("per_minibatch", "_lsets")}
    at_cal[arm]["active"] = active_at(arm, d_cal)
  for arm in ARMS:  # the active constraints where each arm crossed
    pts = sweeps[arm]
    for a_, b_ in zip(pts, pts[1:]):
      if a_["violation_rate"] <= e.violation_target < b_["violation_rate"]:
        a_["active"], b_["active"] = active_at(arm, a_["delta"]), active_at(arm, b_["delta"])
        reads[arm]["active_around"] = [a_["active"], b_["active"]]
        break
  return sweeps, status, reads, at_cal


def held_out_scores(s: exposure_study.Study, h: exposure_study.HeldOut, b: dict, pl: Planners, err_MU: np.ndarray,
                    clusters: list[str]) -> tuple[dict, dict, dict]:
  """The run-time score, static and static_clip on the held-out minibatches, the predictor's raw scores under both
  token-norm coherences and their rankings, and the paper's P4 figures: (scores, raw_held, {P4, ranking_held_out})."""
  held, sw, cals, static_p90 = h.records, s.cfg.memory.exposure, b["cals"], b["arrays"]["static_p90"]
  logp, batches, M = [r.logp for r in held], [r.batch for r in held], len(held)
  scores = {"run-time score": pl.on_mm.unit_scores(batches, logp, h.token_err),
            "baseline: static per unit": np.tile(static_p90, (M, 1)),
            "static_clip": risk.static_clip(static_p90, pl.g_hat, s.hooks.max_grad_norm)}
  m, (other, cal_other) = s.measured, b["other"]
  inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(len(s.units)), cals["always"].grad_scale)
  inputs_other = predictors.ScoreInputs(*inputs[:3], cal_other.grad_scale)
  raw_held = {sw.coherence: probe.scores(pl.on_mm, batches, inputs, sw, logp, h.token_err),
              other.coherence: probe.scores(pl.on_mm, batches, inputs_other, other, logp, h.token_err)}
  ranking_held = {k: {key: v for key, v in crit.ranking(r, err_MU).items() if key != "loo_rho_U"}
                  for k, r in raw_held.items()}
  p4 = exposure_e1.p4_paper(scores, err_MU, clusters, s.be.criteria, s.be.bootstrap, "run-time score")
  return scores, raw_held, {"P4": p4, "ranking_held_out": ranking_held}


def compare(s: exposure_study.Study, h: exposure_study.HeldOut, b: dict, arrays: dict, progress=print) -> dict:
  """Every arm's plans per held-out minibatch at the shared allowance, swept over delta; the criteria."""
  hooks, e, held, U, M = s.hooks, s.be.e1b, h.records, len(s.units), len(h.records)
  tol, allowance, static_mm = b["regime"]["tolerance"], b["allowance"], b["static_mm"]
  err_MU = np.asarray(h.err_by[s.cfg.memory.risk_metric], float)
  pl = planners(s, h, b, err_MU)
  L = hooks.model_cfg.num_hidden_layers
  flops = PlanFlops(hooks.gradient, L, held[0].params, held[0].batch)
  gc_flops, gc_s = flops(model.uniform(L, model.FULL_REMAT)), static_mm.gc_plan().time_s
  sweeps, status, reads, at_cal = sweep_arms(s, b, pl.plan_of, err_MU, flops, (gc_flops, gc_s), progress)
  ceiling = removed_pct(flops(b["aggressive"]), gc_flops, flops.none)
  floor = removed_pct(flops(static_mm.plan_at(0, 0.0, allowance)[1]), gc_flops, flops.none)
  clusters = [f"{r.step}:{r.index}" for r in held]
  prim = crit.primary(sweeps, ceiling, floor, clusters, tol, e, s.be.bootstrap)
  sec = crit.secondary(sweeps, at_cal, clusters, tol, e, s.be.bootstrap)
  shares = {a: crit.secondary(sweeps | {"static_clip": sweeps[a]}, at_cal | {"static_clip": at_cal[a]}, clusters,
                              tol, e, s.be.bootstrap) for a in ("hilore_exposure_on", "oracle_bucketed")}
  scores, raw_held, ranking = held_out_scores(s, h, b, pl, err_MU, clusters)
  arrays.update(err_clipped=h.err_by.get("clipped", err_MU), err_relative=h.err_by["relative"],
                grad_norm=np.asarray([r.grad_norm for r in h.refs]), g_hat=pl.g_hat, clusters=np.array(clusters),
                rollouts=np.array([r.step for r in held]), passes=np.array([r.pass_ for r in held]),
                score_runtime=scores["run-time score"], **{f"raw_{k}": r for k, r in raw_held.items()},
                **{f"bucket_{a}": np.array(ids) for a, (_, ids) in pl.buckets.items()},
                **{f"{a}_delta": np.array([p["delta"] for p in sweeps[a]]) for a in ARMS},
                **{f"{a}_lsets": np.stack([mask(p.pop("_lsets"), U) for p in sweeps[a]]) for a in ARMS},
                **{f"{a}_removed_pct": np.array([p["per_minibatch"]["removed_pct"] for p in sweeps[a]]) for a in ARMS})
  arms = {a: {"at_target": reads[a], "crossed": status[a] == "crossed", "sweep_status": status[a],
              "points": len(sweeps[a]), "at_calibrated_delta": at_cal[a],
              "distinct_buckets": len(set(pl.buckets[a][1])) if a in pl.buckets else 1} for a in ARMS}
  return {"held_out": {"minibatches": M, "clusters": len(set(clusters)), "rollouts": sorted({r.step for r in held}),
                       "zero_gradient_skipped": h.skipped},
          "reference": {"ceiling_removed_pct": ceiling, "optimal_hr_removed_pct": floor},
          "arms": arms, "sweeps": sweeps, "primary": prim, "secondary": sec, "shares_reported": shares,
          "g_hat_vs_grad_norm_rho": gate.spearman(pl.g_hat, [r.grad_norm for r in h.refs]), **ranking}


