"""``bench serve``'s open-loop bookkeeping, without a broker: the Kafka open loop's
stamps, and the median of repeated runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.sidecar import OpenLoopResult, _ArrivalTimedSource, median_run
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
