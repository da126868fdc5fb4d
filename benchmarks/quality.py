"""``kvwarm bench quality``: the workload suite no single trace can game.

Replays workloads of different shape through the replay comparison
(``training.report.run_comparison``: the sidecar loop and planner, learned policies
trained on the first part of each workload by time as ``kvwarm replay`` trains them, or
quickly with ``--quick-fit``, and served behind the online guard)
at 1/5/10% of the replayed part's distinct blocks, single tier:

- ``shared``: the shared Mooncake conversation trace (its first ``--shared-requests``
  requests), when present;
- generator profiles (``features.generator``): ``chat``, ``rag``, ``agent``, ``mixed``,
  ``sharedprefix`` (system prompts and few-shot templates of 20-80 blocks shared by
  many requests), ``diurnal`` (a day of bursty agent-heavy traffic with idle hours),
  ``scan`` (most blocks never reused).

Per workload and capacity: exact LRU, Belady, the best libCacheSim peer, every kvwarm
policy and the share of the LRU-to-Belady gap each closes. The summary per learned
policy: the worst hit-ratio difference to exact LRU over every workload and capacity
(the safety goal: >= -0.005) with its paired bootstrap 95% interval
(``training.report.hit_difference_interval``: runs of 50 requests resampled), the rows
below and above exact LRU beyond their interval (the differences the replay can tell
apart from noise), the mean gap closed, and the workloads on which it beats the best
peer at every capacity. The leak check (no online policy above Belady with
bypass) runs on every row; a violation fails the command.

With ``--tiered``, every workload is also replayed through the tiered simulation at
the same fractions of HBM (open loop at the replay's default load): no prewarm (LRU,
loads at scheduling), LRU with prewarm, and every kvwarm policy with prewarm and
speculative prefetch. The tiered summary per policy: the worst TTFT p50 ratio to LRU
with prewarm over every workload and capacity (the safety goal: <= 1.02), the worst
ratios of the Harrell-Davis median and of the mean beside it (a sample p50 of a few
hundred requests jumps across gaps in the CDF: see ``training.metrics``), a paired
bootstrap 95% interval of the worst p50 ratio (``training.report.p50_ratio_interval``),
and the
settings where the policy's prediction adds to what prewarming at arrival gives.

Writes ``results.json``, ``summary.md`` (the README table) and ``quality.png``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from features.events import BlocksAccessed
from serving.planner import DEFAULT_EVICT_AHEAD_VISITS
from training.replay_cli import EVICT_AHEAD_OPTION
from training.report import format_interval

GENERATED = ("chat", "rag", "agent", "mixed", "sharedprefix", "diurnal", "scan")
WORKLOADS = ("shared", *GENERATED)
KVWARM_POLICIES = ("lru", "lfu", "prefix_lru", "lightgbm")
LEARNED = ("lightgbm", "lstm")
SAFETY_TOLERANCE = 0.005
TIERED_SAFETY_RATIO = 1.02
"""Tiered safety goal: a policy's TTFT p50 at most this times LRU with prewarm's."""
LEAK_TOLERANCE = 1e-12


class LeakError(AssertionError):
    """An online policy beat Belady with bypass: it must have read the future."""


def workload_events(name: str, num_requests: int, seed: int) -> tuple[list[BlocksAccessed], str]:
    """The events of one suite workload and a line saying where they came from; the
    shared trace gives [] when it is absent."""
    from features.decoders import decode_mooncake, read_trace
    from features.generator import generate, params_for

    if name == "shared":
        from benchmarks.traces import shared_trace_path

        path = shared_trace_path()
        if path is None:
            return [], "shared trace not found"
        events: list[BlocksAccessed] = []
        for event in read_trace(path):
            if isinstance(event, BlocksAccessed):
                events.append(event)
                if len(events) >= num_requests:
                    break
        return events, f"{path.name}, first {len(events):,} requests"
    rows = generate(params_for(name, num_requests=num_requests, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)], (
        f"generator profile {name!r}, {num_requests:,} requests, seed {seed}"
    )


def run_workload(
    events: Sequence[BlocksAccessed],
    *,
    policies: Sequence[str],
    capacities: Sequence[float],
    peers: bool,
    guard: bool,
    quick: bool,
    tiered: list[dict[str, Any]] | None = None,
    evict_ahead_visits: int = DEFAULT_EVICT_AHEAD_VISITS,
) -> list[dict[str, Any]]:
    """Single-tier rows of the replay comparison for one workload (leak-checked).
    With ``tiered`` (a list), the tiered rows are replayed too and appended to it.
    ``evict_ahead_visits``: the planner's batched eviction (0: one round per request)."""
    from training.replay_cli import make_trainer
    from training.report import ComparisonConfig, run_comparison

    config = ComparisonConfig(
        policies=tuple(policies),
        capacities=tuple(capacities),
        modes=("single", "tiered") if tiered is not None else ("single",),
        peers=peers,
        guard=guard,
        evict_ahead_visits=evict_ahead_visits,
    )
    report = run_comparison(events, config, trainer=make_trainer(quick))
    leak_check(report.single)
    if tiered is not None:
        tiered += report.tiered
    return report.single


def tiered_settings(
    results: dict[str, list[dict[str, Any]]],
) -> Iterator[tuple[str, float, dict[str, dict[str, Any]]]]:
    """(workload, capacity, policy -> row) for every tiered setting, in table order."""
    for workload, rows in results.items():
        for cap in sorted({r["capacity"] for r in rows}):
            yield workload, cap, {r["policy"]: r for r in rows if r["capacity"] == cap}


def summarize_tiered(
    results: dict[str, list[dict[str, Any]]], policies: Sequence[str]
) -> dict[str, Any]:
    """Per kvwarm policy other than LRU: over every workload and capacity, the worst
    TTFT p50 ratio to LRU with prewarm (safe when <= ``TIERED_SAFETY_RATIO``) and the
    settings where it is lower than LRU with prewarm's by more than 1%."""
    out: dict[str, Any] = {}
    for name in policies:
        if name == "lru":
            continue
        # The worst ratio to LRU with prewarm of each statistic, and where.
        worst = {key: (-math.inf, "") for key in ("p50", "p50_hd", "mean")}
        better: list[str] = []
        settings = 0
        paired_at_worst: dict[str, Any] = {}
        for workload, cap, at in tiered_settings(results):
            if name not in at or "lru" not in at:
                continue
            settings += 1
            where = f"{workload} @ {cap * 100:g}%"
            ratios = {key: _ratio(at[name]["ttft_ms"], at["lru"]["ttft_ms"], key) for key in worst}
            for key, ratio in ratios.items():
                if np.isfinite(ratio) and ratio > worst[key][0]:
                    worst[key] = (ratio, where)
            if worst["p50"][1] == where:  # this setting is the new worst p50
                paired_at_worst = at[name].get("paired_vs_lru_prewarm", {})
            if np.isfinite(ratios["p50"]) and ratios["p50"] < 0.99:
                better.append(where)
        out[name] = {
            "worst_ttft_ratio_to_lru_prewarm": worst["p50"][0],
            "worst_at": worst["p50"][1],
            "safe": worst["p50"][0] <= TIERED_SAFETY_RATIO,
            "paired_at_worst": paired_at_worst,
            "worst_hd_p50_ratio_to_lru_prewarm": worst["p50_hd"][0],
            "worst_hd_at": worst["p50_hd"][1],
            "worst_mean_ratio_to_lru_prewarm": worst["mean"][0],
            "worst_mean_at": worst["mean"][1],
            "better_than_lru_prewarm_at": better,
            "num_settings": settings,
        }
    return out


def _ratio(ttft: dict[str, float], base: dict[str, float], key: str) -> float:
    """``ttft[key] / base[key]``; NaN where either is missing or the base is 0."""
    a, b = ttft.get(key), base.get(key)
    return a / b if a is not None and b else float("nan")


def markdown_tiered(results: dict[str, list[dict[str, Any]]], summary: dict[str, Any]) -> str:
    """Tiered TTFT p50 per workload and HBM capacity: no prewarm in seconds, the rest
    as the change against it (what prewarming adds, and what prediction adds on top)."""
    policies = ["lru", *summary]
    head = (
        "| workload | HBM | no prewarm p50 | "
        + " | ".join("LRU+prewarm" if p == "lru" else p for p in policies)
        + " |"
    )
    lines = [head, "|" + "---|" * (3 + len(policies))]
    for workload, cap, at in tiered_settings(results):
        if "no_prewarm" not in at:
            continue
        cells = [f"{at[p]['ttft_p50_change'] * 100:+.1f}%" if p in at else "-" for p in policies]
        lines.append(
            f"| {workload} | {cap * 100:g}% | {at['no_prewarm']['ttft_ms']['p50'] / 1000:.2f} s | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "| policy | worst TTFT p50 / LRU+prewarm (where) | worst Harrell-Davis p50 | "
        "worst mean | lower than LRU+prewarm by >1% at |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ci = format_interval(s.get("paired_at_worst", {}).get("p50_ratio_ci95"), empty="")
        ci_text = f"; 95% CI {ci}" if ci else ""
        lines.append(
            f"| {name} | {s['worst_ttft_ratio_to_lru_prewarm']:.3f}x ({s['worst_at']}{ci_text}) | "
            f"{_worst(s, 'worst_hd_p50_ratio_to_lru_prewarm', 'worst_hd_at')} | "
            f"{_worst(s, 'worst_mean_ratio_to_lru_prewarm', 'worst_mean_at')} | "
            f"{len(s['better_than_lru_prewarm_at'])} of {s['num_settings']} settings |"
        )
    return "\n".join(lines)


def _worst(summary: dict[str, Any], ratio: str, where: str) -> str:
    value = summary.get(ratio, float("nan"))
    return f"{value:.3f}x ({summary[where]})" if np.isfinite(value) else "-"


def leak_check(rows: Sequence[dict[str, Any]]) -> None:
    """Raise ``LeakError`` when a policy's hit ratio exceeds Belady with bypass (the
    offline optimum of any online policy) in any single-tier row."""
    for row in rows:
        bound = row["references"]["belady_bypass"] + LEAK_TOLERANCE
        leaks = {n: v for n, v in row["policies"].items() if v > bound}
        if leaks:
            raise LeakError(
                f"at {row['capacity']:g}: {leaks} above Belady with bypass "
                f"{row['references']['belady_bypass']:.4f}: a policy reads the future"
            )


def best_peer(row: dict[str, Any]) -> tuple[str, float] | None:
    ratios = row.get("peers", {}).get("hit_ratios", {})
    if not ratios:
        return None
    name = max(ratios, key=lambda n: ratios[n])
    return name, float(ratios[name])


def summarize(results: dict[str, list[dict[str, Any]]], policies: Sequence[str]) -> dict[str, Any]:
    """Per kvwarm policy: worst difference to exact LRU (and its 95% interval, when
    the rows carry one), the settings below and above exact LRU beyond their interval,
    mean gap closed, workloads where it beats the best peer at every capacity, and
    each setting where it does not
    (``not_beaten_at``: the policy's and the best peer's hit ratios, ``tie`` when they
    are equal, as when a guard serving exact LRU meets libCacheSim's LRU)."""
    out: dict[str, Any] = {}
    for name in policies:
        worst: tuple[float, str, list[float] | None] = (math.inf, "", None)
        gaps: list[float] = []
        wins: list[str] = []
        not_beaten: list[dict[str, Any]] = []
        clearly: dict[str, list[str]] = {"below": [], "above": []}
        worst_request: tuple[float, str, list[float] | None] = (math.inf, "", None)
        fair_wins: list[str] = []
        fair_known = True
        for workload, rows in results.items():
            beats_all = beats_fairly = bool(rows)
            for row in rows:
                value = row["policies"][name]
                refs = row["references"]
                where = f"{workload} @ {row['capacity'] * 100:g}%"
                diff = value - refs["lru_exact"]
                ci = row.get("vs_lru_exact_ci95", {}).get(name)
                if diff < worst[0]:
                    worst = (diff, where, ci)
                # What counting a request's hits at its arrival gives LRU over counting
                # access by access. Results written before it was measured have it in
                # ``lru`` through the planner, which is that LRU exactly, when replayed.
                per_request = refs.get("lru_request", row["policies"].get("lru"))
                if per_request is None:
                    fair_known = False
                    per_request = refs["lru_exact"]
                counting_gain = per_request - refs["lru_exact"]
                if "lru_request" in refs and value - refs["lru_request"] < worst_request[0]:
                    ci_request = row.get("vs_lru_request_ci95", {}).get(name)
                    worst_request = (value - refs["lru_request"], where, ci_request)
                if ci and ci[1] < 0:
                    clearly["below"].append(where)
                elif ci and ci[0] > 0:
                    clearly["above"].append(where)
                gap = row["gap_closed"].get(name)
                if gap is not None and np.isfinite(gap):
                    gaps.append(float(gap))
                peer = best_peer(row)
                if peer is None or value - counting_gain <= peer[1]:
                    beats_fairly = False
                if peer is None:
                    beats_all = False
                elif value <= peer[1]:
                    beats_all = False
                    not_beaten.append(
                        {
                            "at": where,
                            "hit_ratio": value,
                            "peer": peer[0],
                            "peer_hit_ratio": peer[1],
                            "tie": math.isclose(value, peer[1], rel_tol=0.0, abs_tol=1e-12),
                        }
                    )
            if beats_all:
                wins.append(workload)
            if beats_fairly:
                fair_wins.append(workload)
        out[name] = {
            "worst_diff_to_lru": worst[0],
            "worst_at": worst[1],
            "worst_diff_ci95": worst[2],
            "clearly_below_lru": clearly["below"],
            "clearly_above_lru": clearly["above"],
            "num_rows": sum(len(rows) for rows in results.values()),
            "safe": worst[0] >= -SAFETY_TOLERANCE,
            "mean_gap_closed": float(np.mean(gaps)) if gaps else float("nan"),
            "worst_diff_to_lru_request": worst_request[0] if worst_request[1] else None,
            "worst_request_at": worst_request[1],
            "worst_request_ci95": worst_request[2],
            "beats_best_peer_on": wins,
            "beats_best_peer_beyond_counting_gain_on": fair_wins if fair_known else None,
            "not_beaten_at": not_beaten,
            "num_workloads": len(results),
        }
    return out


def _not_beaten_text(entries: Sequence[dict[str, Any]]) -> str:
    """``summarize``'s ``not_beaten_at`` as one table cell."""
    parts = []
    for e in entries:
        if e["tie"]:
            parts.append(f"{e['at']}: {e['hit_ratio']:.4f}, a tie with {e['peer']}")
        else:
            parts.append(
                f"{e['at']}: {e['hit_ratio']:.4f} against {e['peer']} {e['peer_hit_ratio']:.4f}"
            )
    return "; ".join(parts) or "-"


def markdown(results: dict[str, list[dict[str, Any]]], summary: dict[str, Any]) -> str:
    """The per-workload table and the summary, as Markdown (the README section)."""
    policies = list(summary)
    head = "| workload | cap | LRU | Belady | best peer | " + " | ".join(policies) + " |"
    lines = [head, "|" + "---|" * (5 + len(policies))]
    for workload, rows in results.items():
        for row in rows:
            refs = row["references"]
            peer = best_peer(row)
            peer_text = f"{peer[0]} {peer[1]:.3f}" if peer else "-"
            cells = []
            for name in policies:
                gap = row["gap_closed"].get(name)
                gap_text = f" ({gap * 100:+.0f}%)" if gap is not None and np.isfinite(gap) else ""
                cells.append(f"{row['policies'][name]:.3f}{gap_text}")
            lines.append(
                f"| {workload} | {row['capacity'] * 100:g}% | {refs['lru_exact']:.3f} | "
                f"{refs['belady']:.3f} | {peer_text} | " + " | ".join(cells) + " |"
            )
    lines += [
        "",
        "| policy | worst vs LRU exact (where; 95% interval) | worst vs LRU counted per "
        "request | below / above LRU exact beyond the interval | mean gap closed | beats "
        "best peer at every capacity | by more than LRU's counting gain | where not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        below, above = s.get("clearly_below_lru", []), s.get("clearly_above_lru", [])
        fair = s.get("beats_best_peer_beyond_counting_gain_on")
        request = s.get("worst_diff_to_lru_request")
        lines.append(
            f"| {name} | {_diff_text(s['worst_diff_to_lru'], s['worst_at'], s.get('worst_diff_ci95'))} | "
            + (
                _diff_text(request, s["worst_request_at"], s.get("worst_request_ci95"))
                if request is not None
                else "-"
            )
            + f" | {len(below)} ({', '.join(below) or '-'}) / {len(above)} of "
            f"{s.get('num_rows', '?')} | {s['mean_gap_closed'] * 100:.0f}% | "
            f"{_workloads_text(s['beats_best_peer_on'], s['num_workloads'])} | "
            + (_workloads_text(fair, s["num_workloads"]) if fair is not None else "-")
            + f" | {_not_beaten_text(s['not_beaten_at'])} |"
        )
    return "\n".join(lines)


def _diff_text(diff: float, where: str, ci: Sequence[float] | None) -> str:
    """``-0.0040 (chat @ 10%; -0.0070 to -0.0010)``: a difference, where, its interval."""
    ci_text = f"; {ci[0]:+.4f} to {ci[1]:+.4f}" if ci and all(map(math.isfinite, ci)) else ""
    return f"{diff:+.4f} ({where}{ci_text})"


def _workloads_text(workloads: Sequence[str], total: int) -> str:
    return f"{len(workloads)} of {total} ({', '.join(workloads) or '-'})"


def plot(results: dict[str, list[dict[str, Any]]], policies: Sequence[str], path: Path) -> Path:
    """One PNG: hit ratio vs capacity per workload (kvwarm, LRU, Belady, best peer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w, rows in results.items() if rows]
    cols = 4
    nrows = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, workload in zip(axes.flat, names, strict=False):
        rows = results[workload]
        caps = [r["capacity"] * 100 for r in rows]
        ax.plot(caps, [r["references"]["lru_exact"] for r in rows], "k--", label="LRU exact")
        ax.plot(caps, [r["references"]["belady"] for r in rows], "k:", label="Belady")
        peers = [best_peer(r) for r in rows]
        if all(p is not None for p in peers):
            ax.plot(caps, [p[1] for p in peers if p], "--", color="grey", label="best peer")
        for name in policies:
            ax.plot(caps, [r["policies"][name] for r in rows], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xticks(caps, [f"{c:g}%" for c in caps])
        ax.minorticks_off()
        ax.set_title(workload)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supylabel("block hit ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tiered(
    results: dict[str, list[dict[str, Any]]], policies: Sequence[str], path: Path
) -> Path:
    """One PNG: TTFT p50 change against no prewarm per workload and HBM capacity, for
    LRU with prewarm and every other kvwarm policy (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ["lru", *(p for p in policies if p != "lru")]
    labels: list[str] = []
    values: dict[str, list[float]] = {p: [] for p in shown}
    for workload, cap, at in tiered_settings(results):
        labels.append(f"{workload}\n{cap * 100:g}%")
        for p in shown:
            values[p].append(100 * at[p]["ttft_p50_change"] if p in at else float("nan"))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(labels) * len(shown)), 4))
    width = 0.8 / len(shown)
    x = np.arange(len(labels))
    for k, p in enumerate(shown):
        ax.bar(x + k * width, values[p], width, label="LRU+prewarm" if p == "lru" else p)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xticks(x + width * (len(shown) - 1) / 2, labels, fontsize=7)
    ax.set_ylabel("TTFT p50 vs no prewarm (%)")
    ax.set_title("Tiered: what prewarming and prediction add")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@click.command("quality")
@click.option(
    "--workloads",
    default=",".join(WORKLOADS),
    show_default=True,
    help=f"Comma-separated subset of {', '.join(WORKLOADS)}.",
)
@click.option(
    "--requests",
    "num_requests",
    type=click.IntRange(200, 200_000),
    default=2_500,
    show_default=True,
    help="Requests per generated workload.",
)
@click.option(
    "--shared-requests",
    type=click.IntRange(200, 200_000),
    default=6_000,
    show_default=True,
    help="Requests taken from the start of the shared trace.",
)
@click.option("--capacities", default="0.01,0.05,0.1", show_default=True)
@click.option(
    "--policies", default=",".join(KVWARM_POLICIES), show_default=True, help="kvwarm policies."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-peers", is_flag=True, help="Skip the libCacheSim policies.")
@click.option(
    "--guard/--no-guard",
    default=True,
    show_default=True,
    help="Learned policies behind the online guard (as served).",
)
@click.option(
    "--full-fit/--quick-fit",
    default=True,
    show_default=True,
    help="Fit learned policies as kvwarm replay does (full: its snapshot rows and the "
    "default model settings), what the suite is meant to measure, or quickly (40 trees of "
    "15 leaves: about half the time).",
)
@click.option(
    "--tiered",
    is_flag=True,
    help="Also replay every workload through the tiered simulation (TTFT p50 vs LRU with "
    "prewarm and vs no prewarm).",
)
@EVICT_AHEAD_OPTION
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/quality"),
    show_default=True,
)
def quality(
    workloads: str,
    num_requests: int,
    shared_requests: int,
    capacities: str,
    policies: str,
    seed: int,
    no_peers: bool,
    guard: bool,
    full_fit: bool,
    tiered: bool,
    evict_ahead_visits: int,
    out_dir: Path,
) -> None:
    """Replay the workload suite; print per-workload hit ratios and the summary."""
    from features.stats_cli import parse_fractions

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise click.BadParameter(f"unknown workloads {unknown}; valid: {', '.join(WORKLOADS)}")
    policy_names = [p.strip() for p in policies.split(",") if p.strip()]
    fractions = parse_fractions(capacities)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    tiered_results: dict[str, list[dict[str, Any]]] = {}
    sources: dict[str, str] = {}
    for name in names:
        t0 = time.perf_counter()
        events, source = workload_events(
            name, shared_requests if name == "shared" else num_requests, seed
        )
        sources[name] = source
        if not events:
            click.echo(f"[{name}] skipped: {source}", err=True)
            continue
        try:
            results[name] = run_workload(
                events,
                policies=policy_names,
                capacities=fractions,
                peers=not no_peers,
                guard=guard,
                quick=not full_fit,
                tiered=tiered_results.setdefault(name, []) if tiered else None,
                evict_ahead_visits=evict_ahead_visits,
            )
        except LeakError as exc:
            raise click.ClickException(f"leak check failed on {name}: {exc}") from exc
        click.echo(f"[{name}] {source}: {time.perf_counter() - t0:.0f} s", err=True)
        # Kept as it goes: a long suite that is stopped still leaves what it measured.
        (out_dir / "partial.json").write_text(
            json.dumps(_jsonable({"single": results, "tiered": tiered_results}), indent=2)
        )
    summary = summarize(results, policy_names)
    table = markdown(results, summary)
    tiered_summary: dict[str, Any] = {}
    if tiered:
        tiered_summary = summarize_tiered(tiered_results, policy_names)
        table += "\n\nTiered, TTFT p50 change against no prewarm:\n\n" + markdown_tiered(
            tiered_results, tiered_summary
        )
    click.echo(table)
    seconds = time.perf_counter() - started
    click.echo(f"\nleak check (no policy above Belady with bypass): ok on {len(results)} workloads")
    click.echo(f"took {seconds:.0f} s")
    data = {
        "config": {
            "workloads": names,
            "requests": num_requests,
            "shared_requests": shared_requests,
            "capacities": list(fractions),
            "policies": policy_names,
            "seed": seed,
            "guard": guard,
            "peers": not no_peers,
            "quick_fit": not full_fit,
            "tiered": tiered,
            "evict_ahead_visits": evict_ahead_visits,
        },
        "sources": sources,
        "results": results,
        "summary": summary,
        "tiered_results": tiered_results,
        "tiered_summary": tiered_summary,
        "seconds": seconds,
    }
    (out_dir / "results.json").write_text(json.dumps(_jsonable(data), indent=2))
    (out_dir / "summary.md").write_text(table + "\n")
    click.echo(f"plot: {plot(results, policy_names, out_dir / 'quality.png')}")
    if tiered:
        click.echo(f"plot: {plot_tiered(tiered_results, policy_names, out_dir / 'tiered.png')}")
    click.echo(f"results: {out_dir / 'results.json'}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value
