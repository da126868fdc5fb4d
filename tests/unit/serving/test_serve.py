from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from executor.decision import Decision
from features.decoders import read_trace
from serving.serve_cli import Service
from serving.settings import load_settings

REPO_ROOT = Path(__file__).resolve().parents[3]
BLOCK_BYTES = 64


def _local_config(tmp_path: Path, caps_blocks=(256, 1024, 8192)) -> Path:
    config = tmp_path / "executor.toml"
    hbm, dram, nvme = (c * BLOCK_BYTES for c in caps_blocks)
    config.write_text(
        f"""
[executor]
state_dir = "state"
fsync_journal = false

[[tiers]]
kind = "memory"
name = "hbm"
capacity_bytes = {hbm}

[[tiers]]
kind = "directory"
name = "dram"
root = "tiers/dram"
capacity_bytes = {dram}
fsync = false
verify_writes = false

[[tiers]]
kind = "directory"
name = "nvme"
root = "tiers/nvme"
capacity_bytes = {nvme}
fsync = false
verify_writes = false
"""
    )
    return config


def test_sidecar_with_the_real_executor_applies_decisions_within_capacity(small_trace, tmp_path):
    settings = load_settings(
        None,
        source=f"file:{small_trace}",
        executor=f"local:{_local_config(tmp_path)}",
        decisions=(f"file:{tmp_path / 'decisions.jsonl'}",),
        block_size_bytes=BLOCK_BYTES,
        clock="event",
        http_enabled=False,
        model_poll_interval_s=0,
        planner={"min_residency_ms": 5_000},
        # LFU: under LRU (evicted exactly by recency) the fast tiers already hold the
        # most recent blocks and a prefetch round finds nothing to promote.
        model="lfu",
    )
    service = Service(settings)
    executor = service.executor
    last_move_ms: dict[int, int] = {}
    displaced_too_soon: list[int] = []

    def watch(event, moves, now_ms):
        for m in moves:
            # A prefetch round (event None) displacing a block moved < 5 s ago: ping-pong.
            if (
                event is None
                and m.kind == "demote"
                and now_ms - last_move_ms.get(m.block, -(10**9)) < 5_000
            ):
                displaced_too_soon.append(m.block)
            last_move_ms[m.block] = now_ms

    service.sidecar.hooks.append(watch)
    try:
        stats = service.run(max_events=100)
        used = {name: executor.tier(name).used_bytes for name in executor.tier_names}
        caps = {name: executor.tier(name).capacity_bytes for name in executor.tier_names}
        on_disk = sum(1 for _ in (tmp_path / "tiers" / "nvme").iterdir())
        mirror_agrees = sum(
            executor.locate(block) == name
            for i, name in enumerate(service.placement.tier_names)
            for block in service.placement.members(i)
        )
    finally:
        service.close()
    assert stats.events >= 100
    assert all(used[name] <= caps[name] for name in used), (used, caps)
    for i in range(service.placement.num_tiers):
        assert service.placement.count(i) <= service.placement.capacities[i]
    outcomes = service.executor_sink.outcomes
    decided = sum(n for (action, _), n in outcomes.items() if action != "store")
    applied = sum(n for (a, s), n in outcomes.items() if a != "store" and s == "applied")
    assert decided == service.decisions.num_decisions > 0
    assert applied > 0.9 * decided, outcomes
    assert on_disk > 0  # real files in the directory tier
    assert mirror_agrees > 0.9 * len(service.placement)
    rows = (tmp_path / "decisions.jsonl").read_text().splitlines()
    assert len(rows) == decided
    assert all(Decision.from_dict(json.loads(r)) for r in rows[:50])
    # Hysteresis: speculative rounds did move blocks, but never displaced a fresh one.
    assert stats.moves_by_kind.get("prefetch", 0) > 0
    assert displaced_too_soon == []


def _serve(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_sigterm_finishes_the_batch_and_exits_zero(small_trace, tmp_path):
    out = tmp_path / "decisions.jsonl"
    config = tmp_path / "sidecar.toml"
    # Settings from a file and the environment, as an operator would give them.
    config.write_text(f'source = "file:{small_trace}"\nhttp_port = 0\nbatch_size = 32\n')
    proc = _serve(
        ["--config", str(config), "--decisions", f"file:{out}", "--executor", "sim:default"],
        {"KVWARM_TARGET_BATCH_LATENCY_MS": "5"},
    )
    deadline = time.monotonic() + 120
    while not (out.exists() and out.stat().st_size > 0):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no decisions within 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    text = stderr.decode()
    assert "health and metrics on http://127.0.0.1:" in text
    handled = int(text.rsplit("kvwarm serve: ", 1)[1].split()[0])
    assert 0 < handled < 3000  # stopped mid-stream, not at the end of the file
    # Every decision written is whole: the batch in hand was finished and flushed.
    rows = out.read_text().splitlines()
    assert rows and all(Decision.from_dict(json.loads(r)) for r in rows)


def test_bad_settings_fail_with_a_usage_error(small_trace):
    proc = _serve(["--source", "http://nope"])
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert (
        "kafka://HOST:PORT/TOPIC, kafka:TOPIC (local broker), file:PATH or zmq://"
        in stderr.decode()
    )


def _trace_settings(trace: Path, **extra: object):
    """A sidecar reading ``trace`` on the event clock, no HTTP, no model polling."""
    return load_settings(
        None,
        source=f"file:{trace}",
        clock="event",
        http_enabled=False,
        model_poll_interval_s=0,
        **extra,
    )


def test_the_trace_is_read_once_through(tmp_path):
    from features.generator import generate_to_file, params_for

    trace = generate_to_file(params_for("chat", num_requests=600, seed=2), tmp_path / "t.jsonl")
    service = Service(_trace_settings(trace))
    try:
        stats = service.run()
    finally:
        service.close()
    events = list(read_trace(trace))
    assert stats.events == len(events)
    assert stats.block_accesses == sum(len(e.block_hashes) for e in events)
    # Batches were sized to the latency target, not the 1024 upper bound.
    assert 1 <= service.source.cap <= 1024
    assert sum(n for _, n in service.source.latencies) == len(events)


def test_what_is_alive_when_serving_starts_is_frozen_out_of_the_collector(tmp_path):
    """A full collection walked every imported library's objects (a 16-30 ms pause in
    the loop); ``run`` freezes what is alive at its start, so it walks only what
    serving creates; ``close`` unfreezes it. Full collections then run only between
    batches (``serving.gc_pacer``), never inside one, and show in health and metrics."""
    import gc

    from features.generator import generate_to_file, params_for

    trace = generate_to_file(params_for("chat", num_requests=50, seed=2), tmp_path / "t.jsonl")
    threshold = gc.get_threshold()
    for paced in (True, False):
        settings = _trace_settings(trace, gc_max_interval_s=60.0 if paced else 0.0)
        gc.unfreeze()
        service = Service(settings)
        frozen: list[int] = []
        thresholds: list[int] = []

        def hook(
            *_: object, frozen: list[int] = frozen, thresholds: list[int] = thresholds
        ) -> None:
            frozen.append(gc.get_freeze_count())
            thresholds.append(gc.get_threshold()[2])

        service.sidecar.hooks.append(hook)
        try:
            assert gc.get_freeze_count() == 0
            service.run()
            if paced:
                health = service.health()["gc"]
                assert health["paced"] and health["collections"] >= 1
                text = service.metrics.text().decode()
                assert "kvwarm_gc_paced_collections_total" in text
                assert "kvwarm_gc_paced_pause_max_seconds" in text
            else:
                assert "gc" not in service.health()
        finally:
            service.close()
        assert frozen and min(frozen) > 10_000  # the libraries, model and settings
        assert gc.get_freeze_count() == 0  # close made them collectable again
        # Paced: CPython starts no full collection while the loop runs.
        assert set(thresholds) == ({1 << 30} if paced else {threshold[2]})
        assert gc.get_threshold() == threshold


def test_print_settings_shows_effective_values_and_hides_secrets():
    proc = _serve(
        ["--print-settings", "--source", "file:events.jsonl"],
        {
            "KVWARM_MLFLOW_TRACKING_TOKEN": "s3cret",
            "KVWARM_MLFLOW_TRACKING_URI": "https://alice:pa55w0rd@mlflow.example:5000/",
            "KVWARM_BATCH_SIZE": "17",
        },
    )
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    shown = json.loads(stdout)
    assert shown["source"] == "file:events.jsonl" and shown["batch_size"] == 17
    assert "s3cret" not in stdout.decode() and shown["mlflow_tracking_token"] == "**********"
    assert "pa55w0rd" not in stdout.decode()
    assert shown["mlflow_tracking_uri"] == "https://***@mlflow.example:5000/"


def test_engine_residency_over_zmq_is_mirrored_by_the_sidecar():
    import threading

    from devtools.vllm_engine import TAGGED, EnginePublisher

    s = TAGGED

    def stored(hashes, medium):
        return s.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
            block_size=16, lora_id=None, medium=medium, lora_name=None,
        )  # fmt: skip

    with EnginePublisher() as publisher:
        settings = load_settings(
            None,
            source=publisher.url("engine0"),
            tier_names=("hbm", "dram"),
            tier_capacities_blocks=(64, 64),
            http_enabled=False,
            model_poll_interval_s=0,
            poll_timeout_ms=20,
        )
        service = Service(settings)
        runner = threading.Thread(target=service.run)
        runner.start()
        try:
            stats = service.sidecar.stats
            engines = lambda: service.source.stats()["engines"]  # noqa: E731
            # ZMQ's slow joiner: wait until the subscription is live.
            publisher.heartbeat_until(lambda: engines()["engine0"]["last_seq"] is not None)
            publisher.publish(s.KVEventBatch(ts=1.0, events=[stored([1, 2, 3], "GPU")]))
            publisher.publish(s.KVEventBatch(ts=2.0, events=[stored([4], "CPU")]))
            publisher.publish(
                s.KVEventBatch(ts=3.0, events=[s.BlockRemoved(block_hashes=[2], medium="GPU")])
            )
            deadline = time.monotonic() + 30
            while stats.events < 3:
                assert time.monotonic() < deadline, service.source.stats()
                time.sleep(0.05)
        finally:
            service.stop()
            runner.join(timeout=30)
            service.close()
    placement = service.placement
    assert sorted(placement.members(0)) == [1, 3] and placement.members(1) == [4]
    assert stats.requests == 0  # residency only: nothing to decide


def test_a_learned_model_is_served_behind_the_guard_visible_in_health_and_metrics(
    small_trace, tmp_path
):
    from predictor.guard import GuardedPolicy
    from training.train import fit_policy_on_events

    events = list(read_trace(small_trace))[:1500]
    model_dir = fit_policy_on_events("lightgbm", events, quick=True).save(tmp_path / "model")
    common = dict(
        source=f"file:{small_trace}",
        model=str(model_dir),
        clock="event",
        http_enabled=False,
        model_poll_interval_s=0,
        tier_capacities_blocks=(500, 4_000, 32_000),
    )
    service = Service(load_settings(None, **common))
    try:
        service.run(max_events=1_200)
        guard = service.sidecar.policy
        assert isinstance(guard, GuardedPolicy)
        assert guard.params.capacity_blocks == 500
        assert guard.params.outer_capacity_blocks == 500 + 4_000  # HBM and DRAM
        health = service.health()["guard"]
        # Judged mostly on HBM + DRAM: a DRAM read costs ~1% of an NVMe read.
        assert 0.95 < guard.params.outer_weight < 1.0
        assert health["outer_weight"] == guard.params.outer_weight
        assert health["chosen"] in ("lightgbm", "lru", "lfu", "lru2")
        assert set(health["estimated_hit_ratio"]) == {"lightgbm", "lru", "lfu", "lru2"}
        assert health["sampled_accesses"] > 0
        gate = service.health()["prefetch_gate"]
        assert gate["rounds"] > 0 and gate["used"] + gate["wasted"] > 0
        assert 0.0 <= gate["precision"] <= 1.0
        text = service.metrics.text().decode()
        assert f'kvwarm_guard_choice{{policy="{health["chosen"]}"}} 1.0' in text
        assert "kvwarm_guard_estimated_hit_ratio" in text
        served = health["served_requests"]
        assert sum(served.values()) == service.sidecar.stats.requests
        for name, count in served.items():
            assert f'kvwarm_guard_served_requests_total{{policy="{name}"}} {float(count)}' in text
        # A hot-swapped model goes behind the guard too.
        service.sidecar.swap_policy(fit_policy_on_events("lightgbm", events, quick=True))
        assert isinstance(service.sidecar.policy, GuardedPolicy)
    finally:
        service.close()
    unguarded = Service(load_settings(None, guard=False, **common))
    try:
        assert unguarded.sidecar.policy.name == "lightgbm"
        assert "guard" not in unguarded.health()
    finally:
        unguarded.close()


def test_readyz_waits_for_a_zmq_engine_to_connect():
    import socket
    import threading

    import zmq

    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = load_settings(
        None,
        source=f"zmq://127.0.0.1:{port}",
        http_port=0,
        model_poll_interval_s=0,
        poll_timeout_ms=20,
    )
    service = Service(settings).start()
    runner = threading.Thread(target=service.run)
    runner.start()

    def readyz() -> int:
        try:
            with urllib.request.urlopen(service.http.url + "/readyz", timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        time.sleep(0.3)  # the loop polls with no engine behind the address
        assert readyz() == 503
        engine = zmq.Context.instance().socket(zmq.PUB)  # an engine's publisher appears
        engine.setsockopt(zmq.LINGER, 0)
        engine.bind(f"tcp://127.0.0.1:{port}")
        try:
            deadline = time.monotonic() + 30
            while readyz() != 200:
                assert time.monotonic() < deadline, "never ready with an engine connected"
                time.sleep(0.05)
        finally:
            engine.close()
    finally:
        service.stop()
        runner.join(timeout=30)
        service.close()
