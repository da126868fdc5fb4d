"""``kvwarm bench guard``: the online guard against each of its candidates alone, on a
cold and on a warm cache.

The workload suite (``kvwarm bench quality``) replays each workload's last 40% from an
empty cache (every policy's own state has followed the first 60%), while the guard's
ghost caches follow the training tail first and are warm when that part starts. A warm
start helps frequency far more than recency, so the guard's estimates then flatter LFU
and the model against what the empty cache gets from them (``predictor.guard``'s
docstring has the figures). This benchmark replays the same split both ways, single
tier, the same planner as the suite:

- **cold**, as the suite: every candidate observes the training part, then the cache
  starts empty on the replayed part; the guard's candidates observe the training part
  up to its last ``GUARD_WARMUP_REQUESTS`` requests and the guard (ghosts included) the
  rest, as the suite's guard does;
- **warm**: the cache follows the training tail (the same last requests) through the
  same sidecar before the replayed part, and only the replayed part's hits count; the
  guard's ghosts and the cache then start the replayed part alike.

Per workload and capacity it prints the guarded model's hit ratio and the candidate it
ended on, and the best candidate alone, both ways. No libCacheSim peers: their runs are
cold (see ``kvwarm bench quality``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from features.events import BlocksAccessed
from predictor.base import Policy
from predictor.guard import GUARD_HEURISTICS
from predictor.oracle import FutureAccesses
from training.replay import replay_single_tier
from training.report import (
    fresh_policy,
    guard_warmup_split,
    guarded_policy,
    load_profile,
    time_scale_for_engine_load,
)

CANDIDATES = ("lightgbm", *GUARD_HEURISTICS)


def compare(
    train: Sequence[BlocksAccessed],
    test: Sequence[BlocksAccessed],
    model: Policy,
    capacity: int,
    warmed: dict[str, dict[str, Policy]] | None = None,
) -> dict[str, Any]:
    """Cold and warm hit ratios of every candidate alone and of the guard around them,
    for one cache of ``capacity`` blocks; ``model`` has observed nothing. The policies
    are built as the suite builds them (``training.report.fresh_policy`` and
    ``guarded_policy``); ``warmed`` keeps their prototypes that followed the training
    part (``train``) and its head (``head``) across capacities."""
    warmed = warmed if warmed is not None else {}
    trained = {"lightgbm": model}
    future = FutureAccesses.from_events([])
    head, tail = guard_warmup_split(train)
    seen = {"cold": ("train", train), "warm": ("head", head)}
    out: dict[str, Any] = {"capacity_blocks": capacity, "alone": {}, "guarded": {}}
    for mode in ("cold", "warm"):
        key, observed = seen[mode]
        warm = tail if mode == "warm" else ()
        out["alone"][mode] = {
            name: replay_single_tier(
                fresh_policy(name, trained, future, warmed.setdefault(key, {}), observed),
                test,
                capacity,
                warm=warm,
            ).hit_ratio
            for name in CANDIDATES
        }
        guard = guarded_policy(
            "lightgbm",
            capacity,
            trained,
            future,
            warmed.setdefault("head", {}),
            train,
            observe_tail=mode == "cold",
        )
        hit_ratio = replay_single_tier(guard, test, capacity, warm=warm).hit_ratio
        out["guarded"][mode] = {"hit_ratio": hit_ratio, "chosen": guard.chosen}
    return out


def row(workload: str, fraction: float, result: dict[str, Any]) -> str:
    cells = [f"| {workload} | {fraction * 100:g}% |"]
    for mode in ("cold", "warm"):
        g = result["guarded"][mode]
        alone = result["alone"][mode]
        best = max(alone, key=lambda name: alone[name])
        cells.append(f" {g['hit_ratio']:.4f} ({g['chosen']}) | {best} {alone[best]:.4f} |")
    return "".join(cells)


@click.command("guard")
@click.option("--workloads", default="chat,agent,diurnal", show_default=True)
@click.option("--requests", "num_requests", default=1_500, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--capacities", default="0.01,0.05,0.1", show_default=True)
@click.option("--quick-fit", is_flag=True, help="Fit the model in seconds (tests, demos).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def guard_bench(
    workloads: str,
    num_requests: int,
    seed: int,
    capacities: str,
    quick_fit: bool,
    out: Path | None,
) -> None:
    """The guard against each candidate alone, on a cold and a warm cache."""
    from benchmarks.quality import WORKLOADS, workload_events
    from training.replay import distinct_blocks, rescale_time, split_events, spread_ties
    from training.replay_cli import make_trainer

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise click.BadParameter(
            f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(WORKLOADS)}",
            param_hint="--workloads",
        )
    fractions = [float(f) for f in capacities.split(",") if f.strip()]
    click.echo(
        "| workload | capacity | guarded, cold | best alone, cold | guarded, warm | "
        "best alone, warm |\n|---|---|---|---|---|---|"
    )
    results: dict[str, dict[str, Any]] = {}
    for workload in names:
        events, where = workload_events(workload, num_requests, seed)
        if not events:
            click.echo(f"| {workload} | skipped: {where} |")
            continue
        events = spread_ties(events)
        # The suite's time scale (the load it offers) and split, so the rows match it.
        scale = time_scale_for_engine_load(split_events(events, 0.6)[1], load_profile(None), 0.9)
        events = rescale_time(events, scale)
        train, test = split_events(events, 0.6)
        model = make_trainer(quick_fit)("lightgbm", train, scale)
        num_distinct = distinct_blocks(test)
        results[workload] = {}
        warmed: dict[str, dict[str, Any]] = {}
        for fraction in fractions:
            capacity = max(1, int(fraction * num_distinct))
            result = compare(train, test, model, capacity, warmed)
            results[workload][f"{fraction:g}"] = result
            click.echo(row(workload, fraction, result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"seed": seed, "results": results}, indent=2))
        click.echo(f"results: {out}")
