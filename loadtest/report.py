"""Summaries per level, the saturation verdict, and the JSON / CSV / PNG / markdown outputs."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np

from .driver import Outcome
from .machine import line as machine_line


def summarize(outcomes: list[Outcome], elapsed: float) -> dict:
    answered = [o for o in outcomes if o.status == 200]
    latencies = np.array([o.latency_s for o in answered]) * 1e3
    errors = Counter("no_answer" if o.status is None else str(o.status) for o in outcomes if o.status != 200)
    paths = Counter(o.compute_path or "unknown" for o in answered)
    quantile = lambda q: float(np.percentile(latencies, q)) if len(latencies) else None  # noqa: E731
    return {
        "sent": len(outcomes),
        "answered": len(answered),
        "errors": dict(errors),
        "elapsed_s": elapsed,
        "throughput_rps": len(answered) / elapsed if elapsed else 0.0,
        "tokens_per_s": sum(o.tokens for o in answered) / elapsed if elapsed else 0.0,
        "latency_ms": {"p50": quantile(50), "p90": quantile(90), "p99": quantile(99),
                       "max": float(latencies.max()) if len(latencies) else None},
        "compute_paths": dict(paths),
    }


def saturation_verdict(rows: list[dict], baseline: str, candidate: str, endpoint: str) -> dict | None:
    """Compare both servers at the closed-loop level where the baseline's throughput peaks."""
    def closed(backend):
        return {r["level"]: r for r in rows
                if r["backend"] == backend and r["mode"] == "closed" and r["endpoint"] == endpoint}

    base, cand = closed(baseline), closed(candidate)
    common = sorted(set(base) & set(cand))
    if not common:
        return None
    level = max(common, key=lambda lv: base[lv]["throughput_rps"])
    b, c = base[level], cand[level]
    ratio = c["throughput_rps"] / b["throughput_rps"] if b["throughput_rps"] else None
    return {"endpoint": endpoint, "concurrency": level, f"{baseline}_rps": b["throughput_rps"],
            f"{candidate}_rps": c["throughput_rps"], "throughput_ratio": ratio,
            f"{baseline}_p99_ms": b["latency_ms"]["p99"], f"{candidate}_p99_ms": c["latency_ms"]["p99"],
            "target_met": bool(ratio and ratio >= 1.5 and (c["latency_ms"]["p99"] or 0) < (b["latency_ms"]["p99"] or 0))}


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    fields = ["backend", "endpoint", "mode", "level", "sent", "answered", "errors", "throughput_rps",
              "tokens_per_s", "p50_ms", "p90_ms", "p99_ms", "max_ms", "bucket_share", "padding_share", "peak_rss_mb"]
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in report["rows"]:
            writer.writerow({**{k: row[k] for k in ("backend", "endpoint", "mode", "level", "sent", "answered",
                                                     "throughput_rps", "tokens_per_s", "bucket_share")},
                             "padding_share": row.get("padding_share"),
                             "errors": json.dumps(row["errors"]), "peak_rss_mb": row["peak_rss_mb"],
                             **{f"{k}_ms": v for k, v in row["latency_ms"].items()}})
    _plot_latency(report["rows"], out / "latency_vs_throughput.png")
    _plot_paths(report["rows"], out / "compute_path_mix.png")
    (out / "report.md").write_text(markdown(report))


def _plot_latency(rows: list[dict], path: Path) -> None:
    """One panel per endpoint: each server's closed-loop sweep (labelled by concurrency) and
    open-loop points, p50 solid and p99 dashed, latency against achieved throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    endpoints = sorted({r["endpoint"] for r in rows})
    fig, axes = plt.subplots(1, len(endpoints), figsize=(6 * len(endpoints), 4.5), squeeze=False)
    for ax, endpoint in zip(axes[0], endpoints):
        for index, backend in enumerate(sorted({r["backend"] for r in rows})):
            color = f"C{index}"
            closed = sorted((r for r in rows if (r["backend"], r["endpoint"], r["mode"]) == (backend, endpoint, "closed")),
                            key=lambda r: r["level"])
            xs = [r["throughput_rps"] for r in closed]
            for quantile, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(xs, [r["latency_ms"][quantile] or np.nan for r in closed], style, color=color,
                        label=f"{backend} closed-loop {quantile}")
            for r in closed:
                ax.annotate(f"c={r['level']}", (r["throughput_rps"], r["latency_ms"]["p50"] or np.nan),
                            fontsize=7, textcoords="offset points", xytext=(3, -10))
            opened = [r for r in rows if (r["backend"], r["endpoint"], r["mode"]) == (backend, endpoint, "open")]
            ax.scatter([r["throughput_rps"] for r in opened], [r["latency_ms"]["p99"] or np.nan for r in opened],
                       marker="^", color=color, label=f"{backend} open-loop p99")
        ax.set_title(endpoint)
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("latency (ms, log)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_paths(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compiled = [r for r in rows if r["backend"] == "tvm"]
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(compiled) + 2), 4))
    labels = [f"{r['endpoint']}\n{r['mode']} {r['level']}" for r in compiled]
    buckets = [sum(v for k, v in r["compute_paths"].items() if k.startswith("bucket")) for r in compiled]
    generic = [r["compute_paths"].get("generic", 0) for r in compiled]
    ax.bar(labels, buckets, label="bucket")
    ax.bar(labels, generic, bottom=buckets, label="generic (fallback)")
    ax.set_ylabel("answered requests")
    ax.set_title("compiled server: which library served")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    lines = [
        "# Load test report", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {machine_line(report['machine'])}; "
        f"versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}", "",
        "| backend | endpoint | mode | level | sent | answered | errors | req/s | tokens/s | p50 ms | p90 ms | p99 ms | max ms | bucket share | padding share | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in report["rows"]:
        lat = r["latency_ms"]
        share = "-" if r["bucket_share"] is None else f"{100 * r['bucket_share']:.0f}%"
        padding = "-" if r.get("padding_share") is None else f"{100 * r['padding_share']:.0f}%"
        lines.append(
            f"| {r['backend']} | {r['endpoint']} | {r['mode']} | {r['level']} | {r['sent']} | {r['answered']} | "
            f"{r['errors'] or '-'} | {r['throughput_rps']:.2f} | {r['tokens_per_s']:.0f} | {fmt(lat['p50'])} | "
            f"{fmt(lat['p90'])} | {fmt(lat['p99'])} | {fmt(lat['max'])} | {share} | {padding} | {r['peak_rss_mb']:.0f} |"
        )
    for verdict in report.get("verdicts", []):
        lines += ["", f"At concurrency {verdict['concurrency']} on {verdict['endpoint']} (where torch peaks): "
                      f"throughput ratio tvm/torch = {verdict['throughput_ratio']:.2f}, p99 tvm {fmt(verdict['tvm_p99_ms'])} ms "
                      f"vs torch {fmt(verdict['torch_p99_ms'])} ms; target (>= 1.5x, lower p99) "
                      f"{'met' if verdict['target_met'] else 'NOT met'}."]
    lines += ["", "Plots: `latency_vs_throughput.png`, `compute_path_mix.png`; raw data: `results.json`, `results.csv`.", ""]
    return "\n".join(lines)
