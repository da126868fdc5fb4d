"""``kvwarm bench replay``: replay speed per policy, against plain exact LRU and
against libCacheSim's LRU and LRB on the same replayed slice, in the same run.

Block accesses per second of the single-tier replay (the sidecar loop and planner
with each policy), on the shared Mooncake trace when present (else a generated trace
of the same size), as a ratio to an exact OrderedDict LRU pass over the same block
sequence in the same process, and to libCacheSim's LRU and LRB (C, one child process
each, their own timers) on that same sequence and capacity. For LightGBM it also
prints the per-call cost of the tree evaluators side by side on the replay's own
feature rows (``Booster.predict``, LightGBM's C API by ctypes, the numpy walk of
``predictor.trees``, the generated C of ``predictor.compiled_trees``, which the policy
scores with) and where the replay's time goes (a profile); and the same LightGBM
replay with one scored eviction round per request ("lightgbm b0":
``PlannerParams.evict_ahead_visits=0``; the default batches, see ``serving.planner``),
its speed and hit ratio beside the default's.
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from benchmarks.traces import load_events
from features.annotate import access_arrays
from features.events import BlocksAccessed
from features.trace_stats import lru_hits
from predictor.base import Policy
from predictor.learned import LearnedPolicy
from predictor.registry import make_policy
from serving.planner import PlannerParams
from training.replay import (
    SingleTierResult,
    distinct_blocks,
    replay_single_tier,
    split_events,
    spread_ties,
)


def _events(trace: Path | None) -> tuple[str, list[BlocksAccessed]]:
    events, source = load_events(trace)
    return source, spread_ties(events)


@click.command("replay")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None)
@click.option("--capacity", type=float, default=0.05, show_default=True)
@click.option("--policies", default="lru,lfu,prefix_lru,lightgbm", show_default=True)
@click.option(
    "--model",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="A saved LightGBM policy directory (default: train one on the first 60%).",
)
@click.option(
    "--score-max-age-ms",
    type=click.IntRange(min=0),
    default=None,
    help="Override the learned policy's stored-score refresh rule (0: always recompute).",
)
def replay_bench(
    trace: Path | None,
    capacity: float,
    policies: str,
    model: Path | None,
    score_max_age_ms: int | None,
) -> None:
    """Single-tier replay speed per policy vs an exact LRU pass (same process)."""
    name, events = _events(trace)
    train, test = split_events(events, 0.6)
    cap = max(1, int(capacity * distinct_blocks(test)))
    arrays = access_arrays(test)
    ids = arrays.block_ids
    t0 = time.perf_counter()
    lru_hits(ids, cap)
    base_rate = ids.shape[0] / (time.perf_counter() - t0)
    click.echo(
        f"trace: {name}; replayed {len(test):,} requests, {ids.shape[0]:,} block accesses; capacity {capacity:g} ({cap:,} blocks)"
    )
    click.echo(f"baseline exact LRU (OrderedDict): {base_rate:,.0f} accesses/s")
    from training.peers import peer_hit_ratios

    peer_rates: dict[str, float] = {}
    for peer, res in peer_hit_ratios(ids, cap, ("LRU", "LRB"), arrays.ts_ms).items():
        if res.error is None and res.elapsed_s > 0:
            peer_rates[peer] = ids.shape[0] / res.elapsed_s
            click.echo(
                f"libCacheSim {peer}: {peer_rates[peer]:,.0f} accesses/s, hit ratio "
                f"{(res.num_hits or 0) / max(ids.shape[0], 1):.4f} (same slice and capacity)"
            )
        else:
            click.echo(f"libCacheSim {peer}: unavailable ({res.error})")
    lrb = peer_rates.get("LRB")
    click.echo(
        f"{'policy':>12} {'accesses/s':>12} {'vs LRU pass':>12} {'vs LCS LRB':>11} {'hit ratio':>10}"
    )
    profile_text = evaluator_text = ""
    for policy_name in [p.strip() for p in policies.split(",") if p.strip()]:
        policy: Policy
        if policy_name == "lightgbm" and model is not None:
            from predictor.lightgbm_policy import LightGBMPolicy

            policy = LightGBMPolicy.load(model)
        elif policy_name in ("lightgbm", "lstm"):
            from training.train import fit_policy_on_events

            policy = fit_policy_on_events(policy_name, train, quick=False)
        else:
            policy = make_policy(policy_name)
        if score_max_age_ms is not None and isinstance(policy, LearnedPolicy):
            policy.set_score_max_age(score_max_age_ms)
        policy.observe_many(train)
        # Copies made before the clock starts: copying a warm state is not replay work.
        runs = [copy.deepcopy(policy) for _ in range(3 if policy_name == "lightgbm" else 1)]
        result = replay_single_tier(runs[0], test, cap)
        click.echo(_row(policy_name, result, base_rate, lrb))
        if policy_name == "lightgbm":
            # The same with one scored round per request (the default batches eviction).
            per_request = PlannerParams(evict_ahead_visits=0)
            result = replay_single_tier(runs[2], test, cap, planner_params=per_request)
            click.echo(_row(f"{policy_name} b0", result, base_rate, lrb))
        if policy_name == "lightgbm" and isinstance(policy, LearnedPolicy):
            evaluator_text = _evaluators(policy, test)
            profiler = cProfile.Profile()
            profiler.enable()
            replay_single_tier(runs[1], test[: len(test) // 4], cap)
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(8)
            profile_text = out.getvalue()
    if evaluator_text:
        click.echo(evaluator_text)
    if profile_text:
        click.echo("\nwhere the time goes (lightgbm, first quarter of the replay, by own time):")
        click.echo("\n".join(line for line in profile_text.splitlines() if line.strip())[:3000])


def _row(label: str, result: SingleTierResult, base_rate: float, lrb: float | None) -> str:
    vs_lrb = f"{result.accesses_per_s / lrb:>10.3f}x" if lrb else f"{'-':>11}"
    return (
        f"{label:>12} {result.accesses_per_s:>12,.0f} "
        f"{result.accesses_per_s / base_rate:>11.3f}x {vs_lrb} {result.hit_ratio:>10.4f}"
    )


_EVALUATOR_POOL_ROWS = 4_000
"""Distinct feature rows the evaluator timings cycle through (2,000-3,000 per size)."""


def fresh_slices(pool: np.ndarray, n: int, reps: int) -> list[np.ndarray]:
    """``reps`` slices of ``n`` consecutive rows of ``pool``, each starting where the
    last ended (wrapping round; a slice that would run past the end starts again at
    row 0), so that no two slices share rows while the pool holds ``n * reps`` rows.
    A pool of fewer than ``n`` rows gives the whole pool ``reps`` times."""
    if pool.shape[0] < max(n, 1):
        return [pool] * reps
    out, start = [], 0
    for _ in range(reps):
        if start + n > pool.shape[0]:
            start = 0
        out.append(pool[start : start + n])
        start += n
    return out


def _evaluators(policy: LearnedPolicy, events: list[BlocksAccessed]) -> str:
    """Per-call cost of each tree evaluator on the replay's own feature rows, and the
    largest difference from ``Booster.predict``.

    Every timed call gets rows it has not seen (consecutive slices of a pool of
    ``_EVALUATOR_POOL_ROWS``): called again and again on the same rows, the CPU's
    branch predictor learns their paths and the compiled trees look ~5x cheaper per
    row than they are in a replay, where each call brings new blocks."""
    from predictor.lightgbm_policy import LightGBMPolicy, predict_rows
    from predictor.trees import parse_lightgbm_model

    if not isinstance(policy, LightGBMPolicy) or policy.booster is None:
        return ""
    booster = policy.booster
    ensemble = policy.trees or parse_lightgbm_model(booster.model_to_string())
    state = copy.deepcopy(policy.state)
    state.observe_many(events[: len(events) // 2])
    hashes = state.tracked_hashes()[:_EVALUATOR_POOL_ROWS]
    pool = state.features_for(hashes, state.clock_ms)
    x = pool[:1000]
    lines = [
        f"\ntree evaluators on the replay's feature rows ({ensemble.num_trees} trees, "
        f"depth {ensemble.max_depth}), us per call (max abs diff vs Booster.predict):"
    ]
    reference = np.asarray(booster.predict(x, num_threads=1))
    evaluators: dict[str, Callable[[np.ndarray], Any]] = {
        "Booster.predict": lambda rows: booster.predict(rows, num_threads=1),
        "C API ForMat (ctypes)": lambda rows: predict_rows(booster, rows),
        "numpy tree walk": ensemble.predict,
    }
    if policy.compiled is not None:
        compiled = policy.compiled
        evaluators["compiled C (generated)"] = lambda rows: ensemble.transform(
            compiled.predict_raw(rows)
        )
    else:
        lines.append(f"  (not compiled: {policy.evaluator})")
    for name, fn in evaluators.items():
        diff = float(np.abs(np.asarray(fn(x)) - reference).max()) if x.shape[0] else 0.0
        cells = []
        for n in (1, 16, 128, 1000):
            reps = max(3, 2000 // max(n, 1))
            slices = fresh_slices(pool, n, reps)
            t0 = time.perf_counter()
            for rows in slices:
                fn(rows)
            cells.append(f"{n} rows {(time.perf_counter() - t0) / reps * 1e6:,.0f}")
        lines.append(f"  {name:>22}: {', '.join(cells)} (diff {diff:.1e})")
    return "\n".join(lines)
