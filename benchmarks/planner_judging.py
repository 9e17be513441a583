"""Judging the planner's best split against a noisy measurement: a paired bootstrap over the
requests says how sure the measurement is of its best split; below ``CONFIDENCE`` it is a tie."""
from __future__ import annotations

import numpy as np

from pdctl.planner.metrics import slo_ratio

CONFIDENCE = 0.9  # how sure the measurement must be of its best split for a disagreement to count


def best_split_at(rate: float, runs: list[dict], args, seed: int = 0, resamples: int = 2000,
                  prediction: str = "predicted") -> dict:
    """The split the planner ranks best at one load level (smallest predicted SLO ratio) against the
    one measured best, and how sure the measurement is of it: the share of paired bootstrap
    resamples of the requests (every split served the same ones) in which it is still best.
    Under ``CONFIDENCE`` the measurement cannot tell the splits apart: a tie, which any
    prediction agrees with.  Reported, so a tie is never mistaken for an agreement."""
    from pdctl.planner.metrics import percentile

    def ratio(ttft_s: np.ndarray, tpot_s: np.ndarray) -> float:
        tpot = tpot_s[np.isfinite(tpot_s)]
        return slo_ratio(percentile(ttft_s, 90), percentile(tpot, 90) if len(tpot) else float("nan"),
                         args.slo_ttft, args.slo_tpot)

    def measured(run: dict, key: str) -> np.ndarray:
        return np.array([np.inf if q[key][1] is None else q[key][1] / 1e3 for q in run["per_request"]])

    pred_best = min(runs, key=lambda r: r[prediction]["slo_ratio"] if r[prediction]["slo_ratio"] is not None
                    else float("inf"))["split"]
    meas_best = min(runs, key=lambda r: r["measured"]["slo_ratio"])["split"]
    samples = {r["split"]: (measured(r, "ttft_ms"), measured(r, "tpot_ms")) for r in runs}
    n = min(len(ttft) for ttft, _ in samples.values())
    rng = np.random.default_rng(seed)
    wins = 0
    for _ in range(resamples):
        pick = rng.integers(0, n, n)
        ratios = {split: ratio(ttft[pick], tpot[pick]) for split, (ttft, tpot) in samples.items()}
        wins += min(ratios, key=ratios.get) == meas_best
    confidence = wins / resamples
    return {"rate": rate, "predicted_best": pred_best, "measured_best": meas_best,
            "measured_confidence": round(confidence, 3), "tie": confidence < CONFIDENCE,
            "agrees": pred_best == meas_best or confidence < CONFIDENCE,
            "slo_ratio": {r["split"]: {"predicted": r[prediction]["slo_ratio"],
                                       "measured": round(r["measured"]["slo_ratio"], 4)} for r in runs}}


def recorded_measurement(runs: list[dict], split: str, rate: float, requests: int) -> dict:
    """A run's measurement as a results file recorded it (``--repredict``)."""
    for run in runs:
        if run["split"] == split and run["rate"] == rate and run["requests"] == requests:
            return {**run["measured"], "probes": run["probes"], "probes_before_after": run.get("probes_before_after"),
                    "steps": run.get("steps"), "phases": run.get("phases"), "model_id": run.get("model_id"),
                    "per_request": [tuple(None if q[key][1] is None else q[key][1] / 1e3 for key in ("ttft_ms", "tpot_ms"))
                                    for q in run["per_request"]]}
    raise SystemExit(f"the results file has no {split} run at {rate} req/s of {requests} requests: "
                     "give the flags it was measured with")
