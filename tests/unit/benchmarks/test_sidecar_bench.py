"""``bench serve``'s open-loop bookkeeping, without a broker: the Kafka open loop's
stamps, the median of repeated runs, and the pacing of the events."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.sidecar import (
    OpenLoopResult,
    _ArrivalTimedSource,
    median_run,
    paced,
    write_events,
)
from features.decoders import read_trace
from features.events import BlocksAccessed
from serving.loop import LoopStats


class _Inner:
    def __init__(self) -> None:
        self.batches = [["a", "b"], [], ["c"]]
        self.commits = 0

    def poll(self, max_events: int, timeout_ms: int) -> list[Any]:
        ids = self.batches.pop(0) if self.batches else []
        return [SimpleNamespace(request_id=r) for r in ids]

    def commit(self) -> None:
        self.commits += 1

    def stats(self) -> dict[str, Any]:
        return {"commits": self.commits}


def test_each_event_is_stamped_at_the_commit_after_its_poll() -> None:
    source = _ArrivalTimedSource(_Inner())
    source.poll(10, 100)
    source.commit()
    first = dict(source.committed_at)
    assert set(first) == {"a", "b"} and first["a"] == first["b"]
    source.poll(10, 100)
    source.poll(10, 100)
    source.commit()
    assert set(source.committed_at) == {"a", "b", "c"}
    assert source.committed_at["c"] >= first["a"]
    assert source.committed_at["a"] == first["a"]  # a later commit does not restamp it
    assert source.stats() == {"commits": 2}  # the rest is the inner source's


def _run(p99_ms: float) -> OpenLoopResult:
    stats = LoopStats(events=10, batches=5)
    return OpenLoopResult(100.0, 1.0, p99_ms, stats, elapsed_s=1.0)


def test_repeated_open_loops_print_the_median_p99_run_with_the_range() -> None:
    runs = [_run(50.0), _run(10.0), _run(30.0)]
    chosen = median_run(runs)
    assert chosen.p99_ms == 30.0 and chosen is not runs[2]  # a copy, with the range
    assert chosen.p99_range_ms == (10.0, 50.0)
    assert chosen.row("open  learned @0.5x max", 120.0).endswith("10.0-50.0")
    assert median_run([_run(40.0), _run(20.0)]).p99_ms == 20.0  # the lower middle
    single = median_run([_run(7.0)])
    assert single.p99_range_ms is None and not single.row("x", 1.0).endswith("7.0-7.0")
    with pytest.raises(ValueError, match="no open-loop runs"):
        median_run([])


def _events(stamps: list[int]) -> list[BlocksAccessed]:
    return [
        BlocksAccessed(ts_ms=t, request_id=str(i), block_hashes=(i, i + 1), block_size_tokens=16)
        for i, t in enumerate(stamps)
    ]


def test_paced_events_pass_event_time_at_the_offered_rate() -> None:
    # 5 events over 80 s of trace time, bursty: paced to 100 events/s, the 4 gaps
    # take 40 ms in all, in the same proportions, in the same order.
    events = _events([1_000, 1_000, 11_000, 71_000, 81_000])
    out = paced(events, 100.0)
    assert [e.ts_ms for e in out] == [1_000, 1_000, 1_005, 1_035, 1_040]
    assert [e.request_id for e in out] == ["0", "1", "2", "3", "4"]
    assert [e.block_hashes for e in out] == [e.block_hashes for e in events]
    # slower than stamped: stretched
    assert paced(events, 0.01)[-1].ts_ms == 1_000 + 400_000
    # nothing to pace: as they are
    assert paced(events[:1], 100.0) == events[:1]
    assert paced(_events([5, 5, 5]), 100.0) == _events([5, 5, 5])
    with pytest.raises(ValueError, match="rate must be positive"):
        paced(events, 0.0)


def test_written_events_read_back_the_same(tmp_path: Any) -> None:
    events = paced(_events([0, 3_000, 9_000]), 10.0)
    assert list(read_trace(write_events(events, tmp_path / "paced.jsonl"))) == events
