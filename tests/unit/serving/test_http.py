from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from features.generator import generate_to_file, params_for
from serving.serve_cli import Service
from serving.settings import load_settings

BAD_ROWS = [
    "{this is not json",
    '{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}',
    '{"timestamp": 7, "input_length": 10, "output_length": 1, "hash_ids": "nope"}',
]


@pytest.fixture(scope="module")
def trace_with_bad_rows(tmp_path_factory) -> tuple[Path, int, int]:
    """300 generated requests with 3 malformed rows spliced in: (path, good rows, blocks)."""
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    generate_to_file(params_for("mixed", num_requests=300, seed=5), path)
    lines = path.read_text().splitlines()
    blocks = sum(len(json.loads(line)["hash_ids"]) for line in lines)
    for i, bad in enumerate(BAD_ROWS):
        lines.insert(50 + 100 * i, bad)
    path.write_text("\n".join(lines) + "\n")
    return path, 300, blocks


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _service(tmp_path: Path, trace: Path, **overrides) -> Service:
    settings = load_settings(
        None,
        source=f"file:{trace}",
        decisions=(f"file:{tmp_path / 'decisions.jsonl'}",),
        executor="sim:default",
        tier_names=("hbm", "dram"),
        tier_capacities_blocks=(256, 2048),
        clock="event",
        http_port=0,
        model_poll_interval_s=0,
        **overrides,
    )
    return Service(settings).start()


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_metrics_parse_and_match_what_was_sent(tmp_path, trace_with_bad_rows):
    trace, num_good, num_blocks = trace_with_bad_rows
    service = _service(tmp_path, trace)
    try:
        status, body = _get(service.http.url + "/readyz")
        assert status == 503  # not polling yet
        service.run()
        status, body = _get(service.http.url + "/metrics")
        assert status == 200
        samples = _samples(body.decode())
        health_status, health = _get(service.http.url + "/healthz")
        ready_status, _ = _get(service.http.url + "/readyz")
        missing_status, _ = _get(service.http.url + "/nope")
    finally:
        service.close()

    def value(name: str, **labels: str) -> float:
        rows = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(s.value for s in rows)

    assert value("kvwarm_events_consumed_total", type="access") == num_good
    assert value("kvwarm_block_accesses_total") == num_blocks
    assert value("kvwarm_loop_batches_total") >= 1
    assert value("kvwarm_loop_seconds_total", phase="handle") > 0
    assert {s.labels["phase"] for s in samples["kvwarm_loop_seconds_total"]} == {
        "poll", "handle", "deliver", "commit",
    }  # fmt: skip
    assert value("kvwarm_rejects_total") == len(BAD_ROWS)
    assert len(samples["kvwarm_rejects_total"]) >= 2  # by reason

    rows = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    by_action = Counter(r["action"] for r in rows)
    assert value("kvwarm_decisions_total") == len(rows) > 0
    for action, n in by_action.items():
        assert value("kvwarm_decisions_total", action=action) == n
    applied = value("kvwarm_executor_outcomes_total", status="applied")
    assert 0 < applied <= value("kvwarm_executor_outcomes_total")

    # One latency observation per good event; scoring observed once per score call.
    assert value("kvwarm_event_to_decision_seconds_count") == num_good
    assert value("kvwarm_scoring_seconds_count") == service.sidecar.stats.score_calls > 0
    assert value("kvwarm_tier_occupancy_blocks", tier="hbm") <= 256
    assert value("kvwarm_tier_capacity_blocks", tier="dram") == 2048
    assert value("kvwarm_model_info", policy="lru", status="ok") == 1
    assert value("kvwarm_model_degraded") == 0
    assert value("kvwarm_lag_seconds") == 0  # replaying on the event clock: no lag

    assert health_status == 200 and json.loads(health)["status"] == "ok"
    assert ready_status == 200 and missing_status == 404


def test_healthz_reports_degraded_with_the_reason(tmp_path, trace_with_bad_rows):
    trace, num_good, _ = trace_with_bad_rows
    model = tmp_path / "model"
    model.mkdir()
    (model / "policy.json").write_text('{"policy": "lightgbm"}')
    service = _service(tmp_path, trace, model=str(model), model_fallback="lru")
    try:
        service.run(max_events=100)
        status, body = _get(service.http.url + "/healthz")
        metrics = _samples(_get(service.http.url + "/metrics")[1].decode())
    finally:
        service.close()
    health = json.loads(body)
    assert status == 200  # alive: serving with LRU
    assert health["status"] == "degraded" and health["policy"] == "lru"
    assert "policy.json" in health["reason"] and health["model"] == str(model)
    assert metrics["kvwarm_model_degraded"][0].value == 1
    assert service.sidecar.stats.events >= 100


def test_half_open_connections_hold_a_bounded_number_of_threads() -> None:
    import socket
    import threading
    import time

    from serving.http import HealthServer, SidecarMetrics

    before = threading.active_count()
    server = HealthServer(
        SidecarMetrics(),
        lambda: {"status": "ok"},
        lambda: True,
        port=0,
        timeout_s=0.2,
        num_workers=4,
        max_pending=16,
    ).start()
    idle: list[socket.socket] = []
    try:
        # Connect, send nothing: well over what the pending slots (16) and the listen
        # backlog hold together (a thread per connection would show 64 threads). Each
        # connection past them waits in the kernel for a worker to time one out, so
        # more only make the test slower (300 took 45 s).
        for _ in range(64):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        # While they wait: the server thread plus its workers, not one per connection.
        most = 0
        for _ in range(20):
            most = max(most, threading.active_count() - before)
            time.sleep(0.05)
        assert most <= 1 + 4
        # Once the idle connections time out, the server answers again.
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = _get(f"{server.url}/healthz")
                break
            except OSError:
                assert time.monotonic() < deadline, "healthz never answered again"
                time.sleep(0.2)
        assert status == 200 and json.loads(body) == {"status": "ok"}
    finally:
        for sock in idle:
            sock.close()
        server.close()
