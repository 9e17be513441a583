"""Turning a plan into what a person reads: a table, a PNG and one JSON line."""
from __future__ import annotations

import math
from pathlib import Path


def _v(value, spec: str = ".0f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def table(candidates: list[dict]) -> str:
    header = ("DEPLOYMENT", "GPUS", "TTFT_P50", "TTFT_P90", "TPOT_P50", "TPOT_P90", "ITL_P90", "GOODPUT",
              "KV_D_MEAN", "KV_D_PEAK", "PREEMPT", "XFER_GB/S", "SLO", "SIMULATED")
    rows = [header]
    for r in candidates:
        decode = r.get("decode_pool") or {}
        sim = r.get("simulated") or {}
        rows.append((
            r["deployment"], str(r["gpus"]), _v(r["ttft_ms"]["p50"]), _v(r["ttft_ms"]["p90"]),
            _v(r["tpot_ms"]["p50"], ".1f"), _v(r["tpot_ms"]["p90"], ".1f"), _v(r["itl_ms"]["p90"], ".1f"),
            _v(r["goodput_req_s"], ".3g"), _v(decode.get("kv_usage_mean"), ".0%"), _v(decode.get("kv_usage_peak"), ".0%"),
            str(r["preemptions"]), _v(r["transfer_gb_s"], ".3g"),
            "meets" if r["meets_slo"] else ("fails*" if r.get("stopped_early") else "fails"),
            f"{sim.get('deployment', r['deployment'])} @{sim.get('traffic_fraction', 1):.3g}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("times in ms; goodput in req/s for the whole deployment; fails*: stopped once >10% of requests "
                 "had missed an SLO; SIMULATED: the slice simulated and its share of the traffic")
    return "\n".join(lines)


def plot(plan: dict, path: str | Path, title: str = "") -> Path:
    """Two panels: each candidate's TTFT p90 against TPOT p90 with the SLO box, and goodput per GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    candidates = plan["candidates"]
    slo_ttft, slo_tpot = plan["slo"]["ttft_s"] * 1e3, plan["slo"]["tpot_s"] * 1e3
    best = (plan.get("recommended") or {}).get("deployment")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))

    def capped(value, cap):
        return cap if value is None or math.isinf(value) else min(value, cap)

    ttft_cap = 4 * slo_ttft
    tpot_cap = 4 * slo_tpot
    for r in candidates:
        x = capped(r["ttft_ms"]["p90"], ttft_cap)
        y = capped(r["tpot_ms"]["p90"], tpot_cap)
        colour = "tab:green" if r["meets_slo"] else "tab:red"
        marker = "*" if r["deployment"] == best else ("s" if r["both"] else "o")
        left.scatter([x], [y], c=colour, marker=marker, s=160 if marker == "*" else 45, zorder=3)
        left.annotate(r["deployment"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    xs = [capped(r["ttft_ms"]["p90"], ttft_cap) for r in candidates] + [slo_ttft]
    ys = [capped(r["tpot_ms"]["p90"], tpot_cap) for r in candidates] + [slo_tpot]
    x_low, y_low = max(min(xs) / 2, 1e-3), max(min(ys) / 2, 1e-3)
    left.set_xscale("log")
    left.set_yscale("log")
    left.axvline(slo_ttft, color="grey", ls="--")
    left.axhline(slo_tpot, color="grey", ls="--")
    left.fill_between([x_low, slo_ttft], y_low, slo_tpot, color="tab:green", alpha=0.08)
    left.set_xlim(x_low, ttft_cap * 1.2)
    left.set_ylim(y_low, tpot_cap * 1.2)
    left.set_xlabel("TTFT p90 (ms, log; capped at 4x SLO)")
    left.set_ylabel("TPOT p90 (ms, log; capped at 4x SLO)")
    left.set_title("predicted latency (green box: meets both SLOs)")

    ordered = sorted(candidates, key=lambda r: (r["gpus"], r["both"] > 0, r["prefill"]))
    labels = [r["deployment"] for r in ordered]
    per_gpu = [r["goodput_req_s"] / r["gpus"] for r in ordered]
    colours = ["tab:green" if r["meets_slo"] else "tab:red" for r in ordered]
    bars = right.bar(range(len(ordered)), per_gpu, color=colours)
    for bar, r in zip(bars, ordered):
        if r["deployment"] == best:
            bar.set_edgecolor("black")
            bar.set_linewidth(2.5)
    right.set_xticks(range(len(ordered)))
    right.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    right.set_ylabel("goodput per GPU (req/s meeting both SLOs)")
    right.set_title(f"recommended: {best or 'none meets the SLOs'}")
    fig.suptitle(title or "pdctl plan", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
