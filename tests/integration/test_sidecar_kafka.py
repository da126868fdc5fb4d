"""The sidecar end to end against the real broker: events in, decisions out on the
decisions topic, offsets committed only after the decisions are delivered; a sidecar
killed with SIGKILL mid-stream and restarted leaves no event undecided.

The workload makes "decided" observable: each request reads three blocks nobody has
seen, the fastest tier holds two, so every request yields at least one decision (a
demotion out of the fastest tier), stamped with the request's own ``ts_ms`` (event
clock). An event is decided iff its ``ts_ms`` appears on the decisions topic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from features.events import BlocksAccessed

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
TS_STEP_MS = 10


def _events(n: int) -> list[BlocksAccessed]:
    return [
        BlocksAccessed(
            ts_ms=(i + 1) * TS_STEP_MS,
            request_id=f"req-{i}",
            block_hashes=(3 * i + 1, 3 * i + 2, 3 * i + 3),
            block_size_tokens=16,
        )
        for i in range(n)
    ]


def _produce(bootstrap: str, topic: str, events: list[BlocksAccessed], partitions: int = 2) -> None:
    from serving.kafka_io import KafkaEventProducer, ensure_topics

    ensure_topics(bootstrap, {topic: partitions})
    with KafkaEventProducer(bootstrap, topic) as producer:
        for event in events:
            producer.send_event(event)


def _decided_ts(bootstrap: str, topic: str) -> list[int]:
    from serving.kafka_io import decode_decision_record, read_topic

    return [
        d["ts_ms"]
        for r in read_topic(bootstrap, topic)
        if r.value
        for d in decode_decision_record(r.value)
    ]


SETTINGS_ENV = {
    "KVWARM_TIER_NAMES": '["hbm", "dram"]',
    "KVWARM_TIER_CAPACITIES_BLOCKS": "[2, 1000000]",
    "KVWARM_PREFETCH": "false",
    "KVWARM_CLOCK": "event",
    "KVWARM_HTTP_PORT": "0",
    "KVWARM_MODEL_POLL_INTERVAL_S": "0",
}


def test_events_in_decisions_out_and_offsets_committed(
    kafka_bootstrap: str, unique_topic: Callable[[str], str], monkeypatch
) -> None:
    from serving.kafka_io import KafkaEventSource
    from serving.serve_cli import Service
    from serving.settings import load_settings

    events_topic, decisions_topic, group = (
        unique_topic("events"), unique_topic("decisions"), unique_topic("group"),
    )  # fmt: skip
    events = _events(300)
    _produce(kafka_bootstrap, events_topic, events)
    for key, value in SETTINGS_ENV.items():
        monkeypatch.setenv(key, value)
    settings = load_settings(
        None,
        source=f"kafka://{kafka_bootstrap}/{events_topic}",
        decisions=(f"kafka://{kafka_bootstrap}/{decisions_topic}",),
        kafka_group_id=group,
        batch_size=40,
    )
    service = Service(settings).start()
    try:
        stats = service.run(max_events=len(events))
        assert service.http is not None
        with urllib.request.urlopen(service.http.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
    finally:
        service.close()
    assert stats.events == len(events)
    decided = _decided_ts(kafka_bootstrap, decisions_topic)
    # The first event handled finds the cache empty: its blocks are stored (2 in hbm,
    # the third straight into dram: moves are netted per block) and a store makes no
    # decision. Every later request demotes residents, so it decides something.
    every = {e.ts_ms for e in events}
    assert set(decided) <= every and len(every - set(decided)) <= 1
    assert len(decided) == service.decisions.num_decisions

    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert values[("kvwarm_events_consumed_total", (("type", "access"),))] == len(events)
    assert values[("kvwarm_block_accesses_total", ())] == 3 * len(events)
    total = sum(v for (name, _), v in values.items() if name == "kvwarm_decisions_total")
    assert total == len(decided)

    # Everything handled was committed: the group has nothing left to read.
    with KafkaEventSource(kafka_bootstrap, events_topic, group_id=group) as again:
        leftover = []
        for _ in range(10):
            leftover += again.poll(100, timeout_ms=300)
    assert leftover == []


def _spawn(args: list[str], env_extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **SETTINGS_ENV, **env_extra}
    return subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str, proc) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"sidecar exited with {proc.returncode} waiting for {what}: "
                        f"{proc.stderr.read().decode()[-2000:]}")  # fmt: skip
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def test_sigkill_mid_stream_then_restart_leaves_no_event_undecided(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    events_topic, decisions_topic, group = (
        unique_topic("events"), unique_topic("decisions"), unique_topic("group"),
    )  # fmt: skip
    events = _events(3_000)
    _produce(kafka_bootstrap, events_topic, events)
    wanted = {e.ts_ms for e in events}
    args = [
        "--source", f"kafka://{kafka_bootstrap}/{events_topic}",
        "--decisions", f"kafka://{kafka_bootstrap}/{decisions_topic}",
        "--batch-size", "25",
    ]  # fmt: skip
    env = {"KVWARM_KAFKA_GROUP_ID": group, "KVWARM_TARGET_BATCH_LATENCY_MS": "2"}

    first = _spawn(args, env)
    try:
        _wait_for(
            lambda: len(_decided_ts(kafka_bootstrap, decisions_topic)) > 300,
            120, "the first decisions", first,
        )  # fmt: skip
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    assert first.returncode == -signal.SIGKILL
    before = set(_decided_ts(kafka_bootstrap, decisions_topic))
    assert before and not wanted <= before, "killed too late: nothing was left to redo"

    # Each sidecar's state starts empty (it is not checkpointed yet), so the first event
    # each handles only stores its blocks and decides nothing; every other event
    # decides something.
    second = _spawn(args, env)
    try:
        _wait_for(
            lambda: len(wanted - set(_decided_ts(kafka_bootstrap, decisions_topic))) <= 2,
            180, "every event decided", second,
        )  # fmt: skip
        time.sleep(2)  # let the last batch land before SIGTERM
    finally:
        second.send_signal(signal.SIGTERM)
        _, stderr = second.communicate(timeout=60)
    assert second.returncode == 0, stderr.decode()[-2000:]
    decided = _decided_ts(kafka_bootstrap, decisions_topic)
    assert set(decided) <= {e.ts_ms for e in events}  # nothing invented
    assert len(wanted - set(decided)) <= 2  # nothing undecided but each process's first
