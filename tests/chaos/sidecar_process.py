"""Run ``kvwarm serve`` as a subprocess and watch it: what the chaos tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

RUNNER = """
import sys
{patch}
from serving.cli import main
main(prog_name="kvwarm", args=sys.argv[1:])
"""

STUCK_AFTER_CALLS_PATCH = """
import time
from predictor.baselines import LRUPolicy
_score = LRUPolicy.score
_calls = [0]
def _stuck_score(self, block_hashes, now_ms):
    _calls[0] += 1
    if _calls[0] > {after}:
        print("kvwarm-test: scoring is now stuck", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)  # a model that never returns
    return _score(self, block_hashes, now_ms)
LRUPolicy.score = _stuck_score
"""
"""Makes the LRU policy block forever in its ``score`` after ``after`` calls."""


class SidecarProcess:
    """A ``kvwarm serve`` subprocess; stderr is collected on a thread (never blocks)."""

    def __init__(self, args: Sequence[str], *, patch: str = "", cwd: Path | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVWARM_LOG_LEVEL": "INFO"}
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER.format(patch=patch), "serve", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float = 60.0) -> bool:
        """True once a stderr line contains ``text``; False if the process ended first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            if self.proc.poll() is not None:
                self._reader.join(timeout=2)
                return any(text in line for line in self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout_s} s; stderr:\n" + self.stderr())

    def health_url(self) -> str | None:
        for line in self.lines:
            if "health and metrics on " in line:
                return line.split("health and metrics on ", 1)[1].strip()
        return None

    def health(self) -> dict[str, object]:
        import urllib.request

        url = self.health_url()
        assert url is not None, self.stderr()
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=5) as response:
            return json.loads(response.read())

    def terminate_and_time(self, signum: int = signal.SIGTERM, bound_s: float = 10.0) -> float:
        """Send ``signum``; seconds until the process exited (fails past ``bound_s``)."""
        t0 = time.monotonic()
        self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"still running {bound_s} s after signal {signum}; stderr:\n" + self.stderr()
            ) from None
        self._reader.join(timeout=2)
        return time.monotonic() - t0

    def stderr(self) -> str:
        return "\n".join(self.lines[-40:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def write_trace(
    path: Path, num_requests: int, blocks_per_request: int = 8, num_roots: int = 500
) -> Path:
    """A plain Mooncake-style trace of distinct-ish chains, written fast."""
    with path.open("w") as fh:
        for i in range(num_requests):
            root = (i % num_roots) * 1000
            hashes = [root + j for j in range(blocks_per_request)]
            fh.write(
                json.dumps({"timestamp": i, "input_length": 512 * len(hashes), "hash_ids": hashes})
                + "\n"
            )
    return path
