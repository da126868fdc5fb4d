"""Requests through the one simulation: closed-loop load, open-loop arrivals, prefix
reuse through the executor's tiers."""

from __future__ import annotations

import numpy as np
import pytest

from executor.sim import SimRequest, SimulatedExecutor, run_requests


def _requests(n: int, *, prompt: int = 8192, output: int = 64) -> list[SimRequest]:
    blocks = prompt // 512
    return [
        SimRequest(
            arrival_ms=1000.0 * i,
            blocks=tuple(range(i * blocks, (i + 1) * blocks)),
            prompt_tokens=prompt,
            output_tokens=output,
        )
        for i in range(n)
    ]


def _store_all(executor: SimulatedExecutor, requests: list[SimRequest]):
    """Stand-in for the planner: store what a request computes while HBM has room."""

    def on_arrival(i: int, now_ms: float) -> None:
        stores = [(b, "hbm", now_ms) for b in requests[i].blocks if executor.locate(b) is None]
        free = executor.free_bytes("hbm") // executor.block_bytes
        executor.apply_batch([], stores=stores[:free])

    return on_arrival


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_closed_loop_never_has_more_than_n_in_flight(concurrency: int) -> None:
    requests = _requests(40)
    executor = SimulatedExecutor(capacity_blocks={"hbm": 10_000})
    in_flight = 0
    peak = 0
    result = run_requests(requests, executor, on_arrival=lambda i, t: None, concurrency=concurrency)
    # Count overlaps from the arrival and finish times run_requests reports.
    events = sorted(
        [(t, 1) for t in result.arrival_ms] + [(t, -1) for t in result.finish_ms],
        key=lambda e: (e[0], e[1]),
    )
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    assert result.max_in_flight == peak == concurrency
    assert np.all(result.finish_ms > result.arrival_ms)
    assert np.all(result.ttft_ms > 0)


def test_closed_loop_throughput_grows_then_saturates() -> None:
    requests = _requests(64, prompt=16_384, output=32)
    rates = []
    for n in (1, 2, 4, 16, 64):
        executor = SimulatedExecutor(capacity_blocks={"hbm": 10_000})
        r = run_requests(requests, executor, on_arrival=lambda i, t: None, concurrency=n)
        rates.append(len(requests) / (r.makespan_ms / 1000))
    assert rates[1] > rates[0] * 1.1  # batching helps at first
    assert all(b >= a * 0.99 for a, b in zip(rates, rates[1:], strict=False))
    # ...then prefill compute binds: 16 -> 64 clients gains little.
    assert rates[4] < rates[3] * 1.1


def test_think_time_delays_the_clients_next_request() -> None:
    requests = [
        SimRequest(0.0, (1,), 512, 4, think_ms=0.0),
        SimRequest(0.0, (2,), 512, 4, think_ms=5_000.0),
    ]
    executor = SimulatedExecutor(capacity_blocks={"hbm": 10})
    r = run_requests(requests, executor, on_arrival=lambda i, t: None, concurrency=1)
    assert r.arrival_ms[1] == pytest.approx(r.finish_ms[0] + 5_000.0)


def test_open_loop_follows_arrival_times_and_reuse_skips_prefill() -> None:
    base = _requests(2)
    # The second request repeats the first's prompt: its prefix is cached in HBM.
    requests = [base[0], SimRequest(60_000.0, base[0].blocks, 8192, 64)]
    executor = SimulatedExecutor(capacity_blocks={"hbm": 100})
    r = run_requests(requests, executor, on_arrival=_store_all(executor, requests))
    assert list(r.arrival_ms) == [0.0, 60_000.0]
    assert r.hit_blocks_by_tier[0] == 16
    # Only the last token is recomputed (it yields the first output token).
    assert r.ttft_ms[1] < r.ttft_ms[0] / 5
    assert r.computed_tokens == 8192 + 1


def test_a_prefix_block_its_own_request_evicts_is_computed_not_a_crash() -> None:
    """HBM only and a request whose decisions evict part of its own cached prefix (a
    prompt longer than the tier): the simulation used to stop with "block ... is not
    cached"; now the prefix ends at the first evicted block and the rest is computed."""
    requests = _requests(2, prompt=8192)  # 16 blocks each
    requests[1] = SimRequest(
        arrival_ms=1000.0, blocks=requests[0].blocks, prompt_tokens=8192, output_tokens=64
    )
    executor = SimulatedExecutor(capacity_blocks={"hbm": 16})

    def on_arrival(i: int, now_ms: float) -> None:
        if i == 0:
            executor.apply_batch([], stores=[(b, "hbm", now_ms) for b in requests[0].blocks])
        else:  # its own decisions drop the last 6 blocks of the prefix it found cached
            for b in requests[1].blocks[10:]:
                executor.evict(b)

    result = run_requests(requests, executor, on_arrival=on_arrival)
    assert result.evicted_prefix_blocks == 6
    assert result.ttft_ms[1] > 0
    # 10 blocks loaded, 6 computed: more computed than a full hit, less than a miss.
    assert 8192 < result.computed_tokens < 2 * 8192


def test_blocking_loads_are_retrieves_one_after_another_each_reads_then_copies() -> None:
    """Through LMCache without async loading: the connector retrieves the requests of
    a step one after another, and each retrieve reads its chunks into host memory, then
    copies them to the GPU over PCIe (the DRAM tier's read link). So two cold requests
    scheduled together see their first tokens after both reads and both copies, and a
    slower copy link adds its time once per request, not once in all."""
    from executor.sim.profile import load_profile

    profile = load_profile()
    blocks = 4
    requests = [
        SimRequest(0.0, tuple(range(i * blocks, (i + 1) * blocks)), blocks * 512, 1)
        for i in range(2)
    ]

    def ttft(link_bytes_per_s: float | None, tier: str = "nvme") -> np.ndarray:
        p = profile
        if link_bytes_per_s is not None:
            p = p.with_tier(
                "dram",
                read_serial_bytes_per_s=link_bytes_per_s,
                read_parallel_bytes_per_s=link_bytes_per_s,
                parallelism=1,
            )
        executor = SimulatedExecutor(p, capacity_blocks={"hbm": 100, "dram": 100, "nvme": 100})
        for b in range(2 * blocks):
            executor.place(b, tier, now_ms=0.0)
        return run_requests(
            requests, executor, on_arrival=lambda i, t: None, concurrency=2, blocking_loads=True
        ).ttft_ms

    nvme = profile.tier("nvme")
    size = SimulatedExecutor(profile).block_bytes
    reads_ms = 2 * blocks * size / nvme.read_parallel_bytes_per_s * 1000  # FIFO link
    fast, slow = ttft(None), ttft(1e9)  # 400 GB/s vs 1 GB/s host-to-GPU
    assert fast[0] == fast[1]  # one step computes both, after both retrieves
    assert fast[0] > reads_ms
    copy_ms = blocks * size / 1e9 * 1000  # one request's copy at 1 GB/s
    # Each request's copy adds to its own retrieve: twice the copy, not once.
    assert slow[0] - fast[0] == pytest.approx(2 * copy_ms, rel=0.02)
    # Blocks already in host memory take the copy once (no storage read to stage).
    in_dram = ttft(1e9, tier="dram")
    assert in_dram[0] == pytest.approx(2 * copy_ms, rel=0.05)


def test_a_prewarmed_request_uses_the_prefix_an_earlier_one_computed_while_it_queued() -> None:
    """A burst of requests with one prompt: the first computes it, the others arrive
    while it does (nothing of theirs is cached at arrival) and are first scheduled
    after its first token. The engine looks them up when it schedules them, as vLLM's
    scheduler does, so they reuse its blocks, with their loads started at arrival
    (prewarm) as with loads started at scheduling."""
    executor = SimulatedExecutor(capacity_blocks={"hbm": 1_000})
    chunk = executor.profile.model.prefill_chunk_tokens
    prompt = 2 * chunk  # the first request's prefill fills two whole steps
    blocks = tuple(range(prompt // executor.block_size_tokens))
    requests = [SimRequest(float(i), blocks, prompt, 8) for i in range(3)]
    result = run_requests(requests, executor, on_arrival=_store_all(executor, requests))
    # One prefill of the prompt, then a token each for the two others.
    assert result.computed_tokens == prompt + 2
    assert result.hit_blocks_by_tier[0] == 2 * len(blocks)
    # Queued behind the first prefill, then one step: not a second prefill of the prompt.
    assert np.all(result.ttft_ms[1:] < 1.2 * result.ttft_ms[0])

    held = SimulatedExecutor(capacity_blocks={"hbm": 1_000})
    released = run_requests(
        requests,
        held,
        on_arrival=lambda i, t: None,
        release=_store_all(held, requests),
    )
    assert released.computed_tokens == result.computed_tokens
