"""``run_requests``: requests through the one simulation (the executor's tiers and the
engine), open-loop or closed-loop, on simulated time.

Who decides what: the caller's ``on_arrival(i, now_ms)`` runs the planner for request
``i`` (replay: the sidecar, whose decisions reach this executor through the decision
path); this module never moves a block itself. It only asks the executor what the
request finds (``cached_prefix``), when its cached prefix is in HBM
(``prefix_ready_ms``), and tells it when the engine has computed the rest
(``mark_computed``).

Load:

- open loop (``concurrency=None``): request ``i`` arrives at ``arrival_ms``;
- closed loop (``concurrency=N``): N clients; each sends the next request of the
  trace (in trace order) when its previous one has finished, after that request's
  ``think_ms``. Never more than N requests in flight.

Prewarm: with ``release=None`` the request's decisions are applied at arrival, so its
loads overlap its queueing (kvwarm). With a ``release(i, now_ms)`` the caller holds
them and applies them when the engine first schedules the request (today's engines:
loads start at scheduling).

Either way the engine looks the prompt up when it first schedules the request, as
vLLM's scheduler does (its prefix cache and its KV connector): a prewarmed request also
uses the blocks that earlier requests computed while it queued (a burst of requests
sharing a prefix computes it once, not once per request: the lookup at arrival alone
made prewarming look worse than loading at scheduling on bursty traffic, +27% TTFT
p50 on the diurnal workload at seed 1), and loses the ones evicted from every tier
since its arrival (computed again). Blocks found then and not at arrival count as hits
in the tier they are in then.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from executor.sim.engine import Engine, EngineRequest
from executor.sim.executor import SimulatedExecutor


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_ms: float
    """Open loop: when it arrives."""
    blocks: tuple[Hashable, ...]
    """Distinct block ids in prefix order."""
    prompt_tokens: int
    output_tokens: int
    think_ms: float = 0.0
    """Closed loop: the client's pause between the previous request's end and this one."""


@dataclass
class RunResult:
    ttft_ms: np.ndarray
    """Per request (trace order): first token - arrival."""
    queue_ms: np.ndarray
    """Per request: arrival until its first prefill chunk ran (queueing and loading)."""
    arrival_ms: np.ndarray
    finish_ms: np.ndarray
    hit_blocks_by_tier: list[int]
    """Blocks of the usable cached prefix, by the tier they were in at arrival."""
    hit_tokens_by_tier: list[int]
    accesses: int
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    busy_ms: float
    num_steps: int
    max_in_flight: int
    evicted_prefix_blocks: int = 0
    """Cached prefix blocks a request's own decisions (or the prefetch round right
    after it) moved out of every tier before it could load them: computed instead."""

    @property
    def makespan_ms(self) -> float:
        if self.finish_ms.size == 0:
            return 0.0
        return float(self.finish_ms.max() - self.arrival_ms.min())


ArrivalFn = Callable[[int, float], None]
ReleaseFn = Callable[[int, float], None]


def run_requests(
    requests: Sequence[SimRequest],
    executor: SimulatedExecutor,
    *,
    on_arrival: ArrivalFn,
    release: ReleaseFn | None = None,
    concurrency: int | None = None,
    progress: Callable[[int], None] | None = None,
    blocking_loads: bool = False,
) -> RunResult:
    """Drive ``requests`` through the engine over ``executor``'s tiers (see module).
    ``blocking_loads``: the engine's steps wait for the loads of the requests they
    compute (``Engine``), and each load is a synchronous retrieve that stages through
    host memory, one request after another (``load`` below), as through LMCache
    without its asynchronous loading."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    n = len(requests)
    block_tokens = executor.block_size_tokens
    ttft = np.zeros(n)
    queue = np.zeros(n)
    arrival = np.zeros(n)
    finish = np.zeros(n)
    hits = [0] * len(executor.tier_names)
    hit_tokens = [0] * len(executor.tier_names)
    first_miss_of = [0] * n
    # Blocks of the cached prefix in storage (below host memory) before its decisions:
    # a blocking load reads them into host memory, then copies them to the GPU.
    host = executor.host_tier if blocking_loads else None
    from_storage = [0] * n
    totals = {"accesses": 0, "prompt": 0, "output": 0, "computed": 0, "done": 0,
              "evicted_prefix": 0}  # fmt: skip

    # Prewarm: where each cached prefix block of a request not yet scheduled was after
    # its own decisions at arrival (``still_cached``, read by ``relookup``).
    arrival_tiers: dict[int, list[int]] = {}

    def lookup(i: int) -> int:
        """What request i finds cached (before its own decisions apply): counts its
        hits and returns its cached prompt tokens."""
        req = requests[i]
        first_miss, tiers = executor.cached_prefix(req.blocks)
        first_miss_of[i] = first_miss
        if host is not None:
            from_storage[i] = sum(1 for t in tiers if t > host)
        for t in tiers:
            hits[t] += 1
        cached = min(first_miss * block_tokens, req.prompt_tokens)
        for k, t in enumerate(tiers):
            hit_tokens[t] += min(block_tokens, req.prompt_tokens - k * block_tokens)
        return cached

    def still_cached(i: int, cached: int, prewarm: bool = False) -> int:
        """After request i's own decisions applied: its usable prefix ends at the first
        block they (or a prefetch round right after) moved out of every tier; the rest is
        computed. Returns the cached prompt tokens left. ``prewarm``: keep where its
        prefix blocks are now, for ``relookup`` when the engine schedules it."""
        n = first_miss_of[i]
        k, tiers = executor.cached_prefix(requests[i].blocks[:n])
        if prewarm:
            arrival_tiers[i] = tiers
        if k == n:
            return cached
        first_miss_of[i] = k
        totals["evicted_prefix"] += n - k
        return min(k * block_tokens, requests[i].prompt_tokens)

    # Blocking loads: [end of the previous retrieve, latest read landed so far].
    retrieve = [0.0, 0.0]

    def load(i: int, now_ms: float, staged: int) -> float:
        """When request i's cached prefix is in HBM; ``staged``: how many of its blocks
        were in storage before its own decisions. Asynchronous loads: when the reads
        (demand promotes, streams) land. Blocking loads are synchronous retrieves, as
        LMCache's without its async loading: one request after another (the connector
        loops over a step's requests), each its own transfers (the time they took on
        the FIFO queues: storage reads, and copies of blocks already in host memory)
        then one copy of the blocks it read from storage into the GPU
        (``SimulatedExecutor.host_copy_done_ms``)."""
        landed = executor.prefix_ready_ms(requests[i].blocks[: first_miss_of[i]], now_ms)
        if not blocking_loads:
            return landed
        previous_end, last_landed = retrieve
        reads = max(0.0, landed - max(now_ms, last_landed))
        retrieve[1] = max(last_landed, landed)
        ready = executor.host_copy_done_ms(staged, max(now_ms, previous_end) + reads)
        retrieve[0] = ready
        return ready

    def schedule(r: EngineRequest, now_ms: float) -> tuple[float, int]:
        i = r.key
        if release is not None:
            cached = lookup(i)
            release(i, now_ms)
            cached = still_cached(i, cached)
            return load(i, now_ms, from_storage[i]), cached
        return relookup(r, now_ms)

    def relookup(r: EngineRequest, now_ms: float) -> tuple[float, int]:
        """A prewarmed request first scheduled: its loads started at arrival; what is
        cached of its prompt now (see the module docstring)."""
        i = r.key
        req = requests[i]
        assert r.load_ready_ms is not None
        ready, n = r.load_ready_ms, first_miss_of[i]
        before = arrival_tiers.pop(i)
        k, tiers = executor.cached_prefix(req.blocks)
        if k < n:
            totals["evicted_prefix"] += n - k
        for j in range(n, k):
            hits[tiers[j]] += 1
            hit_tokens[tiers[j]] += min(block_tokens, req.prompt_tokens - j * block_tokens)
        # Loaded at arrival and still where they were then: nothing more to read. Blocks
        # new since, or moved since (demoted ones are read again), are booked now.
        again = [b for j, b in enumerate(req.blocks[:k]) if j >= n or tiers[j] != before[j]]
        if again:
            ready = max(ready, executor.prefix_ready_ms(again, now_ms))
        first_miss_of[i] = k
        return ready, min(k * block_tokens, req.prompt_tokens)

    arrivals: list[tuple[float, int]] = []
    next_index = 0

    def first_token(r: EngineRequest) -> None:
        i = r.key
        ttft[i] = r.first_token_ms - r.arrival_ms
        queue[i] = r.queued_ms
        executor.mark_computed(requests[i].blocks[first_miss_of[i] :], r.first_token_ms)

    def finished(r: EngineRequest) -> None:
        nonlocal next_index
        finish[r.key] = r.finish_ms
        totals["done"] += 1
        if concurrency is not None and next_index < n:
            heapq.heappush(arrivals, (r.finish_ms + requests[next_index].think_ms, next_index))
            next_index += 1
        if progress is not None and totals["done"] % 256 == 0:
            progress(256)

    profile = executor.profile
    engine = Engine(
        profile.model,
        hbm_read_bytes_per_s=profile.tier("hbm").read_parallel_bytes_per_s,
        on_schedule=schedule,
        on_first_token=first_token,
        on_finish=finished,
        blocking_loads=blocking_loads,
    )
    if n:
        if concurrency is None:
            arrivals = [(float(r.arrival_ms), i) for i, r in enumerate(requests)]
            heapq.heapify(arrivals)
            next_index = n
        else:
            start = float(requests[0].arrival_ms)
            next_index = min(concurrency, n)
            arrivals = [(start, i) for i in range(next_index)]
    max_in_flight = 0
    inf = float("inf")
    while True:
        at = arrivals[0][0] if arrivals else inf
        ready = engine.next_start_ms()
        if ready is not None and ready < at:
            engine.step(horizon_ms=at)
            continue
        if not arrivals:
            break
        t, i = heapq.heappop(arrivals)
        req = requests[i]
        totals["accesses"] += len(req.blocks)
        totals["prompt"] += req.prompt_tokens
        totals["output"] += req.output_tokens
        arrival[i] = t
        if release is None:
            cached = lookup(i)
            on_arrival(i, t)
            cached = still_cached(i, cached, prewarm=True)
            load_ready: float | None = load(i, t, from_storage[i])
        else:
            on_arrival(i, t)
            load_ready, cached = None, 0
        engine.submit(
            EngineRequest(
                key=i,
                arrival_ms=t,
                prompt_tokens=req.prompt_tokens,
                output_tokens=req.output_tokens,
                cached_tokens=cached,
                load_ready_ms=load_ready,
            )
        )
        if engine.num_in_flight > max_in_flight:
            max_in_flight = engine.num_in_flight
    if progress is not None:
        progress(totals["done"] % 256)
    computed = int(sum(requests[i].prompt_tokens for i in range(n))) - sum(
        min(first_miss_of[i] * block_tokens, max(requests[i].prompt_tokens - 1, 0))
        for i in range(n)
    )
    return RunResult(
        ttft_ms=ttft,
        queue_ms=queue,
        arrival_ms=arrival,
        finish_ms=finish,
        hit_blocks_by_tier=hits,
        hit_tokens_by_tier=hit_tokens,
        accesses=totals["accesses"],
        prompt_tokens=totals["prompt"],
        output_tokens=totals["output"],
        computed_tokens=computed,
        busy_ms=engine.busy_ms,
        num_steps=engine.num_steps,
        max_in_flight=max_in_flight,
        evicted_prefix_blocks=totals["evicted_prefix"],
    )
