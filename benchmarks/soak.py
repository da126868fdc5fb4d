"""``kvwarm bench soak``: resident memory per policy over millions of distinct blocks.

Each policy runs in a fresh child process (so one policy's freed memory never hides
another's growth) and is fed requests of ``--blocks-per-request`` never-seen blocks,
the way the sidecar feeds it: ``observe`` then ``score`` of the request's blocks. The
child samples its RSS (``/proc/self/statm``) at ``--samples`` points. Reported per
policy: RSS at the start and at 25/50/75/100% of the stream, the growth over the last
quarter (a plateau is ~0 once the cap is reached), and the ratio of the final RSS to
the same stream on an uncapped LRU (``lru-uncapped``, the pre-cap behaviour) run by
the same command.

Learned policies (``lightgbm``) get a tiny model fitted in the child on synthetic rows:
what is measured is their online feature state, which is what grows with blocks.
``guarded`` is that model behind the online guard as ``kvwarm serve`` runs it by default
(the default tiers: ghosts at HBM's size and at HBM + DRAM's, the LRU, LFU and LRU-2
heuristics beside the model, sharing one block table): what the sidecar holds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import click
import numpy as np

from features.events import BlocksAccessed

DEFAULT_POLICIES = ("lru-uncapped", "lru", "lfu", "prefix_lru", "lightgbm", "guarded")


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _make(name: str, max_tracked_blocks: int | None) -> Any:
    from predictor.registry import make_policy

    if name == "guarded":
        from predictor.guard import guarded, memory_capacity_blocks, profile_outer_weight
        from serving.settings import SidecarSettings

        tiers = SidecarSettings.model_fields
        names = tiers["tier_names"].default
        capacities = tiers["tier_capacities_blocks"].default
        return guarded(
            _make("lightgbm", max_tracked_blocks),
            capacities[0],
            outer_capacity_blocks=memory_capacity_blocks(names, capacities),
            outer_weight=profile_outer_weight(names),
        )

    if name == "lru-uncapped":
        return make_policy("lru", {"max_tracked_blocks": 1 << 31})
    if name in ("lru", "lfu", "prefix_lru"):
        params = {} if max_tracked_blocks is None else {"max_tracked_blocks": max_tracked_blocks}
        return make_policy(name, params)
    policy: Any = make_policy(name, {"num_boost_round": 3, "min_data_in_leaf": 5, "num_leaves": 4})
    if max_tracked_blocks is not None:
        from dataclasses import replace

        policy = type(policy)(
            policy.params, replace(policy.feature_params, max_tracked_blocks=max_tracked_blocks)
        )
    rng = np.random.default_rng(0)
    x = rng.random((400, len(policy.feature_names)), dtype=np.float32)
    y = x[:, 0] > 0.5
    return policy.fit(x[:300], y[:300], x[300:], y[300:])


def _soak(
    name: str, num_blocks: int, per_request: int, samples: int, cap: int | None, out: Any
) -> None:
    """Child process: feed ``num_blocks`` distinct blocks, send (blocks, RSS MB) samples."""
    policy = _make(name, cap)
    num_requests = num_blocks // per_request
    every = max(1, num_requests // samples)
    points = [(0, _rss_mb())]
    t0 = time.perf_counter()
    offsets = np.arange(per_request, dtype=np.uint64)
    for i in range(num_requests):
        first = i * per_request + 1
        hashes = tuple(range(first, first + per_request))
        policy.observe(
            BlocksAccessed(ts_ms=i, request_id=str(i), block_hashes=hashes, block_size_tokens=16)
        )
        policy.score(offsets + np.uint64(first), i)
        if (i + 1) % every == 0:
            points.append(((i + 1) * per_request, _rss_mb()))
    out.send({"points": points, "seconds": time.perf_counter() - t0})
    out.close()


def run_soak(
    policies: list[str], num_blocks: int, per_request: int, samples: int, cap: int | None
) -> dict[str, dict[str, Any]]:
    """Run each policy in a spawned child; returns name -> {points, seconds}."""
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_soak, args=(name, num_blocks, per_request, samples, cap, child))
        proc.start()
        child.close()
        results[name] = parent.recv()
        proc.join()
    return results


def _at(points: list[tuple[int, float]], fraction: float) -> float:
    target = points[-1][0] * fraction
    return min(points, key=lambda p: abs(p[0] - target))[1]


@click.command("soak")
@click.option("--blocks", "num_blocks", default=5_000_000, show_default=True,
              help="Distinct blocks fed to each policy.")  # fmt: skip
@click.option("--blocks-per-request", "per_request", default=16, show_default=True)
@click.option("--samples", default=20, show_default=True, help="RSS samples per policy.")
@click.option("--policies", default=",".join(DEFAULT_POLICIES), show_default=True,
              help="Comma-separated; lru-uncapped is LRU with no tracking cap.")  # fmt: skip
@click.option("--max-tracked-blocks", "cap", type=int, default=None,
              help="Override every policy's cap (default: each policy's own default); "
                   "for guarded, the model's feature state only (its heuristics keep theirs).")  # fmt: skip
def soak(num_blocks: int, per_request: int, samples: int, policies: str, cap: int | None) -> None:
    """RSS per policy over millions of distinct blocks: does it plateau?"""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    results = run_soak(names, num_blocks, per_request, samples, cap)
    baseline = results.get("lru-uncapped")
    click.echo(
        f"{'policy':<14}{'start':>7}{'25%':>7}{'50%':>7}{'75%':>7}{'end MB':>8}"
        f"{'last-quarter growth':>21}{'vs uncapped LRU':>17}{'seconds':>9}"
    )
    for name, r in results.items():
        pts = r["points"]
        marks = [pts[0][1], _at(pts, 0.25), _at(pts, 0.5), _at(pts, 0.75), pts[-1][1]]
        ratio = f"{marks[-1] / baseline['points'][-1][1]:.2f}x" if baseline else "-"
        cells = "".join(f"{m:>7.0f}" for m in marks[:4]) + f"{marks[4]:>8.0f}"
        click.echo(
            f"{name:<14}{cells}{marks[4] - marks[3]:>+19.0f}MB{ratio:>17}{r['seconds']:>9.1f}"
        )
    click.echo(f"({num_blocks:,} distinct blocks, {per_request} per request, one child per policy)")
