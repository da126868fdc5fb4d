"""State that survives (issue 18), on the real broker with real ``kvwarm serve``
processes: the sidecar's state is kept per partition and checkpointed to a compacted
topic (``--state-topic``), so

- after 10 SIGKILLs at random moments and restarts, and
- after a rebalance between two sidecars of one group, one of them SIGKILLed,

the set of decision ids equals a clean run's on the same events. The model is a
LightGBM policy behind the online guard, as ``serve`` serves it; tiers are small so
nearly every request decides something.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_EVENTS = 600
PARTITIONS = 4
SETTINGS_ENV = {
    "KVWARM_TIER_NAMES": '["hbm", "dram", "nvme"]',
    "KVWARM_TIER_CAPACITIES_BLOCKS": "[128, 512, 2048]",
    "KVWARM_CLOCK": "event",
    "KVWARM_HTTP_ENABLED": "false",
    "KVWARM_MODEL_POLL_INTERVAL_S": "0",
    "KVWARM_TARGET_BATCH_LATENCY_MS": "5",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from predictor.registry import make_policy

    policy = make_policy(
        "lightgbm", {"num_boost_round": 4, "seed": 0, "min_data_in_leaf": 5, "num_leaves": 4}
    )
    rng = np.random.default_rng(0)
    x = rng.random((400, len(policy.feature_names)), dtype=np.float32)
    policy.fit(x[:300], x[:300, 0] > 0.5, x[300:], x[300:, 0] > 0.5)
    return policy.save(tmp_path_factory.mktemp("model") / "lightgbm")


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> list:
    from features.decoders import read_trace
    from features.generator import generate_to_file, params_for

    path = tmp_path_factory.mktemp("trace") / "mixed.jsonl"
    generate_to_file(params_for("mixed", num_requests=NUM_EVENTS, seed=11), path)
    return list(read_trace(path))


def _produce(bootstrap: str, topic: str, events: list) -> None:
    from serving.kafka_io import KafkaEventProducer

    with KafkaEventProducer(bootstrap, topic) as producer:  # keyed by prefix root
        for event in events:
            producer.send_event(event)
        producer.flush()


def _spawn(
    bootstrap: str, topic: str, model: Path, out: Path, *, group: str, instance: str,
    state_topic: str, checkpoint_s: float, max_events: int | None = None,
) -> subprocess.Popen[bytes]:  # fmt: skip
    args = [
        "--source", f"kafka://{bootstrap}/{topic}", "--model", str(model),
        "--executor", "none", "--decisions", f"file:{out}", "--batch-size", "20",
        "--state-topic", state_topic, "--state-checkpoint-s", str(checkpoint_s),
    ]  # fmt: skip
    if max_events is not None:
        args += ["--max-events", str(max_events)]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        **SETTINGS_ENV,
        "KVWARM_KAFKA_GROUP_ID": group,
        "KVWARM_KAFKA_GROUP_INSTANCE_ID": instance,
    }
    log = open(str(out) + f".{instance}.log", "ab")  # noqa: SIM115 (the child owns it)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", *args],
            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    finally:
        log.close()


def _ids(*paths: Path) -> list[str]:
    """Decision ids in decision files; a line cut short by a SIGKILL is skipped."""
    out = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line)["decision_id"])
            except (ValueError, KeyError, TypeError):
                continue
    return out


def _logs(out: Path) -> str:
    return "".join(
        f"\n--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-2500:]}"
        for p in sorted(out.parent.glob(out.name + ".*.log"))
    )


def _wait(condition: Callable[[], bool], timeout_s: float, what: str, out: Path, *procs) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(
                    f"sidecar exited with {proc.returncode} waiting for {what}" + _logs(out)
                )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}" + _logs(out))
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(30)


@pytest.fixture(scope="module")
def clean(kafka_bootstrap: str, model_dir: Path, events, tmp_path_factory) -> tuple[str, set[str]]:
    """A topic of 4 partitions holding every event, and the decision ids of a clean run
    over it (a sidecar that is never stopped)."""
    from serving.kafka_io import ensure_topics

    tag = f"state-{time.monotonic_ns()}"
    topic = f"{tag}-events"
    ensure_topics(kafka_bootstrap, {topic: PARTITIONS})
    _produce(kafka_bootstrap, topic, events)
    out = tmp_path_factory.mktemp("clean") / "clean.jsonl"
    proc = _spawn(kafka_bootstrap, topic, model_dir, out, group=f"{tag}-clean", instance="clean",
                  state_topic=f"{tag}-clean-state", checkpoint_s=30,
                  max_events=NUM_EVENTS)  # fmt: skip
    try:
        proc.wait(180)
    finally:
        _stop(proc, signal.SIGKILL)
    assert proc.returncode == 0, _logs(out)
    ids = set(_ids(out))
    assert len(ids) > NUM_EVENTS, "small tiers: nearly every request decides"
    return topic, ids


def test_ten_sigkills_and_restarts_give_the_clean_runs_decision_ids(
    kafka_bootstrap: str, unique_topic, tmp_path: Path, model_dir: Path, clean
) -> None:
    topic, clean_ids = clean
    out = tmp_path / "killed.jsonl"
    group, state_topic = unique_topic("killed"), unique_topic("killed-state")
    rng = random.Random(18)
    kills = []
    for life in range(10):
        before = len(_ids(out))
        proc = _spawn(kafka_bootstrap, topic, model_dir, out, group=group, instance="sidecar",
                      state_topic=state_topic, checkpoint_s=0.5)  # fmt: skip
        started = time.monotonic()

        def progressed(n: int = before, t0: float = started) -> bool:
            if len(_ids(out)) > n:
                return True
            # Earlier lives may have decided the whole stream and committed it with
            # its snapshots: this one then has nothing to hand out again. Give it
            # time to join, restore its shards and find that out before the kill.
            return set(_ids(out)) >= clean_ids and time.monotonic() - t0 > 5

        try:
            _wait(progressed, 120, f"decisions of life {life}", out, proc)
            time.sleep(rng.uniform(0.1, 1.0))  # then SIGKILL, mid-batch or mid-checkpoint
        finally:
            _stop(proc, signal.SIGKILL)
        kills.append(len(set(_ids(out))))
    last = _spawn(kafka_bootstrap, topic, model_dir, out, group=group, instance="sidecar",
                  state_topic=state_topic, checkpoint_s=0.5)  # fmt: skip
    try:
        _wait(lambda: set(_ids(out)) >= clean_ids, 180, "every clean-run decision", out, last)
    finally:
        _stop(last)
    ids = _ids(out)
    print(
        f"\nclean run: {len(clean_ids)} decision ids; distinct ids seen at each of the 10 "
        f"SIGKILLs: {kills}; after restarts: {len(set(ids))} distinct of {len(ids)} emitted "
        f"({len(ids) - len(set(ids))} re-emitted with the same id)"
    )
    assert kills[0] < len(clean_ids), "the first kill came before the stream was done"
    assert set(ids) == clean_ids


def test_a_rebalance_and_a_sigkilled_member_give_the_clean_runs_decision_ids(
    kafka_bootstrap: str, unique_topic, tmp_path: Path, model_dir: Path, events, clean
) -> None:
    from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

    from serving.kafka_io import ensure_topics

    topic = unique_topic("events")
    ensure_topics(kafka_bootstrap, {topic: PARTITIONS})  # same keys: same partitions
    thirds = [events[: NUM_EVENTS // 3], events[NUM_EVENTS // 3 : 2 * NUM_EVENTS // 3],
              events[2 * NUM_EVENTS // 3 :]]  # fmt: skip
    group, state_topic = unique_topic("pair"), unique_topic("pair-state")
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    watcher = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group,
                            enable_auto_commit=False)  # fmt: skip

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)

    def all_committed() -> bool:
        ends = watcher.end_offsets(tps)
        return all((watcher.committed(tp) or 0) >= ends[tp] for tp in tps)

    def stable_with(members: int) -> bool:
        info = admin.describe_groups([group])[group]
        return bool(info.get("group_state") == "Stable" and len(info["members"]) == members)

    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    spawn = dict(group=group, state_topic=state_topic, checkpoint_s=30)
    a = _spawn(kafka_bootstrap, topic, model_dir, out_a, instance="a", **spawn)
    b = None
    try:
        _produce(kafka_bootstrap, topic, thirds[0])
        _wait(all_committed, 120, "A to handle the first third", out_a, a)
        b = _spawn(kafka_bootstrap, topic, model_dir, out_b, instance="b", **spawn)
        # A rebalance: A checkpoints what it gives up, B restores it from the changelog.
        _wait(lambda: stable_with(2), 120, "B to join the group", out_a, a, b)
        _produce(kafka_bootstrap, topic, thirds[1])
        _wait(lambda: all_committed() and len(_ids(out_b)) > 0, 120,
              "both to handle the second third", out_a, a, b)  # fmt: skip
        _stop(a, signal.SIGKILL)  # B takes A's partitions after the session timeout
        _produce(kafka_bootstrap, topic, thirds[2])
        _wait(all_committed, 180, "B to handle the rest", out_b, b)
    finally:
        _stop(a, signal.SIGKILL)
        if b is not None:
            _stop(b)
        watcher.close()
        admin.close()
    ids_a, ids_b = _ids(out_a), _ids(out_b)
    clean_ids = clean[1]
    print(
        f"\nclean run: {len(clean_ids)} decision ids; sidecar A {len(set(ids_a))}, "
        f"B {len(set(ids_b))} (both: {len(set(ids_a) & set(ids_b))})"
    )
    assert set(ids_b) - set(ids_a), "B decided for partitions of its own"
    assert set(ids_a) | set(ids_b) == clean_ids
