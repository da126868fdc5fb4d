"""Fixtures for tests against real services: the Kafka broker.

``kafka_bootstrap`` is the broker every Kafka test shares: ``$KVWARM_KAFKA_BOOTSTRAP``
when set, else one broker started (once per session) through
``devtools.kafka_broker`` in a temporary state dir and stopped at the end. With CI=true
a broker that cannot start fails the run; elsewhere the Kafka tests are skipped with
the reason (no Java or Maven on a laptop).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.kafka_broker import KafkaBroker, KafkaBrokerError


def pytest_configure(config: pytest.Config) -> None:
    # kafka-python 3.0 loads its protocol schemas with importlib.resources' legacy API.
    for message in ("read_text is deprecated", "open_text is deprecated"):
        config.addinivalue_line("filterwarnings", f"ignore:{message}:DeprecationWarning")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def start_broker_or_fail(state_dir: Path) -> KafkaBroker:
    """A started broker; in CI a failure fails the test, elsewhere it skips."""
    broker = KafkaBroker(state_dir, heap_mb=384, die_with_parent=True)
    try:
        broker.start(timeout_s=120)
    except KafkaBrokerError as exc:
        broker.destroy()
        if _in_ci():
            pytest.fail(f"CI must run the Kafka tests, but the broker did not start: {exc}")
        pytest.skip(f"no local Kafka broker (set KVWARM_KAFKA_BOOTSTRAP to use one): {exc}")
    return broker


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a running Kafka 4.x broker."""
    external = os.environ.get("KVWARM_KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    broker = start_broker_or_fail(tmp_path_factory.mktemp("kafka-broker"))
    try:
        yield broker.bootstrap
    finally:
        broker.destroy()


@pytest.fixture
def own_kafka_broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    """A broker of this test alone (it may stop and restart it), destroyed afterwards."""
    broker = start_broker_or_fail(tmp_path / "kafka-own")
    try:
        yield broker
    finally:
        broker.destroy()


@pytest.fixture
def unique_topic(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """``unique_topic("events")`` -> a topic name no other test (or earlier run against
    the same broker) uses: the test's name, the suffix, and a random tag."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]
    tag = uuid.uuid4().hex[:8]

    def make(suffix: str = "events") -> str:
        return f"{base}.{suffix}.{tag}"

    return make
