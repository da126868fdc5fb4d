"""Flush/commit cadence of the sidecar and the Kafka clients' latency settings, without
a broker: batch sizing in ``MeteredSource`` (flush not charged per event, catch-up
batches behind a backlog), producers' metadata warm-up and their failure when no broker
answers, the security settings in librdkafka's names."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

import serving.kafka_io as kafka_io
import serving.serve_cli as serve_cli
from features.events import BlocksAccessed
from serving.http import SidecarMetrics
from serving.kafka_io import ConnectOptions, KafkaDecisionSink
from serving.serve_cli import MeteredSource


def _event(i: int) -> BlocksAccessed:
    return BlocksAccessed(
        ts_ms=1_000 + i, request_id=f"r{i}", block_hashes=(i + 1,), block_size_tokens=16
    )


class _Backlog:
    """An EventSource holding ``n`` events; records what each poll asked for."""

    def __init__(self, n: int) -> None:
        self.events = [_event(i) for i in range(n)]
        self.asked: list[int] = []
        self.exhausted = False

    def poll(self, max_events: int, timeout_ms: int) -> list[BlocksAccessed]:
        self.asked.append(max_events)
        out, self.events = self.events[:max_events], self.events[max_events:]
        return out

    def commit(self) -> None: ...

    def dead_letter(self, event: Any, reason: str, error: str) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {}


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(
        serve_cli, "time", SimpleNamespace(perf_counter=c.perf_counter, time=c.time)
    )
    return c


def _metered(inner: _Backlog, cap: int | None = None) -> MeteredSource:
    """``inner`` metered for a 20 ms batch target (``cap`` events a poll, when given)."""
    source = MeteredSource(inner, SidecarMetrics(), target_batch_latency_ms=20)
    if cap is not None:
        source.cap = cap
    return source


def test_the_sink_flush_is_not_charged_to_each_event_of_a_batch(clock: _Clock) -> None:
    inner = _Backlog(0)
    source = _metered(inner)
    for i in range(5):  # one event per poll: 1 ms of handling, then a 4 ms flush
        inner.events = [_event(i)]
        assert len(source.poll(1024, 100)) == 1
        clock.now += 0.005
        source.delivered(flush_s=0.004)
    # 1 ms per event fits 20 in the target (the flush counted per event: 4)
    assert source.cost_per_event_s == pytest.approx(0.001)
    inner.events = [_event(i) for i in range(100)]
    assert len(source.poll(1024, 100)) == 20


def test_a_backlog_is_drained_in_growing_batches(clock: _Clock) -> None:
    inner = _Backlog(1_000)
    source = _metered(inner, cap=10)
    sizes = [len(source.poll(1024, 100)) for _ in range(5)]
    # full polls double the next ask (a backlog waits), up to MAX_CATCH_UP x the cap
    assert sizes == [10, 20, 40, 40, 40]
    inner.events = inner.events[:15]
    assert len(source.poll(1024, 100)) == 15  # short of the 40 asked
    assert source.catch_up == 1  # so back to the cap
    inner.events = [_event(i) for i in range(50)]
    assert len(source.poll(1024, 100)) == 10


def test_catch_up_never_asks_past_the_batch_size(clock: _Clock) -> None:
    inner = _Backlog(1_000)
    source = _metered(inner, cap=16)
    for _ in range(6):
        source.poll(64, 100)
    assert max(inner.asked) == 64


# --- Kafka clients (fakes: no broker) ------------------------------------------------------


class _FakeProducer:
    """Stands in for ``confluent_kafka.Producer``: records which topics' metadata is asked
    for; ``answers`` False: every metadata request times out (no broker)."""

    metadata_asked: list[str | None] = []
    answers = True

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> object:
        _FakeProducer.metadata_asked.append(topic)
        if not _FakeProducer.answers:
            raise kafka_io.rdk.KafkaException(
                kafka_io.rdk.KafkaError(kafka_io.rdk.KafkaError._TRANSPORT)  # noqa: SLF001
            )
        return object()

    def flush(self, timeout: float = -1) -> int:
        return 0

    def close(self) -> None: ...


NO_PROBE = ConnectOptions(probe_s=0, attempts=2, backoff_s=0.0)


def test_producers_learn_their_topic_before_the_first_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kafka_io.rdk, "Producer", _FakeProducer)
    monkeypatch.setattr(_FakeProducer, "metadata_asked", [])
    KafkaDecisionSink("127.0.0.1:1", "decisions", options=NO_PROBE)
    kafka_io.KafkaEventProducer("127.0.0.1:1", "events", options=NO_PROBE)
    assert _FakeProducer.metadata_asked == ["decisions", "events"]


def test_a_producer_no_broker_answers_fails_naming_the_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kafka_io.rdk, "Producer", _FakeProducer)
    monkeypatch.setattr(_FakeProducer, "metadata_asked", [])
    monkeypatch.setattr(_FakeProducer, "answers", False)
    with pytest.raises(kafka_io.KafkaUnavailableError, match=r"127\.0\.0\.1:1 .* 2 tries"):
        KafkaDecisionSink("127.0.0.1:1", "decisions", options=NO_PROBE)
    assert _FakeProducer.metadata_asked == ["decisions", "decisions"]


def test_security_settings_reach_librdkafka_by_its_names() -> None:
    security = kafka_io.KafkaSecurity(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password="s3cret",
        ssl_cafile="ca.pem",
        ssl_check_hostname=False,
    )
    assert security.librdkafka_config() == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "svc",
        "sasl.password": "s3cret",
        "ssl.ca.location": "ca.pem",
        "ssl.endpoint.identification.algorithm": "none",
    }
