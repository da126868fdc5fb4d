"""Any exception while handling one event dead-letters that event; the stream goes on."""

from __future__ import annotations

import json

from features.events import Event
from predictor.baselines import LRUPolicy
from serving.loop import Sidecar
from serving.placement import Placement
from serving.planner import Planner
from serving.sources import FileSource


class _PoisonedLRU(LRUPolicy):
    """LRU that raises on the events whose timestamp is in ``poison_ts``."""

    def __init__(self, poison_ts: set[int]) -> None:
        super().__init__()
        self.poison_ts = poison_ts

    def observe(self, event: Event) -> None:
        if event.ts_ms in self.poison_ts:
            raise OverflowError("int too large to convert to float")
        super().observe(event)


def test_an_event_that_breaks_handling_is_dead_lettered_and_the_rest_are_handled(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": ts, "input_length": 512, "hash_ids": [ts, ts + 1000]} for ts in range(100)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rejects = tmp_path / "rejects.jsonl"
    source = FileSource(trace, rejects_path=rejects)
    sidecar = Sidecar(_PoisonedLRU({10, 50, 51}), Planner(), Placement(["hbm", "dram"], [16, 64]))
    stats = sidecar.run(source, batch_size=7)
    source.close()
    assert stats.requests == 97
    assert source.stats()["rejects_by_reason"] == {"handler_error": 3}
    records = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [json.loads(r["raw"])["ts_ms"] for r in records] == [10, 50, 51]
    assert all("OverflowError" in r["error"] for r in records)
