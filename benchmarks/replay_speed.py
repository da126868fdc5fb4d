"""``kvwarm bench replay``: replay speed per policy, against plain exact LRU.

Block accesses per second of the single-tier replay (the sidecar loop and planner
with each policy), on the shared Mooncake trace when present (else a generated trace
of the same size), as a ratio to an exact OrderedDict LRU pass over the same block
sequence in the same process. Where the time goes is printed from a profile of the
learned policy's run.
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import time
from pathlib import Path

import click

from benchmarks.traces import load_events
from features.annotate import access_arrays
from features.events import BlocksAccessed
from features.trace_stats import lru_hits
from predictor.base import Policy
from predictor.registry import make_policy
from training.replay import distinct_blocks, replay_single_tier, split_events, spread_ties


def _events(trace: Path | None) -> tuple[str, list[BlocksAccessed]]:
    events, source = load_events(trace)
    return source, spread_ties(events)


@click.command("replay")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None)
@click.option("--capacity", type=float, default=0.05, show_default=True)
@click.option("--policies", default="lru,lfu,prefix_lru,lightgbm", show_default=True)
def replay_bench(trace: Path | None, capacity: float, policies: str) -> None:
    """Single-tier replay speed per policy vs an exact LRU pass (same process)."""
    name, events = _events(trace)
    train, test = split_events(events, 0.6)
    cap = max(1, int(capacity * distinct_blocks(test)))
    ids = access_arrays(test).block_ids
    t0 = time.perf_counter()
    lru_hits(ids, cap)
    base_rate = ids.shape[0] / (time.perf_counter() - t0)
    click.echo(
        f"trace: {name}; replayed {len(test):,} requests, {ids.shape[0]:,} block accesses; capacity {capacity:g} ({cap:,} blocks)"
    )
    click.echo(f"baseline exact LRU (OrderedDict): {base_rate:,.0f} accesses/s")
    click.echo(f"{'policy':>12} {'accesses/s':>12} {'vs LRU pass':>12} {'hit ratio':>10}")
    profile_text = ""
    for policy_name in [p.strip() for p in policies.split(",") if p.strip()]:
        policy: Policy
        if policy_name in ("lightgbm", "lstm"):
            from training.train import fit_policy_on_events

            policy = fit_policy_on_events(policy_name, train, quick=False)
        else:
            policy = make_policy(policy_name)
        policy.observe_many(train)
        result = replay_single_tier(copy.deepcopy(policy), test, cap)
        click.echo(
            f"{policy_name:>12} {result.accesses_per_s:>12,.0f} {result.accesses_per_s / base_rate:>11.3f}x {result.hit_ratio:>10.4f}"
        )
        if policy_name == "lightgbm":
            profiler = cProfile.Profile()
            profiler.enable()
            replay_single_tier(copy.deepcopy(policy), test[: len(test) // 4], cap)
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(8)
            profile_text = out.getvalue()
    if profile_text:
        click.echo("\nwhere the time goes (lightgbm, first quarter of the replay, by own time):")
        click.echo("\n".join(line for line in profile_text.splitlines() if line.strip())[:3000])
