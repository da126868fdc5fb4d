"""Tiered replay with prefetch: TTFT and throughput under the profile's timing model.

The sidecar loop runs unchanged (simulated clock = event time). A hook turns its moves
into transfers booked on the profile's channels (``executor.sim``), and a prefill
model turns each request into a time to first token:

- A request arrives at ``t_a`` and waits for a free prefill engine (``t_s``).
- Its blocks sitting in a lower tier are promoted to HBM. With prewarming (kvwarm)
  the planner books those moves at arrival, so they overlap the queueing; without
  (the "no prewarm" baseline of today's engines) they are booked at ``t_s``. Blocks a
  speculative prefetch already started are ready when that transfer completes.
- Blocks found nowhere are recomputed: ``prefill_ms(tokens)``. As in vLLM and SGLang
  prefix caching, only the longest cached prefix is reused: every token after the
  first block found nowhere is recomputed.
- ``TTFT = ready + prefill - t_a``, where ``ready`` is when the last cached block is
  in HBM (not before ``t_s``). The engine is busy from ``t_s`` until then.
- Demotions (write-backs) and speculative promotions share each link's bandwidth
  with demand loads; prefetch is capped by the profile's ``prefetch_share``.

Throughput is the capacity the run shows: requests per second of engine busy time
(``num_requests / sum(service)``), i.e. what one node sustains at full load with that
policy; and prompt tokens per second likewise.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from executor.sim.profile import Profile
from features.events import BlocksAccessed
from predictor.base import Policy
from serving import defaults
from serving.loop import Sidecar
from serving.placement import NOWHERE, Placement
from serving.planner import Move, Planner, PlannerParams

Progress = Callable[[int], None]


@dataclass(frozen=True)
class TieredSetup:
    """What every policy of one comparison shares."""

    profile: Profile
    hbm_capacity_blocks: int
    block_size_tokens: int = 512
    num_engines: int = 1
    prefetch_interval_ms: int = defaults.PREFETCH_INTERVAL_MS
    recent_requests: int = defaults.RECENT_REQUESTS
    planner: PlannerParams = field(default_factory=PlannerParams)

    def capacities_blocks(self) -> list[int]:
        block_bytes = self.profile.model.block_bytes(self.block_size_tokens)
        caps = [self.hbm_capacity_blocks]
        caps += [max(1, t.capacity_bytes // block_bytes) for t in self.profile.tiers[1:]]
        return caps


@dataclass
class TieredResult:
    policy: str
    prewarm: bool
    num_requests: int
    ttft_ms: np.ndarray
    service_ms_total: float
    prompt_tokens: int
    hits_by_tier: dict[str, int]
    token_hits_by_tier: dict[str, int]
    accesses: int
    bytes_read_by_tier: dict[str, int]
    bytes_written_by_tier: dict[str, int]
    prefetched_blocks: int = 0
    prefetch_used: int = 0
    prefetch_timely: int = 0
    prefetch_wasted_bytes: int = 0
    prefetch_refused: int = 0
    seconds: float = 0.0
    moves_by_kind: dict[str, int] = field(default_factory=dict)

    def ttft_percentiles(self) -> dict[str, float]:
        if self.ttft_ms.size == 0:
            return {
                "p50": float("nan"),
                "p90": float("nan"),
                "p99": float("nan"),
                "mean": float("nan"),
            }
        p50, p90, p99 = np.percentile(self.ttft_ms, [50, 90, 99])
        return {
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "mean": float(self.ttft_ms.mean()),
        }

    @property
    def throughput_rps(self) -> float:
        return (
            self.num_requests / (self.service_ms_total / 1000.0)
            if self.service_ms_total > 0
            else float("inf")
        )

    @property
    def throughput_tokens_per_s(self) -> float:
        return (
            self.prompt_tokens / (self.service_ms_total / 1000.0)
            if self.service_ms_total > 0
            else float("inf")
        )

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
            "ttft_ms": self.ttft_percentiles(),
            "throughput_rps": self.throughput_rps,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "accesses": self.accesses,
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
            "seconds": self.seconds,
            "moves_by_kind": dict(self.moves_by_kind),
        }


class _Timing:
    """Books moves on the profile's channels and tracks when blocks reach HBM."""

    def __init__(self, setup: TieredSetup) -> None:
        self.names = list(setup.profile.tier_names)
        self.channels = [t.channels() for t in setup.profile.tiers]
        self.block_bytes = setup.profile.model.block_bytes(setup.block_size_tokens)
        self.read_bytes = dict.fromkeys(self.names, 0)
        self.written_bytes = dict.fromkeys(self.names, 0)
        self.ready_at: dict[int, float] = {}  # block -> when its move into HBM completes
        self.refused = 0  # speculative moves refused by a prefetch budget

    def admit(self, from_tier: int, to_tier: int, now_ms: int) -> bool:
        """The prefetch budget of both links (read side of the source, write side of the
        destination): take room for one block if both have it."""
        read, write = self.channels[from_tier].read, self.channels[to_tier].write
        size = self.block_bytes
        if not (read.admits_prefetch(now_ms, size) and write.admits_prefetch(now_ms, size)):
            self.refused += 1
            return False
        read.charge_prefetch(now_ms, size)
        write.charge_prefetch(now_ms, size)
        return True

    def book(self, move: Move, at_ms: float) -> float:
        """Book a move's read and write; returns when it completes. Stores (computed
        blocks) and evictions move no bytes."""
        done = at_ms
        if move.from_tier != NOWHERE and move.to_tier != NOWHERE:
            size = self.block_bytes
            done = max(done, self.channels[move.from_tier].read.book(at_ms, size))
            done = max(done, self.channels[move.to_tier].write.book(at_ms, size))
            self.read_bytes[self.names[move.from_tier]] += size
            self.written_bytes[self.names[move.to_tier]] += size
        if move.to_tier == 0:
            self.ready_at[move.block] = done
        else:
            self.ready_at.pop(move.block, None)
        return done


def replay_tiered(
    policy: Policy,
    events: Sequence[BlocksAccessed],
    setup: TieredSetup,
    *,
    prewarm: bool = True,
    speculative: bool = True,
    label: str | None = None,
    progress: Progress | None = None,
) -> TieredResult:
    """Replay ``events`` through the sidecar loop over the profile's tiers."""
    names = list(setup.profile.tier_names)
    placement = Placement(names, setup.capacities_blocks())
    sidecar = Sidecar(
        policy,
        Planner(setup.planner),
        placement,
        prefetch_interval_ms=setup.prefetch_interval_ms,
        recent_requests=setup.recent_requests,
        prefetch=speculative,
        allow_future=True,
    )
    timing = _Timing(setup)
    model = setup.profile.model
    engines = [0.0] * setup.num_engines
    ttft = np.zeros(len(events), dtype=np.float64)
    hits = dict.fromkeys(names, 0)
    token_hits = dict.fromkeys(names, 0)
    prefetched: dict[int, float] = {}  # block -> when speculatively promoted
    counters = {"prefetched": 0, "used": 0, "timely": 0, "wasted": 0}
    demand: list[Move] = []  # this request's promotions, booked once its start is known
    service_total = 0.0
    prompt_tokens = 0
    accesses = 0

    def on_moves(event: BlocksAccessed | None, moves: list[Move], now_ms: int) -> None:
        for m in moves:
            if m.kind == "demand":
                demand.append(m)  # booked below, at arrival or at start
            elif m.kind == "prefetch":
                timing.book(m, now_ms)
                if m.to_tier == 0:
                    prefetched[m.block] = now_ms
                    counters["prefetched"] += 1
            elif m.kind in ("demote", "evict", "bypass"):
                if m.block in prefetched and m.from_tier == 0:
                    del prefetched[m.block]
                    counters["wasted"] += timing.block_bytes
                timing.book(m, now_ms)  # write-back traffic; evictions move nothing

    sidecar.hooks.append(on_moves)
    sidecar.prefetch_admit = timing.admit
    t_wall = time.perf_counter()
    for i, event in enumerate(events):
        t_a = float(event.ts_ms)
        blocks = list(dict.fromkeys(event.block_hashes))
        tiers = placement.tiers_of(blocks)
        n_tokens = _tokens_per_block(event, len(blocks))
        prompt_tokens += sum(n_tokens)
        accesses += len(blocks)
        for block, tier, tok in zip(blocks, tiers, n_tokens, strict=True):
            if tier != NOWHERE:
                hits[names[tier]] += 1
                token_hits[names[tier]] += tok
            if block in prefetched:
                counters["used"] += 1
                if timing.ready_at.get(block, 0.0) <= t_a:
                    counters["timely"] += 1
                del prefetched[block]
        demand.clear()
        sidecar.handle(event)
        # The engine that frees first takes the request.
        free_at = heapq.heappop(engines)
        t_s = max(t_a, free_at)
        book_at = t_a if prewarm else t_s
        # Prefix caching: an engine reuses the longest cached prefix and recomputes
        # every token after the first block found nowhere, cached or not.
        first_miss = tiers.index(NOWHERE) if NOWHERE in tiers else len(tiers)
        used = set(blocks[:first_miss])
        ready = t_s
        for m in demand:
            done = timing.book(m, book_at)
            if m.block in used:
                ready = max(ready, done)
        for block in blocks[:first_miss]:
            ready = max(ready, timing.ready_at.get(block, 0.0))
        missing_tokens = sum(n_tokens[first_miss:])
        finish = ready + model.prefill_ms(missing_tokens)
        heapq.heappush(engines, finish)
        service_total += finish - t_s
        ttft[i] = finish - t_a
        for block in blocks:
            timing.ready_at.pop(block, None)  # resident and loaded now
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(len(events) % 256)
    return TieredResult(
        policy=label or policy.name,
        prewarm=prewarm,
        num_requests=len(events),
        ttft_ms=ttft,
        service_ms_total=service_total,
        prompt_tokens=prompt_tokens,
        hits_by_tier=hits,
        token_hits_by_tier=token_hits,
        accesses=accesses,
        bytes_read_by_tier=timing.read_bytes,
        bytes_written_by_tier=timing.written_bytes,
        prefetched_blocks=counters["prefetched"],
        prefetch_used=counters["used"],
        prefetch_timely=counters["timely"],
        prefetch_wasted_bytes=counters["wasted"],
        prefetch_refused=timing.refused,
        seconds=time.perf_counter() - t_wall,
        moves_by_kind=dict(sidecar.stats.moves_by_kind),
    )


def _tokens_per_block(event: BlocksAccessed, num_blocks: int) -> list[int]:
    """Tokens in each block: full blocks, and the prompt's remainder in the last."""
    size = event.block_size_tokens
    if num_blocks == 0:
        return []
    total = event.input_tokens if event.input_tokens is not None else num_blocks * size
    last = total - size * (num_blocks - 1)
    if not 0 < last <= size:
        last = size
    return [size] * (num_blocks - 1) + [last]
