"""The replay comparison: every policy, every capacity, both modes, one run.

``run_comparison(events, config)`` splits the trace by time, trains the learned
policies on the first part (or loads given models), then replays the rest through the
sidecar loop for every policy and capacity:

- single tier (demand caching): hit ratios of kvwarm's policies through the planner,
  exact LRU / Belady / Belady-with-bypass on the same block sequence, and
  libCacheSim's policies on the same sequence; share of the LRU-to-Belady gap closed.
- tiered with prefetch (``submit_tiered``, ``tiered_rows``): TTFT percentiles, throughput, per-tier hit
  ratios, bytes moved, prefetch precision and timeliness, against "no cache" (HBM
  only) and "no prewarm" (LRU, loads booked when the request is scheduled), with the
  oracle as the upper reference; open loop or closed loop (``concurrency``).

Each (capacity, policy) replay of either setting is a job of a
``training.replay_pool.JobRunner``: on worker processes, side by side, when the replayed
part is long enough (the tables are the same as a serial run's: each job replays an
exact copy of the policy state the serial run would), here otherwise.

Results are plain dicts (``ComparisonReport.to_dict``) so they go to JSON, MLflow and
the README table unchanged.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from executor.sim.profile import Profile, load_profile
from features.annotate import access_arrays
from features.events import BlocksAccessed
from features.trace_stats import fmt_number
from predictor.base import Policy
from predictor.guard import GuardedPolicy, memory_capacity_blocks, profile_outer_weight
from predictor.learned import LearnedPolicy
from predictor.oracle import FutureAccesses
from predictor.registry import make_policy
from serving.planner import DEFAULT_EVICT_AHEAD_VISITS, PlannerParams
from training.replay import (
    SingleTierResult,
    distinct_blocks,
    gap_closed,
    replay_single_tier,
    rescale_time,
    single_tier_references,
    split_events,
    spread_ties,
)
from training.replay_pool import Job, JobRunner, Shared, planned_workers
from training.tiered import (
    TieredResult,
    TieredSetup,
    replay_tiered,
    time_scale_for_engine_load,
)

log = logging.getLogger(__name__)

LEARNED = ("lightgbm", "lstm")
DEFAULT_POLICIES = ("lru", "lfu", "prefix_lru", "lightgbm", "lstm", "oracle")
NO_PREWARM = "no_prewarm"
NO_CACHE = "no_cache"

Trainer = Callable[[str, Sequence[BlocksAccessed], float], Policy]
"""(policy name, training events, time scale) -> a trained policy. The events are the
replay's, stretched by the time scale; a trainer scales its time horizons by it so the
model predicts the same thing it would on the original trace."""


@dataclass
class ComparisonConfig:
    policies: tuple[str, ...] = DEFAULT_POLICIES
    capacities: tuple[float, ...] = (0.01, 0.05, 0.1)
    train_fraction: float = 0.6
    modes: tuple[str, ...] = ("single", "tiered")
    profile: str | None = None
    load: float = 0.9
    """Open loop: load offered to one node (prefill, and decode as measured at that
    prefill load) if nothing were cached, in 90% of the trace's windows
    (``training.tiered.time_scale_for_engine_load``): sets the time scale."""
    concurrency: int | None = None
    """Tiered mode: closed loop with this many requests in flight (None: open loop)."""
    think_ms: float = 0.0
    """Closed loop: mean think time between a client's requests (exponential)."""
    peers: bool = True
    eviction_sample: int = 64
    evict_ahead_visits: int = DEFAULT_EVICT_AHEAD_VISITS
    """Batched eviction (``PlannerParams.evict_ahead_visits``; 0: one round per request)."""
    seed: int = 0
    guard: bool = True
    """Serve learned policies behind the online guard (``predictor.guard``), as serving does."""


@dataclass
class ComparisonReport:
    config: dict[str, Any]
    trace: dict[str, Any]
    single: list[dict[str, Any]] = field(default_factory=list)
    tiered: list[dict[str, Any]] = field(default_factory=list)
    training: dict[str, Any] = field(default_factory=dict)
    tiered_ttft: dict[str, Any] = field(default_factory=dict)  # (policy, capacity) -> ttft array
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "trace": self.trace,
            "training": self.training,
            "single": self.single,
            "tiered": self.tiered,
            "seconds": self.seconds,
        }


def trace_checksum(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fresh_policy(
    name: str,
    trained: dict[str, Policy],
    future: FutureAccesses,
    warm: dict[str, Policy],
    train: Sequence[BlocksAccessed],
) -> Policy:
    """A policy that has observed the training part, copied from a warmed prototype."""
    if name not in warm:
        if name in trained:
            policy = trained[name]
            policy = (
                policy.fresh_copy() if isinstance(policy, LearnedPolicy) else copy.deepcopy(policy)
            )
        elif name == "oracle":
            policy = make_policy("oracle", future=future)
        else:
            policy = make_policy(name)
        policy.observe_many(train)
        warm[name] = policy
    return copy.deepcopy(warm[name])


GUARD_WARMUP_REQUESTS = 2_000
"""The guard's ghost caches are warmed on this many last training requests (the
candidates on all of it); its choice is made before the replayed part starts."""


def guard_warmup_split(
    train: Sequence[BlocksAccessed],
) -> tuple[Sequence[BlocksAccessed], Sequence[BlocksAccessed]]:
    """(head, tail) of the training part: the guard's candidates observe the head in
    bulk, the guard itself the last ``GUARD_WARMUP_REQUESTS`` requests."""
    cut = max(0, len(train) - GUARD_WARMUP_REQUESTS)
    return train[:cut], train[cut:]


def guarded_policy(
    name: str,
    capacity_blocks: int,
    trained: dict[str, Policy],
    future: FutureAccesses,
    warm_head: dict[str, Policy],
    train: Sequence[BlocksAccessed],
    outer_capacity_blocks: int | None = None,
    *,
    outer_weight: float = 0.5,
    observe_tail: bool = True,
) -> GuardedPolicy:
    """``name`` behind the online guard for a fast tier of ``capacity_blocks``: the
    candidates observe the training part batched up to its last
    ``GUARD_WARMUP_REQUESTS`` requests (``guard_warmup_split``), the guard (ghosts
    included) the rest; ``observe_tail`` False leaves the rest to the caller (a replay
    that handles it through the served cache too)."""
    from predictor.guard import GUARD_HEURISTICS, GuardParams

    head, tail = guard_warmup_split(train)
    candidates = {
        n: fresh_policy(n, trained, future, warm_head, head) for n in (name, *GUARD_HEURISTICS)
    }
    guard = GuardedPolicy(
        GuardParams(
            capacity_blocks=capacity_blocks,
            outer_capacity_blocks=outer_capacity_blocks,
            outer_weight=outer_weight,
        ),
        candidates,
    )
    if observe_tail:
        guard.observe_many(tail)
        guard.restart_estimates()
    return guard


def time_base_warning(name: str, model: Policy, replay_scale: float) -> str | None:
    """Why a given model's scores mean less on this replay, or None: it was trained on
    event time stretched ``time_scale`` times (``LearnedPolicy.time_base``) and the
    replay stretches the trace ``replay_scale`` times (to offer ``--load``), so every
    gap it sees (think times, time since last access, its horizon) is off by their
    ratio."""
    time_base = getattr(model, "time_base", None)
    if not isinstance(time_base, dict):
        return None
    trained_scale = float(time_base.get("time_scale", 1.0) or 1.0)
    ratio = replay_scale / trained_scale
    if abs(ratio - 1.0) <= 0.01:
        return None
    return (
        f"{name} was trained on time stretched x{trained_scale:g}, this replay stretches the "
        f"trace x{replay_scale:.3g} (to offer --load): every time gap the model sees is "
        f"{ratio:.3g}x what it learned on, so its figures understate it. Let replay train "
        "it (leave out --model), or train it on a trace whose timestamps are stretched "
        "as much, with the horizon stretched too"
    )


def run_comparison(
    events: Sequence[BlocksAccessed],
    config: ComparisonConfig,
    *,
    trainer: Trainer | None = None,
    trained: dict[str, Policy] | None = None,
    progress: Callable[[str], Any] | None = None,
) -> ComparisonReport:
    """Train (or take) the learned policies, replay every policy at every capacity."""
    started = time.perf_counter()
    say = progress or (lambda message: log.info(message))
    profile: Profile = load_profile(config.profile)
    events = spread_ties(list(events))
    # The load is set on the replayed part: the one whose TTFT is measured.
    scale = time_scale_for_engine_load(
        split_events(events, config.train_fraction)[1], profile, config.load
    )
    events = rescale_time(events, scale)
    train, test = split_events(events, config.train_fraction)
    if not test:
        raise ValueError("nothing left to replay: lower --train-fraction or give a longer trace")
    num_distinct = distinct_blocks(test)
    report = ComparisonReport(
        config={**config.__dict__, "profile": profile.name, "time_scale": scale},
        trace={
            "requests": len(events),
            "train_requests": len(train),
            "replay_requests": len(test),
            "replay_block_accesses": sum(len(e.block_hashes) for e in test),
            "replay_distinct_blocks": num_distinct,
        },
    )
    trained = dict(trained or {})
    for name, model in trained.items():
        warning = time_base_warning(name, model, scale)
        if warning:
            say(f"warning: {warning}")
            report.training[name] = {"given": True, "time_base_warning": warning}
    for name in config.policies:
        if name in LEARNED and name not in trained:
            if trainer is None:
                raise ValueError(
                    f"policy {name!r} needs training or a model, and no trainer was given"
                )
            say(f"training {name} on {len(train):,} requests")
            t0 = time.perf_counter()
            trained[name] = trainer(name, train, scale)
            report.training[name] = {"seconds": time.perf_counter() - t0}
            report.training[name]["model_size_bytes"] = _saved_size_bytes(trained[name])
            info = getattr(trained[name], "training_info", {})
            for key in ("horizon", "fit", "chain_blend"):  # what training chose, and why
                if info.get(key):
                    say(info[key])
                    report.training[name][key] = info[key]
    future = (
        FutureAccesses(access_arrays(events))
        if "oracle" in config.policies
        else FutureAccesses(access_arrays([]))
    )
    warm: dict[str, Policy] = {}
    warm_head: dict[str, Policy] = {}

    def fresh(
        name: str,
        capacity_blocks: int,
        outer_capacity_blocks: int | None = None,
        outer_weight: float = 0.5,
    ) -> Policy:
        if config.guard and name in LEARNED:
            return guarded_policy(
                name,
                capacity_blocks,
                trained,
                future,
                warm_head,
                train,
                outer_capacity_blocks,
                outer_weight=outer_weight,
            )
        return fresh_policy(name, trained, future, warm, train)

    planner = PlannerParams(
        eviction_sample=config.eviction_sample,
        evict_ahead_visits=config.evict_ahead_visits,
        seed=config.seed,
    )
    # Every (capacity, policy) replay is a job: side by side on the usable cores when
    # they are long enough (``training.replay_pool``; the same figures either way).
    # Jobs are queued capacity by capacity and read back in the same order.
    modes = config.modes
    per_capacity = len(config.policies) * (("single" in modes) + ("tiered" in modes)) + 2
    accesses = int(report.trace["replay_block_accesses"])
    workers = planned_workers(per_capacity * len(config.capacities), accesses)
    with JobRunner(workers) as runner:
        if runner.parallel:
            say(f"replaying side by side on {workers} worker processes")
        trace = runner.share(list(test))
        queued: list[tuple[float, int, dict[str, Job], TieredSetup | None, list[Job]]] = []
        for fraction in config.capacities:
            capacity = max(1, int(fraction * num_distinct))
            single: dict[str, Job] = {}
            if "single" in modes:
                say(f"single tier, capacity {fraction:g} ({capacity:,} blocks)")
                for name in config.policies:
                    single[name] = runner.submit(
                        _single_tier_job, fresh(name, capacity), trace, capacity, planner
                    )
            setup: TieredSetup | None = None
            tiered: list[Job] = []
            if "tiered" in modes:
                say(f"tiered with prefetch, HBM capacity {fraction:g} ({capacity:,} blocks)")
                setup = TieredSetup(
                    profile=profile,
                    hbm_capacity_blocks=capacity,
                    planner=planner,
                    concurrency=config.concurrency,
                    think_ms=config.think_ms,
                    seed=config.seed,
                )
                make = functools.partial(
                    fresh,
                    capacity_blocks=capacity,
                    outer_capacity_blocks=memory_capacity_blocks(
                        setup.profile.tier_names, setup.capacities_blocks()
                    ),
                    outer_weight=profile_outer_weight(setup.profile.tier_names, setup.profile),
                )
                tiered = submit_tiered(runner, make, config.policies, trace, setup)
            queued.append((fraction, capacity, single, setup, tiered))
        for fraction, capacity, single, setup, tiered in queued:
            if single:
                refs, by_request = single_tier_references(test, capacity)
                rows: dict[str, float] = {}
                seconds: dict[str, float] = {}
                guard_choice: dict[str, Any] = {}
                vs_lru: dict[str, list[float]] = {}
                vs_lru_request: dict[str, list[float]] = {}
                for name, job in single.items():
                    result, guard = job.result()
                    rows[name] = result.hit_ratio
                    seconds[name] = result.seconds
                    for base, into in (
                        (by_request.lru_exact, vs_lru),
                        (by_request.lru_request, vs_lru_request),
                    ):
                        into[name] = list(
                            hit_difference_interval(
                                result.hits_by_request, base, by_request.accesses
                            )
                        )
                    if guard is not None:
                        guard_choice[name] = guard
                peers: dict[str, Any] = {}
                if config.peers:
                    peers = _peer_ratios(test, capacity)
                report.single.append(
                    {
                        "capacity": fraction,
                        "capacity_blocks": capacity,
                        "references": refs,
                        "policies": rows,
                        "policy_seconds": seconds,
                        "guard": guard_choice,
                        "vs_lru_exact_ci95": vs_lru,
                        "vs_lru_request_ci95": vs_lru_request,
                        "peers": peers,
                        "gap_closed": {
                            name: gap_closed(v, refs["lru_exact"], refs["belady"])
                            for name, v in {**rows, **peers.get("hit_ratios", {})}.items()
                        },
                    }
                )
            if setup is not None:
                report.tiered.extend(
                    tiered_rows(
                        [job.result() for job in tiered],
                        setup,
                        fraction=fraction,
                        ttft=report.tiered_ttft,
                    )
                )
    report.seconds = time.perf_counter() - started
    return report


def submit_tiered(
    runner: JobRunner,
    make: Callable[[str], Policy],
    policies: Sequence[str],
    events: Sequence[BlocksAccessed] | Shared,
    setup: TieredSetup,
) -> list[Job]:
    """The tiered replays of one setting as jobs of ``runner``: the two baselines
    (``no_cache``: HBM only; ``no_prewarm``: LRU over every tier, loads at scheduling),
    then each policy with prewarming. ``make(name)`` returns a fresh policy that has
    observed the training part."""
    return [
        runner.submit(
            _tiered_job, make("lru"), events, setup,
            {"prewarm": True, "speculative": False, "external": False, "label": NO_CACHE},
        ),
        runner.submit(
            _tiered_job, make("lru"), events, setup,
            {"prewarm": False, "speculative": False, "label": NO_PREWARM},
        ),
        *(runner.submit(_tiered_job, make(name), events, setup, {"label": name})
          for name in policies),
    ]  # fmt: skip


def tiered_rows(
    results: Sequence[TieredResult],
    setup: TieredSetup,
    *,
    fraction: float = 0.0,
    ttft: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The tiered table of one setting from its replays (``submit_tiered``'s order):
    each row with its TTFT and throughput change against both baselines."""
    rows: list[dict[str, Any]] = []
    lru_prewarm = next((r for r in results[2:] if r.policy == "lru" and r.prewarm), None)
    as_dicts = [r.to_dict() for r in results]  # percentiles once per replay
    for r, row in zip(results, as_dicts, strict=True):
        if lru_prewarm is not None and r is not lru_prewarm:
            row["paired_vs_lru_prewarm"] = paired_ttft(r.ttft_ms, lru_prewarm.ttft_ms)
        row["capacity"] = fraction
        row["hbm_capacity_blocks"] = setup.hbm_capacity_blocks
        for base, base_row, suffix in (
            (results[1], as_dicts[1], ""),
            (results[0], as_dicts[0], "_vs_no_cache"),
        ):
            p50 = base_row["ttft_ms"]["p50"]
            row[f"ttft_p50_change{suffix}"] = (
                row["ttft_ms"]["p50"] / p50 - 1 if p50 else float("nan")
            )
            row[f"throughput_change{suffix}"] = (
                r.throughput_rps / base.throughput_rps - 1 if base.throughput_rps else float("nan")
            )
        rows.append(row)
        if ttft is not None:
            ttft[f"{r.policy}@{fraction:g}"] = r.ttft_ms
    return rows


PAIRED_TOLERANCE = 0.01
"""A request is faster or slower than under another policy when its TTFT differs by
more than this share."""


def paired_ttft(ttft_ms: np.ndarray, base_ms: np.ndarray) -> dict[str, Any]:
    """Request by request against ``base_ms`` (the same requests, same order, under
    another policy): how many are faster and slower by more than ``PAIRED_TOLERANCE``,
    and the change of the mean TTFT. What the percentiles hide: a p50 that moves
    because a few requests crossed a gap in the CDF, or a mean carried by a tail; and
    the interval of the p50 ratio (``p50_ratio_interval``)."""
    if len(ttft_ms) != len(base_ms) or len(base_ms) == 0:
        return {}
    a = np.asarray(ttft_ms, dtype=np.float64)
    b = np.asarray(base_ms, dtype=np.float64)
    base_mean = float(b.mean())
    return {
        "faster": int((a < b * (1 - PAIRED_TOLERANCE)).sum()),
        "slower": int((a > b * (1 + PAIRED_TOLERANCE)).sum()),
        "mean_change": float(a.mean()) / base_mean - 1 if base_mean else float("nan"),
        "p50_ratio_ci95": list(p50_ratio_interval(a, b)),
    }


BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_CHUNK_CELLS = 2_000_000
"""Resampled TTFTs held at once (16 MB of float64), whatever the number of requests."""


def p50_ratio_interval(
    ttft_ms: np.ndarray,
    base_ms: np.ndarray,
    *,
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """A paired bootstrap interval of ``p50(ttft_ms) / p50(base_ms)``: the requests are
    resampled with replacement, the same ones for both policies, ``resamples`` times
    (seeded: the same inputs give the same interval). How far the p50 ratio of a few
    hundred requests moves when the sample does; a ratio whose interval spans 1.0 is
    not told apart from no change by this many requests."""
    a = np.asarray(ttft_ms, dtype=np.float64)
    b = np.asarray(base_ms, dtype=np.float64)
    n = len(a)
    if n == 0 or len(b) != n:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    step = max(1, BOOTSTRAP_CHUNK_CELLS // n)
    for start in range(0, resamples, step):
        rows = min(step, resamples - start)
        idx = rng.integers(0, n, size=(rows, n))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios[start : start + rows] = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.nanquantile(ratios, [tail, 1.0 - tail])
    return (float(lo), float(hi))


HIT_BOOTSTRAP_BLOCK_REQUESTS = 50
"""Requests per resampled block of ``hit_difference_interval``: a conversation's turns,
an agent's tool loop and the cache's own state tie neighbouring requests' hits together,
so requests are resampled in runs, not one by one."""


def hit_difference_interval(
    hits: np.ndarray,
    base_hits: np.ndarray,
    accesses: np.ndarray,
    *,
    block_requests: int = HIT_BOOTSTRAP_BLOCK_REQUESTS,
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """A paired bootstrap interval of ``(sum(hits) - sum(base_hits)) / sum(accesses)``:
    the hit-ratio difference of two policies replayed on the same requests (one entry
    per request, in order). Runs of ``block_requests`` consecutive requests (circular)
    are resampled with replacement, the same runs for both policies, ``resamples`` times
    (seeded). A difference whose interval spans 0 is not told apart from none by this
    many requests."""
    a = np.asarray(hits, dtype=np.float64)
    b = np.asarray(base_hits, dtype=np.float64)
    n_acc = np.asarray(accesses, dtype=np.float64)
    n = len(a)
    if n == 0 or len(b) != n or len(n_acc) != n or n_acc.sum() <= 0:
        return (float("nan"), float("nan"))
    run = max(1, min(block_requests, n))

    def run_sums(x: np.ndarray) -> np.ndarray:  # sum of x[s : s + run], wrapping, per s
        total = np.concatenate(([0.0], np.cumsum(np.concatenate((x, x[: run - 1])))))
        return total[run : run + n] - total[:n]

    diff, acc = run_sums(a - b), run_sums(n_acc)
    starts = np.random.default_rng(seed).integers(0, n, size=(resamples, -(-n // run)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = diff[starts].sum(axis=1) / acc[starts].sum(axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.nanquantile(ratios, [tail, 1.0 - tail])
    return (float(lo), float(hi))


def _single_tier_job(
    policy: Policy,
    events: Sequence[BlocksAccessed],
    capacity_blocks: int,
    planner: PlannerParams,
) -> tuple[SingleTierResult, dict[str, Any] | None]:
    """One single-tier row's replay, and what its guard (if any) served at the end."""
    result = replay_single_tier(policy, events, capacity_blocks, planner_params=planner)
    return result, policy.online_status().get("guard")


def _tiered_job(
    policy: Policy, events: Sequence[BlocksAccessed], setup: TieredSetup, options: dict[str, Any]
) -> TieredResult:
    return replay_tiered(policy, events, setup, **options)


def _saved_size_bytes(policy: Policy) -> int:
    """Bytes of the files ``policy.save`` writes: what serving would load."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        directory = policy.save(Path(tmp) / "policy")
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _peer_ratios(test: Sequence[BlocksAccessed], capacity: int) -> dict[str, Any]:
    """libCacheSim's policies on the replayed block sequence: hit ratios of those that
    ran, and the reason for each that did not."""
    from training.peers import peer_hit_ratios

    arrays = access_arrays(test)
    results = peer_hit_ratios(arrays.block_ids, capacity, ts_ms=arrays.ts_ms)
    return {
        # Online policies only: libCacheSim's Belady reads the future, it is a reference.
        "hit_ratios": {
            name: r.hit_ratio for name, r in results.items() if r.available and not r.needs_future
        },
        "future_aware": {
            name: r.hit_ratio for name, r in results.items() if r.available and r.needs_future
        },
        "unavailable": {name: r.error for name, r in results.items() if not r.available},
        "seconds": {name: r.elapsed_s for name, r in results.items()},
    }


# --- presentation -----------------------------------------------------------------


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


def format_single(report: ComparisonReport) -> str:
    if not report.single:
        return ""
    names = list(report.single[0]["policies"])
    head = (
        f"{'capacity':>8}  {'LRU':>7} {'Belady':>7}  "
        + " ".join(f"{n:>10}" for n in names)
        + "   best peer"
    )
    lines = ["Single tier, demand caching: hit ratio (share of the LRU-to-Belady gap closed)", head]
    for row in report.single:
        refs = row["references"]
        cells = [
            f"{fmt_number(row['policies'][n], '.4f')}"
            f"({fmt_number(_pct(row['gap_closed'][n]), '+.0f')}%)".rjust(10)
            for n in names
        ]
        peer = row.get("peers", {}).get("hit_ratios", {})
        best = max(peer.items(), key=lambda kv: kv[1]) if peer else None
        best_text = f"{best[0]} {best[1]:.4f}" if best else "-"
        lines.append(
            f"{row['capacity'] * 100:>7g}%  {refs['lru_exact']:>7.4f} {refs['belady']:>7.4f}  "
            + " ".join(cells)
            + f"   {best_text}"
        )
    return "\n".join(lines)


def format_tiered(report: ComparisonReport) -> str:
    if not report.tiered:
        return ""
    lines = [
        "Tiered with prefetch: TTFT (ms) and throughput vs no prewarm (and vs no external cache)",
        f"{'capacity':>8} {'policy':>11} {'p50':>7} {'p90':>7} {'p99':>7} {'p50 chg':>8} {'req/s':>6} {'thr chg':>8} {'p50 v nc':>8} {'thr v nc':>8} {'hbm hit':>8} {'dram hit':>8} {'pf prec':>7} {'p50/lru+pw, 95%':>15}",
    ]
    for row in report.tiered:
        t = row["ttft_ms"]
        hits = row["hit_ratio_by_tier"]
        lines.append(
            f"{row['capacity'] * 100:>7g}% {row['policy']:>11} {t['p50']:>7.0f} {t['p90']:>7.0f} {t['p99']:>7.0f} "
            f"{fmt_number(_pct(row['ttft_p50_change']), '>+7.1f')}% {fmt_number(row['throughput_rps'], '>6.2f')} "
            f"{fmt_number(_pct(row['throughput_change']), '>+7.1f')}% "
            f"{fmt_number(_pct(row['ttft_p50_change_vs_no_cache']), '>+7.1f')}% "
            f"{fmt_number(_pct(row['throughput_change_vs_no_cache']), '>+7.1f')}% "
            f"{hits.get('hbm', 0):>8.3f} {hits.get('dram', 0):>8.3f} {fmt_number(row['prefetch_precision'], '>7.2f')} "
            f"{format_interval(row.get('paired_vs_lru_prewarm', {}).get('p50_ratio_ci95')):>15}"
        )
    return "\n".join(lines)


def format_interval(bounds: Sequence[float] | None, empty: str = "-") -> str:
    """``0.912-0.986``; ``empty`` where there is none (LRU with prewarm itself)."""
    if not bounds or not all(math.isfinite(b) for b in bounds):
        return empty
    return f"{bounds[0]:.3f}-{bounds[1]:.3f}"
