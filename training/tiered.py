"""Tiered replay: a trace through the serving path into the one simulation.

Nothing here models time. Each request goes, as in ``serve --executor sim:``,
Sidecar -> planner -> ``DecisionMaker`` (decision ids) -> ``ExecutorSink`` ->
``executor.sim.SimulatedExecutor``, and ``executor.sim.run_requests`` drives the
requests through the simulated engine (open- or closed-loop) and measures TTFT and
throughput. This module builds those parts, converts events to simulated requests
and sums the results.

Baselines are the same path with less in it:

- ``no_cache``: HBM only, LRU: the engine's own prefix cache, no external tier (the
  seed's "no external cache").
- ``no_prewarm``: every tier, LRU, no speculative prefetch, and each request's
  decisions held until the engine schedules it, so its loads start then (today's
  engines load at scheduling time); with prewarming they are applied at arrival and
  overlap the queueing.

Throughput: requests (and prompt + output tokens) per second of engine busy time,
prefill and decode both counted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from executor.decision import Decision
from executor.sim import RunResult, SimRequest, SimulatedExecutor, run_requests
from executor.sim.engine import busy_ms_uncached
from executor.sim.profile import Profile
from features.events import BlocksAccessed
from predictor.base import Policy
from serving import defaults
from serving.decisions import DecisionMaker, SimulatedExecutorSink
from serving.loop import Sidecar
from serving.placement import Placement
from serving.planner import Move, Planner, PlannerParams
from training.metrics import harrell_davis_median
from training.replay import time_scale_for_load

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
DEFAULT_OUTPUT_TOKENS = 256
"""Output length of a request whose trace row has none."""
NO_DEADLINE_MS = 10**12
QUEUEING_DOMINATES = 0.5
"""Warn when the median request spends more than this share of its TTFT queued."""


@dataclass(frozen=True)
class TieredSetup:
    """What every policy of one comparison shares."""

    profile: Profile
    hbm_capacity_blocks: int
    block_size_tokens: int = 512
    prefetch_interval_ms: int = defaults.PREFETCH_INTERVAL_MS
    recent_requests: int = defaults.RECENT_REQUESTS
    planner: PlannerParams = field(default_factory=PlannerParams)
    concurrency: int | None = None
    """Closed loop with this many clients; None: open loop at the trace's times."""
    think_ms: float = 0.0
    """Closed loop: mean think time (exponential, seeded) between a client's requests."""
    seed: int = 0
    blocking_loads: bool = False
    """The engine's steps wait for the KV loads of the requests they compute (a
    connector that loads synchronously); default: asynchronous loading."""

    def capacities_blocks(self, tiers: Sequence[str] | None = None) -> list[int]:
        block_bytes = self.profile.model.block_bytes(self.block_size_tokens)
        names = list(tiers or self.profile.tier_names)
        caps = [self.hbm_capacity_blocks]
        caps += [max(1, self.profile.tier(t).capacity_bytes // block_bytes) for t in names[1:]]
        return caps


@dataclass
class TieredResult:
    policy: str
    prewarm: bool
    num_requests: int
    ttft_ms: np.ndarray
    queue_ms: np.ndarray
    busy_ms: float
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    hits_by_tier: dict[str, int]
    token_hits_by_tier: dict[str, int]
    accesses: int
    bytes_read_by_tier: dict[str, int]
    bytes_written_by_tier: dict[str, int]
    concurrency: int | None = None
    max_in_flight: int = 0
    makespan_ms: float = 0.0
    prefetched_blocks: int = 0
    prefetch_used: int = 0
    prefetch_timely: int = 0
    prefetch_wasted_bytes: int = 0
    prefetch_refused: int = 0
    decision_outcomes: dict[str, int] = field(default_factory=dict)
    """``"action/status"`` -> count of what the executor did with each decision."""
    placement_mismatches: int = 0
    """Blocks where the planner's view and the executor disagree at the end (0 when
    every decision was applied as planned)."""
    seconds: float = 0.0
    moves_by_kind: dict[str, int] = field(default_factory=dict)
    guard: dict[str, Any] | None = None
    """What the online guard served at the end and its ghost estimates per scale (a
    learned policy behind the guard; None otherwise)."""

    def ttft_percentiles(self) -> dict[str, float]:
        if self.ttft_ms.size == 0:
            nan = float("nan")
            return {"p50": nan, "p90": nan, "p99": nan, "mean": nan, "p50_hd": nan}
        p50, p90, p99 = np.percentile(self.ttft_ms, [50, 90, 99])
        return {
            "p50": float(p50),
            "p50_hd": harrell_davis_median(self.ttft_ms),
            "p90": float(p90),
            "p99": float(p99),
            "mean": float(self.ttft_ms.mean()),
        }

    @property
    def service_ms_total(self) -> float:
        """Engine busy time (prefill and decode)."""
        return self.busy_ms

    @property
    def throughput_rps(self) -> float:
        return self.num_requests / (self.busy_ms / 1000.0) if self.busy_ms > 0 else float("inf")

    @property
    def throughput_tokens_per_s(self) -> float:
        """Prompt and output tokens served per second of engine busy time."""
        tokens = self.prompt_tokens + self.output_tokens
        return tokens / (self.busy_ms / 1000.0) if self.busy_ms > 0 else float("inf")

    @property
    def queueing_share(self) -> float:
        """Median over requests of queued time / TTFT."""
        if self.ttft_ms.size == 0:
            return float("nan")
        share = self.queue_ms / np.maximum(self.ttft_ms, 1e-9)
        return float(np.median(share))

    @property
    def prefetch_precision(self) -> float:
        return (
            self.prefetch_used / self.prefetched_blocks if self.prefetched_blocks else float("nan")
        )

    @property
    def prefetch_timeliness(self) -> float:
        return self.prefetch_timely / self.prefetch_used if self.prefetch_used else float("nan")

    def hit_ratio(self, tier: str) -> float:
        return self.hits_by_tier.get(tier, 0) / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "prewarm": self.prewarm,
            "num_requests": self.num_requests,
            "concurrency": self.concurrency,
            "ttft_ms": self.ttft_percentiles(),
            "queueing_share": self.queueing_share,
            "throughput_rps": self.throughput_rps,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "busy_s": self.busy_ms / 1000.0,
            "makespan_s": self.makespan_ms / 1000.0,
            "max_in_flight": self.max_in_flight,
            "accesses": self.accesses,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "computed_tokens": self.computed_tokens,
            "hit_ratio_by_tier": {t: self.hit_ratio(t) for t in self.hits_by_tier},
            "token_hit_ratio_by_tier": {
                t: v / self.prompt_tokens if self.prompt_tokens else 0.0
                for t, v in self.token_hits_by_tier.items()
            },
            "bytes_read_by_tier": dict(self.bytes_read_by_tier),
            "bytes_written_by_tier": dict(self.bytes_written_by_tier),
            "prefetched_blocks": self.prefetched_blocks,
            "prefetch_precision": self.prefetch_precision,
            "prefetch_timeliness": self.prefetch_timeliness,
            "prefetch_wasted_bytes": self.prefetch_wasted_bytes,
            "prefetch_refused": self.prefetch_refused,
            "decision_outcomes": dict(self.decision_outcomes),
            "placement_mismatches": self.placement_mismatches,
            "seconds": self.seconds,
            "moves_by_kind": dict(self.moves_by_kind),
            **({"guard": self.guard} if self.guard is not None else {}),
        }


def time_scale_for_engine_load(
    events: Sequence[BlocksAccessed], profile: Profile, load: float
) -> float:
    """The time scale at which the engine, with nothing cached, is offered ``load`` of
    its work in 90% of the trace's windows, decode included.

    ``training.replay.time_scale_for_load`` counts prefill compute only. The engine
    also decodes: every step costs ``step_overhead_ms`` plus a token per running
    request. At the prefill-only scale of the demo workload that made the engine's
    busy time 1.25x the prefill compute, and "load 0.9" was an overload (median TTFT
    7 s, queueing 80% of it in the median request, every policy within 2% of the
    others). So the prefill scale is stretched by the busy / prefill ratio measured
    there, once (no-cache queueing share 41% on the demo). Not to a fixed point: at
    lower load decode batches less and the ratio keeps growing (1.54 at this scale,
    1.91 at x1.6), because a decoding engine counts as busy while it could still take
    prefill work."""
    if not events:
        return 1.0
    base = time_scale_for_load(events, profile.model.prefill_ms, load)
    requests = to_sim_requests(events)
    prefill_ms = sum(profile.model.prefill_ms(r.prompt_tokens) for r in requests)
    if prefill_ms <= 0:
        return base
    t0 = requests[0].arrival_ms
    busy = busy_ms_uncached(
        profile.model,
        hbm_read_bytes_per_s=profile.tier("hbm").read_parallel_bytes_per_s,
        requests=[
            (t0 + (r.arrival_ms - t0) * base, r.prompt_tokens, r.output_tokens) for r in requests
        ],
    )
    scale = base * max(1.0, busy / prefill_ms)
    log.info(
        "time scale x%.2f for load %.2f (x%.2f counting prefill alone; with decode the "
        "engine's work is %.2fx its prefill compute)",
        scale,
        load,
        base,
        scale / base,
    )
    return scale


def to_sim_requests(
    events: Sequence[BlocksAccessed], *, think_ms: float = 0.0, seed: int = 0
) -> list[SimRequest]:
    """Events as simulated requests: distinct blocks in prefix order, prompt length
    (whole blocks when the trace has none), output length (``DEFAULT_OUTPUT_TOKENS``
    when it has none) and an exponential think time of mean ``think_ms``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    thinks = rng.exponential(think_ms, len(events)) if think_ms > 0 else np.zeros(len(events))
    out: list[SimRequest] = []
    for event, think in zip(events, thinks.tolist(), strict=True):
        blocks = tuple(dict.fromkeys(event.block_hashes))
        prompt = event.input_tokens or len(blocks) * event.block_size_tokens
        out.append(
            SimRequest(
                arrival_ms=float(event.ts_ms),
                blocks=blocks,
                prompt_tokens=max(1, prompt),
                output_tokens=max(1, event.output_tokens or DEFAULT_OUTPUT_TOKENS),
                think_ms=think,
            )
        )
    return out


class _HoldUntilScheduled:
    """The sink between ``DecisionMaker`` and ``SimulatedExecutorSink`` in the no-prewarm
    baseline: a request's stores and decisions wait until the engine schedules it,
    then reach the executor booked at that time (made with no deadline)."""

    def __init__(self, inner: SimulatedExecutorSink) -> None:
        self.inner = inner
        self.current = -1
        self.held: dict[int, list[Any]] = {}

    def place_store(self, block: int, tier: str, now_ms: int) -> None:
        self.held.setdefault(self.current, []).append(("store", block, tier))

    def emit(self, decisions: Sequence[Decision]) -> int:
        self.held.setdefault(self.current, []).append(("decisions", list(decisions)))
        return len(decisions)

    def release(self, index: int, now_ms: float) -> None:
        for item in self.held.pop(index, []):
            if item[0] == "store":
                self.inner.place_store(item[1], item[2], int(now_ms))
            else:
                self.inner.emit_at(item[1], now_ms)
        self.inner.emit_at([], now_ms)

    def flush(self) -> None:
        """Held items leave only on ``release``."""

    def close(self) -> None:
        self.inner.close()


def replay_tiered(
    policy: Policy,
    events: Sequence[BlocksAccessed],
    setup: TieredSetup,
    *,
    prewarm: bool = True,
    speculative: bool = True,
    external: bool = True,
    label: str | None = None,
    progress: Progress | None = None,
    preload: Mapping[str, Sequence[int]] | None = None,
) -> TieredResult:
    """Replay ``events`` through the sidecar and the one simulation. ``external``
    False keeps only HBM (no external cache tier). ``preload``: tier -> blocks
    already there at the start (in the planner's view and the executor alike), as far
    as the tier has room."""
    names = list(setup.profile.tier_names) if external else ["hbm"]
    caps = setup.capacities_blocks(names)
    executor = SimulatedExecutor(
        setup.profile,
        tiers=names,
        capacity_blocks=dict(zip(names, caps, strict=True)),
        block_size_tokens=setup.block_size_tokens,
    )
    placement = Placement(names, caps)
    for tier, blocks in (preload or {}).items():
        t = names.index(tier)
        for block in blocks:
            if placement.tier_of(block) < 0 and placement.count(t) < caps[t]:
                placement.add(block, t, 0)
                executor.place(block, tier, now_ms=0.0)
    sidecar = Sidecar(
        policy,
        Planner(setup.planner),
        placement,
        prefetch_interval_ms=setup.prefetch_interval_ms,
        recent_requests=setup.recent_requests,
        prefetch=speculative,
        allow_future=True,
    )
    sidecar.prefetch_admit = executor.admit_prefetch
    executor_sink = SimulatedExecutorSink(executor)
    hold = None if prewarm else _HoldUntilScheduled(executor_sink)
    sink: Any = executor_sink if hold is None else hold
    maker = DecisionMaker(
        names,
        sink,
        lambda: (policy.name, "replay"),
        # Held decisions wait for the engine as long as it takes: no deadline then.
        deadline_ms=setup.prefetch_interval_ms * 5 if hold is None else NO_DEADLINE_MS,
        on_store=sink.place_store,
        split_at_stores=False,  # the simulated sink applies a round atomically
    )
    prefetched: dict[int, float] = {}  # block -> when speculatively promoted to HBM
    counters = Counter[str]()

    def on_moves(event: BlocksAccessed | None, moves: list[Move], now_ms: int) -> None:
        for m in moves:
            if m.kind == "prefetch" and m.to_tier == 0:
                prefetched[m.block] = now_ms
                counters["prefetched"] += 1
            elif m.from_tier == 0 and m.block in prefetched:
                del prefetched[m.block]
                counters["wasted"] += executor.block_bytes

    sidecar.hooks.append(on_moves)
    sidecar.hooks.append(maker)
    requests = to_sim_requests(events, think_ms=setup.think_ms, seed=setup.seed)

    def on_arrival(i: int, now_ms: float) -> None:
        event = events[i]
        at = int(now_ms)
        if event.ts_ms != at:
            event = dataclasses.replace(event, ts_ms=at)
        for block in requests[i].blocks:
            if block in prefetched:
                counters["used"] += 1
                ready = executor.ready_at_ms(block)
                if ready is not None and ready <= now_ms:
                    counters["timely"] += 1
                del prefetched[block]
        if hold is not None:
            hold.current = i
        sidecar.handle(event)
        executor_sink.flush()

    t_wall = time.perf_counter()
    run: RunResult = run_requests(
        requests,
        executor,
        on_arrival=on_arrival,
        release=hold.release if hold is not None else None,
        concurrency=setup.concurrency,
        progress=progress,
        blocking_loads=setup.blocking_loads,
    )
    stats = executor.stats()
    mismatches = sum(
        executor.locate(b) != tier for t, tier in enumerate(names) for b in placement.members(t)
    ) + abs(len(placement) - sum(executor.num_blocks(t) for t in names))
    result = TieredResult(
        policy=label or policy.name,
        prewarm=prewarm,
        num_requests=len(events),
        ttft_ms=run.ttft_ms,
        queue_ms=run.queue_ms,
        busy_ms=run.busy_ms,
        prompt_tokens=run.prompt_tokens,
        output_tokens=run.output_tokens,
        computed_tokens=run.computed_tokens,
        hits_by_tier=dict(zip(names, run.hit_blocks_by_tier, strict=True)),
        token_hits_by_tier=dict(zip(names, run.hit_tokens_by_tier, strict=True)),
        accesses=run.accesses,
        bytes_read_by_tier={t: sum(v.values()) for t, v in stats.bytes_read.items()},
        bytes_written_by_tier={t: sum(v.values()) for t, v in stats.bytes_written.items()},
        concurrency=setup.concurrency,
        max_in_flight=run.max_in_flight,
        makespan_ms=run.makespan_ms,
        prefetched_blocks=counters["prefetched"],
        prefetch_used=counters["used"],
        prefetch_timely=counters["timely"],
        prefetch_wasted_bytes=counters["wasted"],
        prefetch_refused=stats.num_over_budget,
        decision_outcomes={f"{a}/{s}": n for (a, s), n in executor_sink.outcomes.items()},
        placement_mismatches=mismatches,
        seconds=time.perf_counter() - t_wall,
        moves_by_kind=dict(sidecar.stats.moves_by_kind),
        guard=policy.online_status().get("guard"),
    )
    if result.num_requests and result.queueing_share > QUEUEING_DOMINATES:
        log.warning(
            "%s: queueing is %.0f%% of the median request's TTFT: the load is above what "
            "one node serves, so TTFT measures the queue more than the cache; lower --load "
            "or --concurrency",
            result.policy,
            100 * result.queueing_share,
        )
    return result
