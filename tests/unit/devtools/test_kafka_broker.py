"""The pure parts of devtools.kafka_broker: what it writes and how it decides which
process is its broker. Starting a real broker is the integration tests' job."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from devtools.kafka_broker import (
    BrokerConfig,
    KafkaBroker,
    KafkaBrokerError,
    broker_ready,
    free_port,
    is_our_broker,
    jvm_options,
    new_cluster_id,
    render_pom,
    render_server_properties,
)

POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}


def test_pom_asks_for_the_broker_and_exactly_the_slf4j_1_binding() -> None:
    root = ET.fromstring(render_pom("4.4.0", "2.25.5"))
    deps = [
        (d.findtext("m:groupId", namespaces=POM_NS), d.findtext("m:artifactId", namespaces=POM_NS),
         d.findtext("m:version", namespaces=POM_NS))
        for d in root.iterfind("m:dependencies/m:dependency", POM_NS)
    ]  # fmt: skip
    assert ("org.apache.kafka", "kafka_2.13", "4.4.0") in deps
    # Kafka 4.x ships slf4j-api 1.7.36: the 1.x binding, never log4j-slf4j2-impl.
    assert ("org.apache.logging.log4j", "log4j-slf4j-impl", "2.25.5") in deps
    assert not any(artifact == "log4j-slf4j2-impl" for _, artifact, _ in deps)


def _props(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_server_properties_one_combined_node_on_loopback(tmp_path: Path) -> None:
    cfg = BrokerConfig(
        port=19092, controller_port=19093, data_dir=tmp_path / "data", cluster_id="x"
    )
    props = _props(render_server_properties(cfg))
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:19093"
    # format --standalone refuses a static voter list next to it.
    assert "controller.quorum.voters" not in props
    assert props["log.dirs"] == str(tmp_path / "data")
    assert props["offsets.topic.num.partitions"] == "1"
    assert "localhost" not in render_server_properties(cfg)


def test_cluster_ids_look_like_kafka_uuids() -> None:
    ids = {new_cluster_id() for _ in range(500)}
    assert len(ids) == 500
    for cid in ids:
        assert len(cid) == 22 and not cid.startswith("-")
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_ready_only_on_the_started_line() -> None:
    assert broker_ready(
        b"[2026] INFO [KafkaRaftServer nodeId=1] Kafka Server started (kafka.server.KafkaRaftServer)\n"
    )
    assert not broker_ready(
        b"[2026] INFO [BrokerServer id=1] Waiting for the broker to be unfenced\n"
    )
    assert not broker_ready(b"")


def test_jvm_options_small_heap_and_own_tmpdir(tmp_path: Path) -> None:
    opts = jvm_options(384, tmp_path / "tmp", tmp_path / "log4j2.properties")
    assert "-Xmx384m" in opts
    assert f"-Djava.io.tmpdir={tmp_path / 'tmp'}" in opts
    assert "-XX:TieredStopAtLevel=1" in opts
    assert "-XX:+UseSerialGC" in opts  # G1 paused a broker on two busy cores for 150-200 ms
    assert "-XX:TieredStopAtLevel=1" not in jvm_options(384, tmp_path, tmp_path, fast_start=False)
    with pytest.raises(KafkaBrokerError, match="at least 128"):
        jvm_options(64, tmp_path, tmp_path)


def test_a_pid_is_ours_only_if_it_runs_kafka_on_our_properties(tmp_path: Path) -> None:
    props = tmp_path / "server.properties"
    # A live process whose command line names the file but is not kafka.Kafka.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(props)])
    try:
        assert not is_our_broker(proc.pid, props)
    finally:
        proc.kill()
        proc.wait()
    assert not is_our_broker(proc.pid, props)  # gone


def test_stop_never_signals_a_stranger_named_in_a_stale_pid_file(tmp_path: Path) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        broker = KafkaBroker(tmp_path)
        broker.pid_path.write_text(f"{stranger.pid}\n")
        assert broker.status().running is False
        assert broker.stop(grace_s=1) is False
        assert stranger.poll() is None  # still alive
        assert not broker.pid_path.exists()  # the stale file is cleaned up
    finally:
        stranger.kill()
        stranger.wait()


def test_ports_and_cluster_id_are_kept_for_restarts(tmp_path: Path) -> None:
    first = KafkaBroker(tmp_path, port=free_port()).config()
    again = KafkaBroker(tmp_path).config()  # a later start on the same dir
    assert again == first
    assert first.port != first.controller_port
    saved = json.loads((tmp_path / "broker.json").read_text())
    assert saved["port"] == first.port and saved["cluster_id"] == first.cluster_id
