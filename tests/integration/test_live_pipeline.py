"""The live pipeline as the README runs it: ``kvwarm produce`` a trace into the real
broker, ``kvwarm serve`` it from Kafka with a learned model, and compare with serving
the same file directly with the same model. With event time (the default on both
paths) the decisions are the same, id for id and action for action.

Also: a sidecar on the wall clock refuses events stamped in trace time (instead of
scoring them with features decades out of range), and ``produce --restamp`` makes the
same events acceptable to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 600


def _kvwarm(*args: str, env: dict[str, str] | None = None, timeout_s: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="module")
def trace_and_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from features.decoders import read_trace
    from features.generator import generate_to_file, params_for
    from training.train import fit_policy_on_events

    root = tmp_path_factory.mktemp("live")
    trace = generate_to_file(
        params_for("chat", num_requests=NUM_REQUESTS, seed=3), root / "chat.jsonl"
    )
    policy = fit_policy_on_events("lightgbm", list(read_trace(trace)), quick=True)
    return trace, policy.save(root / "model")


def _decisions(path: Path) -> list[tuple[str, str, int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["decision_id"], r["action"], r["block_hash"]) for r in rows]


def test_produce_kafka_serve_decides_what_the_file_path_decides(
    trace_and_model, kafka_bootstrap, unique_topic, tmp_path
):
    trace, model = trace_and_model
    topic = unique_topic("events")
    common = ["--model", str(model), "--executor", "none", "--http-port", "0"]

    from_file = tmp_path / "from-file.jsonl"
    done = _kvwarm(
        "serve", "--source", f"file:{trace}", *common, "--decisions", f"file:{from_file}"
    )
    assert done.returncode == 0, done.stderr
    assert "event clock" in done.stderr

    env = {"KVWARM_KAFKA_BOOTSTRAP": kafka_bootstrap}
    # One partition: the sidecar sees the trace's order, as the file source does.
    produced = _kvwarm(
        "produce", str(trace), "--topic", topic, "--partitions", "1", "--no-progress", env=env
    )
    assert produced.returncode == 0, produced.stderr
    assert f"produced {NUM_REQUESTS} events" in produced.stdout

    from_kafka = tmp_path / "from-kafka.jsonl"
    served = _kvwarm(
        "serve", "--source", f"kafka:{topic}", *common, "--decisions", f"file:{from_kafka}",
        "--max-events", str(NUM_REQUESTS),
        env={**env, "KVWARM_KAFKA_GROUP_ID": topic},
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    assert f"{NUM_REQUESTS} events" in served.stderr

    file_decisions = _decisions(from_file)
    assert len(file_decisions) > NUM_REQUESTS  # a real workload, not an empty comparison
    assert _decisions(from_kafka) == file_decisions


def test_wall_clock_refuses_trace_time_and_accepts_restamped_events(
    trace_and_model, kafka_bootstrap, unique_topic
):
    trace, model = trace_and_model
    env = {"KVWARM_KAFKA_BOOTSTRAP": kafka_bootstrap}
    serve = ["serve", "--model", str(model), "--clock", "wall", "--http-port", "0"]

    old_topic = unique_topic("trace-time")
    assert _kvwarm("produce", str(trace), "-t", old_topic, "--limit", "50",
                   "--no-progress", env=env).returncode == 0  # fmt: skip
    refused = _kvwarm(
        *serve, "--source", f"kafka:{old_topic}", "--max-events", "50",
        env={**env, "KVWARM_KAFKA_GROUP_ID": old_topic},
    )  # fmt: skip
    assert refused.returncode == 1
    error = refused.stderr.strip().splitlines()[-1]
    assert "Traceback" not in refused.stderr and "--restamp" in error, refused.stderr

    new_topic = unique_topic("restamped")
    restamped = _kvwarm(
        "produce", str(trace), "-t", new_topic, "--limit", "50", "--restamp", "--no-progress",
        env=env,
    )  # fmt: skip
    assert restamped.returncode == 0 and "restamped" in restamped.stdout, restamped.stderr
    accepted = _kvwarm(
        *serve, "--source", f"kafka:{new_topic}", "--max-events", "50",
        env={**env, "KVWARM_KAFKA_GROUP_ID": new_topic},
    )  # fmt: skip
    assert accepted.returncode == 0, accepted.stderr
