"""PNG plots of a replay comparison: hit ratio vs capacity, gap closed, TTFT CDFs.

Each function returns a matplotlib figure (Agg backend, no display needed) so the
caller can save it and log it to MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from training.report import ComparisonReport  # noqa: E402


def hit_ratio_vs_capacity(report: ComparisonReport) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = [row["capacity"] * 100 for row in report.single]
    for name in report.single[0]["policies"]:
        ax.plot(caps, [row["policies"][name] for row in report.single], marker="o", label=name)
    ax.plot(
        caps, [row["references"]["lru_exact"] for row in report.single], "k--", label="LRU (exact)"
    )
    ax.plot(caps, [row["references"]["belady"] for row in report.single], "k:", label="Belady")
    peers = report.single[0].get("peers", {}).get("hit_ratios", {})
    if peers:
        best = max(
            peers,
            key=lambda n: np.mean([r["peers"]["hit_ratios"].get(n, 0) for r in report.single]),
        )
        ax.plot(
            caps,
            [r["peers"]["hit_ratios"].get(best, np.nan) for r in report.single],
            "--",
            color="grey",
            label=f"libCacheSim {best}",
        )
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:g}%" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("cache capacity (% of distinct blocks in the replayed part)")
    ax.set_ylabel("block hit ratio")
    ax.set_title("Single tier: hit ratio vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def gap_closed(report: ComparisonReport) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(report.single[0]["policies"])
    width = 0.8 / max(1, len(report.single))
    x = np.arange(len(names))
    for i, row in enumerate(report.single):
        ax.bar(
            x + i * width,
            [row["gap_closed"][n] * 100 for n in names],
            width,
            label=f"{row['capacity'] * 100:g}%",
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x + width * (len(report.single) - 1) / 2, names)
    ax.set_ylabel("% of the LRU-to-Belady gap closed")
    ax.set_title("Single tier: share of the gap closed, by capacity")
    ax.legend(title="capacity")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def ttft_cdf(report: ComparisonReport, capacity: float) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    suffix = f"@{capacity:g}"
    for key, values in report.tiered_ttft.items():
        if not key.endswith(suffix):
            continue
        data = np.sort(np.asarray(values)) / 1000.0
        ax.plot(data, np.arange(1, data.size + 1) / data.size, label=key.removesuffix(suffix))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Tiered with prefetch: TTFT CDF, HBM = {capacity * 100:g}% of distinct blocks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_plots(report: ComparisonReport, out_dir: Path) -> dict[str, Any]:
    """Save every plot the report supports as PNG; returns {file name: figure}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {}
    if report.single:
        figures["hit_ratio_vs_capacity.png"] = hit_ratio_vs_capacity(report)
        figures["gap_closed.png"] = gap_closed(report)
    if report.tiered:
        caps = sorted({row["capacity"] for row in report.tiered})
        figures["ttft_cdf.png"] = ttft_cdf(report, caps[len(caps) // 2])
    for name, fig in figures.items():
        fig.savefig(out_dir / name, dpi=110)
    return figures


def close(figures: dict[str, Any]) -> None:
    for fig in figures.values():
        plt.close(fig)
