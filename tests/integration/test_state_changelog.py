"""Snapshots in a real compacted Kafka topic: written in chunks, read back by a new
store (a restarted or another sidecar), and the topic is created compacted."""

from __future__ import annotations

import numpy as np
import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from serving.kafka_io import KafkaChangelog
from serving.state_store import StateStore

pytestmark = pytest.mark.integration


def test_snapshots_survive_in_a_compacted_topic(kafka_bootstrap: str, unique_topic) -> None:
    topic = unique_topic("changelog")
    state = {
        "last_access": np.arange(200_000, dtype=np.int64),  # 1.6 MB: several chunks
        "origin": "req-1",
    }
    writer = KafkaChangelog(kafka_bootstrap, topic)
    try:
        store = StateStore(writer, max_chunk_bytes=256 << 10)
        assert store.save("g/events/0", state) == 1
        state["origin"] = "req-2"
        assert store.save("g/events/0", state) == 2
        store.save("g/events/1", {"origin": "other partition"})
    finally:
        writer.close()

    reader = KafkaChangelog(kafka_bootstrap, topic)  # a fresh process's view
    try:
        restored = StateStore(reader).load("g/events/0")
        assert restored is not None and restored["origin"] == "req-2"
        assert np.array_equal(restored["last_access"], state["last_access"])
        assert StateStore(reader).load("g/events/1") == {"origin": "other partition"}
        assert StateStore(reader).save("g/events/0", {"origin": "req-3"}) == 3
    finally:
        reader.close()

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        # {resource type: {resource name: {config key: {config data}}}}
        [by_name] = described.values()
        policy = by_name[topic]["cleanup.policy"]
        assert (policy.get("value") if isinstance(policy, dict) else policy) == "compact"
    finally:
        admin.close()
