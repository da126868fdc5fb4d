"""The broker's own lifecycle: ``kvwarm kafka up|status|down`` as a user runs them, and
a test broker that does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.kafka_broker import KafkaBroker, is_our_broker, port_accepts

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _kvwarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", *args],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def test_cli_up_status_down(tmp_path: Path) -> None:
    state = str(tmp_path / "broker")
    try:
        up = _kvwarm("kafka", "up", "--state-dir", state, "--heap-mb", "256")
        if up.returncode != 0 and os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
            pytest.skip(f"no local broker here: {up.stderr[-500:]}")
        assert up.returncode == 0, up.stderr
        assert "bootstrap 127.0.0.1:" in up.stdout  # and written to the bootstrap file
        status = _kvwarm("kafka", "status", "--state-dir", state)
        assert status.returncode == 0 and "accepting connections" in status.stdout
        # The broker outlives `up` (its own session), and `up` again is a no-op.
        again = _kvwarm("kafka", "up", "--state-dir", state)
        assert again.returncode == 0 and "already running" in again.stdout
        down = _kvwarm("kafka", "down", "--state-dir", state)
        assert down.returncode == 0 and "stopped" in down.stdout
        after = _kvwarm("kafka", "status", "--state-dir", state)
        assert after.returncode == 3 and "not running" in after.stdout
    finally:
        KafkaBroker(state).destroy()


STARTER = """
import sys, time
from devtools.kafka_broker import KafkaBroker
broker = KafkaBroker(sys.argv[1], heap_mb=256, die_with_parent=True)
broker.start()
print(broker.status().pid, broker.config().port, flush=True)
time.sleep(600)
"""


def test_a_test_broker_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(state)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        if not line:
            starter.wait(10)
            pytest.fail(f"the starter exited with {starter.returncode} before the broker was ready")
        pid, port = map(int, line.split())
        props = state / "server.properties"
        assert is_our_broker(pid, props) and port_accepts(port)
        starter.send_signal(signal.SIGKILL)  # no cleanup code runs in the starter
        starter.wait(10)
        deadline = time.monotonic() + 60
        while is_our_broker(pid, props) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not is_our_broker(pid, props), "the broker outlived its parent"
    finally:
        starter.kill()
        starter.wait(10)
        KafkaBroker(state).destroy()
