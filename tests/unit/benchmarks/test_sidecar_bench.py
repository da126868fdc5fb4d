"""``bench serve``'s Kafka open loop bookkeeping, without a broker."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from benchmarks.sidecar import _ArrivalTimedSource


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
