"""A consuming process killed with SIGKILL mid-stream and restarted loses nothing: it
resumes from the committed offsets, and what it handled but had not committed comes
again, recognisable by request_id.

The consumer is this file run as a script (see ``main`` below): a real subprocess
that writes the request_id of every event it handles, then commits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NUM_BEFORE = 2_000  # produced before the consumer starts
NUM_DURING = 2_000  # produced while it runs
HANG_AFTER = 600  # the first run stops committing after handling this many events


def main() -> None:
    """The consumer process: handle (append ids to --out), flush, then commit. With
    --hang-after N it handles a batch that crosses N events and then waits, without
    committing, to be killed: a crash between handling and commit."""
    import logging

    from serving.kafka_io import KafkaEventSource

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hang-after", type=int, default=0)
    args = parser.parse_args()
    # Static membership: the restarted process takes the dead one's place at once.
    source = KafkaEventSource(
        args.bootstrap, args.topic, group_id=args.group, group_instance_id="crash-test-consumer"
    )
    handled = 0
    with open(args.out, "a", encoding="utf-8") as out:
        while True:
            events = source.poll(100, timeout_ms=200)
            for event in events:
                out.write(event.request_id + "\n")
            out.flush()
            handled += len(events)
            if args.hang_after and handled >= args.hang_after:
                Path(str(args.out) + ".hung").touch()
                time.sleep(3600)
            source.commit()


def _spawn(
    bootstrap: str, topic: str, group: str, out: Path, hang_after: int = 0
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, __file__, "--bootstrap", bootstrap, "--topic", topic,
        "--group", group, "--out", str(out), "--hang-after", str(hang_after),
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    log = open(str(out) + ".log", "ab")  # the child's stderr, shown when a wait fails
    try:
        return subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stderr=log)
    finally:
        log.close()


def _wait_for(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes],
    progress: Callable[[], str] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            pytest.fail(
                f"consumer process exited with {proc.returncode} while waiting for {what}"
                + _child_log(proc)
            )
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s} s waiting for {what} {progress()}" + _child_log(proc)
            )
        time.sleep(0.05)


def _child_log(proc: subprocess.Popen[bytes]) -> str:
    args = list(map(str, proc.args))  # type: ignore[arg-type]
    path = Path(args[args.index("--out") + 1] + ".log")
    tail = path.read_text(errors="replace")[-3000:] if path.exists() else ""
    return f"\n--- consumer stderr (tail) ---\n{tail}"


def _ids(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_sigkilled_consumer_resumes_without_loss(
    kafka_bootstrap: str, unique_topic: Callable[[str], str], tmp_path: Path
) -> None:
    from features.events import BlocksAccessed
    from serving.kafka_io import KafkaEventProducer, ensure_topics

    topic, group = unique_topic("events"), unique_topic("group")
    ensure_topics(kafka_bootstrap, {topic: 2})
    events = [
        BlocksAccessed(
            ts_ms=i, request_id=f"req-{i}", block_hashes=(i % 37, 1000 + i), block_size_tokens=16
        )
        for i in range(NUM_BEFORE + NUM_DURING)
    ]
    producer = KafkaEventProducer(kafka_bootstrap, topic)
    for event in events[:NUM_BEFORE]:
        producer.send_event(event)
    producer.flush()

    first_out, second_out = tmp_path / "run1.txt", tmp_path / "run2.txt"
    first = _spawn(kafka_bootstrap, topic, group, first_out, hang_after=HANG_AFTER)
    try:
        _wait_for(lambda: len(_ids(first_out)) > 0, 60, "the first events", first)
        for event in events[NUM_BEFORE:]:  # mid-stream: the consumer is running
            producer.send_event(event)
        producer.flush()
        _wait_for(lambda: Path(str(first_out) + ".hung").exists(), 60, "the crash point", first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    producer.close()
    assert first.returncode == -signal.SIGKILL
    handled_before_crash = _ids(first_out)
    assert len(handled_before_crash) >= HANG_AFTER

    second = _spawn(kafka_bootstrap, topic, group, second_out)
    wanted = {e.request_id for e in events}
    try:
        _wait_for(
            lambda: wanted <= set(handled_before_crash) | set(_ids(second_out)),
            60,
            "every event",
            second,
            lambda: f"{len(wanted - set(handled_before_crash) - set(_ids(second_out)))} missing",
        )
    finally:
        second.terminate()
        second.wait(10)

    handled_after = _ids(second_out)
    seen = Counter(handled_before_crash + handled_after)
    assert set(seen) == wanted  # nothing lost, nothing invented
    redelivered = {rid for rid, n in seen.items() if n > 1}
    # The batch handled but not committed before the kill comes again, and only events
    # the first run had handled are repeated: dedup by request_id restores exactly-once.
    assert redelivered, "the uncommitted batch should have been delivered again"
    assert redelivered <= set(handled_before_crash)
    assert all(n == 2 for n in seen.values() if n > 1)
    # Resumed from the committed offsets, not from the beginning.
    assert len(handled_after) < len(events)


if __name__ == "__main__":
    main()
