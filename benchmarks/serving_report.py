"""The serving benchmark's results: summaries overall and by request kind, the latency CDF plot,
and the final JSON line of each scenario with its ratios against ``TARGET``."""
from __future__ import annotations

from pathlib import Path

from benchmarks.loadgen import Record, summarize

# The ratio a scenario's headline comparison must reach (prefix-aware over round-robin TTFT,
# colocated over disaggregated ITL p99).
TARGET = 2.0


def report(result: dict, args) -> dict:
    """Summaries overall and by request kind (records dropped, they go to the plot)."""
    records: list[Record] = result["records"]
    out = {k: v for k, v in result.items() if k != "records"}
    out["all"] = summarize(records, result["wall_s"], args.slo_ttft, args.slo_tpot)
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        out["by_kind"] = {k: summarize([r for r in records if r.kind == k], result["wall_s"], args.slo_ttft,
                                       args.slo_tpot) for k in kinds}
    return out


def focus(summary: dict, kind: str) -> dict:
    return summary.get("by_kind", {}).get(kind, summary["all"])


def plot(results: dict[str, dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    kind = "stream" if args.scenario == "interference" else None
    panels = [("TTFT", lambda r: [r.ttft]), ("TPOT", lambda r: [r.tpot] if r.tpot is not None else []),
              ("ITL", lambda r: r.itls)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (title, values) in zip(axes, panels):
        for name, res in results.items():
            recs = [r for r in res["records"] if r.ok and (kind is None or r.kind == kind or title == "TTFT")]
            xs = sorted(v * 1e3 for r in recs for v in values(r))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        scope = " (all requests)" if title == "TTFT" or kind is None else f" ({kind} requests)"
        ax.set_title(title + scope)
        ax.set_xlabel("ms")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("CDF")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"serving benchmark: {args.scenario} ({args.model})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def final_line(summaries: dict[str, dict], args, checkpoint: str) -> dict:
    line = {"benchmark": "serving", "scenario": args.scenario, "model": args.model, "quick": args.quick,
            "url": args.url, "seed": args.seed, "target": TARGET}
    if args.scenario == "prefix":
        for name, s in summaries.items():
            line[name] = {"ttft_p50_ms": s["all"]["ttft_ms"]["p50"], "ttft_p99_ms": s["all"]["ttft_ms"]["p99"],
                          "goodput_req_s": s["all"]["goodput_req_s"], "errors": s["all"]["errors"],
                          "prefill_hit_rate": s.get("prefill_hit_rate"),
                          "redis_lookup_failures": s.get("gateway", {}).get("pdserve_redis_unavailable_total")}
        rr, pa = summaries.get("round_robin"), summaries.get("prefix_aware")
        value = ratio(rr["all"]["ttft_ms"]["p50"], pa["all"]["ttft_ms"]["p50"]) if rr and pa else None
        line["ttft_p50_ratio_round_robin_over_prefix_aware"] = value
    elif args.scenario == "interference":
        for name, s in summaries.items():
            st, lg = focus(s, "stream"), focus(s, "long")
            line[name] = {"stream_tpot_p50_ms": st["tpot_ms"]["p50"], "stream_tpot_p99_ms": st["tpot_ms"]["p99"],
                          "stream_itl_p50_ms": st["itl_ms"]["p50"], "stream_itl_p99_ms": st["itl_ms"]["p99"],
                          "long_ttft_p50_ms": lg["ttft_ms"]["p50"], "ttft_p99_ms": s["all"]["ttft_ms"]["p99"],
                          "goodput_req_s": s["all"]["goodput_req_s"], "slo_attained": s["all"]["slo_attained"],
                          "errors": s["all"]["errors"],
                          "remote_prefill_fallbacks": sum(w.get("remote_prefill_fallbacks", 0)
                                                          for w in s.get("workers", {}).values())}
        co, di = summaries.get("colocated"), summaries.get("disaggregated")
        value = ratio(focus(co, "stream")["itl_ms"]["p99"], focus(di, "stream")["itl_ms"]["p99"]) if co and di else None
        line["itl_p99_ratio_coloc_over_disagg"] = value
        line["goodput_ratio_disagg_over_coloc"] = (ratio(di["all"]["goodput_req_s"], co["all"]["goodput_req_s"])
                                                   if co and di else None)
        line["tpot_p99_ratio_colocated_over_disaggregated"] = (
            ratio(focus(co, "stream")["tpot_ms"]["p99"], focus(di, "stream")["tpot_ms"]["p99"]) if co and di else None)
        line["slo_ttft_s"], line["slo_tpot_s"] = args.slo_ttft, args.slo_tpot
        line["cores"] = None if args.url else args.cores
        line["layout"] = None if args.url else (f"colocated: {args.cores} x both; disaggregated: {args.cores // 2} "
                                                f"prefill + {args.cores // 2} decode; 1 core (pinned) per worker")
        if value is not None:
            goodput = line["goodput_ratio_disagg_over_coloc"]
            line["winner"] = ("disaggregated" if value >= TARGET and (goodput or 0) >= 1.0 else
                              "mixed" if value >= 1.0 or (goodput or 0) >= 1.0 else "colocated")
    else:
        for name, s in summaries.items():
            a = s["all"]
            workers = s.get("workers", {}).values()
            steps = sum(w.get("engine_step_seconds", 0) for w in workers)
            line[name] = {"output_tok_s": a["output_tok_s"], "itl_p50_ms": a["itl_ms"]["p50"],
                          "itl_p99_ms": a["itl_ms"]["p99"], "ttft_p50_ms": a["ttft_ms"]["p50"],
                          "ttft_p99_ms": a["ttft_ms"]["p99"], "tpot_p50_ms": a["tpot_ms"]["p50"],
                          "errors": a["errors"],
                          # Engine time accounting, summed over the stack's workers: inside engine
                          # steps vs. between two steps while work was waiting (handoff overhead).
                          "engine_step_s": round(steps, 2),
                          "engine_gap_s": round(sum(w.get("engine_gap_seconds", 0) for w in workers), 2),
                          "engine_steps": sum(w.get("engine_steps", 0) for w in workers)}
        co, di = summaries.get("colocated"), summaries.get("disaggregated")
        value = None
        line["concurrency"], line["temperature"] = args.concurrency, args.temperature
        line["throughput_ratio_disagg_over_coloc"] = (
            ratio(di["all"]["output_tok_s"], co["all"]["output_tok_s"]) if co and di else None)
    line["target_met"] = None if value is None else value >= TARGET
    if args.scenario == "interference" and value is not None:
        line["target_met"] = value >= TARGET and (line["goodput_ratio_disagg_over_coloc"] or 0) >= 1.0
    return line
