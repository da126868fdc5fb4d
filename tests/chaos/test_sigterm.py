"""SIGTERM always works: ``kvwarm serve`` exits within a bound in every state.

The bound (10 s) is a correctness property, not a speed figure: the sidecar promises
exit within ``SHUTDOWN_GRACE_S`` (4 s) of the signal plus interpreter teardown.
"""

from __future__ import annotations

import signal
import socket

import pytest

from tests.chaos.sidecar_process import STUCK_AFTER_CALLS_PATCH, SidecarProcess, write_trace

pytestmark = pytest.mark.chaos

BOUND_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _common(tmp_path) -> list[str]:
    return ["--model", "lru", "--http-port", "0", "--executor", "none"]


def test_sigint_when_idle(tmp_path):
    sidecar = SidecarProcess(
        ["--source", f"zmq://127.0.0.1:{_free_port()}", "--clock", "wall", *_common(tmp_path)]
    )
    try:
        sidecar.wait_for("kvwarm serve: model")
        took = sidecar.terminate_and_time(signal.SIGINT, BOUND_S)
        print(f"idle: exit {sidecar.proc.returncode} {took:.2f} s after SIGINT")
        assert sidecar.proc.returncode == 0, sidecar.stderr()
    finally:
        sidecar.close()


def test_sigterm_mid_stream_finishes_the_batch_and_exits_0(tmp_path):
    trace = write_trace(tmp_path / "big.jsonl", 100_000)
    sidecar = SidecarProcess(["--source", f"file:{trace}", "--clock", "event", *_common(tmp_path)])
    try:
        sidecar.wait_for("kvwarm serve: model")
        took = sidecar.terminate_and_time(signal.SIGTERM, BOUND_S)
        summary = [line for line in sidecar.lines if " events, " in line]
        print(f"mid-stream: exit {sidecar.proc.returncode} {took:.2f} s after SIGTERM; {summary}")
        assert sidecar.proc.returncode == 0, sidecar.stderr()
        events = int(summary[-1].split("kvwarm serve: ")[1].split(" events")[0])
        assert events < 100_000  # it was stopped mid-stream, not at the end
    finally:
        sidecar.close()


def test_sigterm_with_a_stuck_model_forces_the_exit(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 50_000, num_roots=50_000)
    sidecar = SidecarProcess(
        ["--source", f"file:{trace}", "--clock", "event", *_common(tmp_path)],
        patch=STUCK_AFTER_CALLS_PATCH.format(after=200),
    )
    try:
        assert sidecar.wait_for("scoring is now stuck"), sidecar.stderr()
        took = sidecar.terminate_and_time(signal.SIGTERM, BOUND_S)
        print(f"stuck model: exit {sidecar.proc.returncode} {took:.2f} s after SIGTERM")
        assert sidecar.proc.returncode == 1  # forced: the batch in hand was not committed
        assert any("Thread" in line or "File " in line for line in sidecar.lines)  # stacks
    finally:
        sidecar.close()
