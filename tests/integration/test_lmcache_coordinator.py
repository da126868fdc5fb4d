"""The LMCache adapter against a real LMCache coordinator process.

Runs where LMCache is installed: set ``KVWARM_LMCACHE_PYTHON`` to a Python that has
``lmcache`` (LMCache 0.5.6's coordinator starts on a CPU-only machine; it needs
``numba`` besides the package's light dependencies). The coordinator is real; the MP
server behind it (which needs a GPU) is ``devtools.lmcache_standin.MPServerStandIn``,
registered through the coordinator's own ``POST /instances``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.lmcache_standin import MPServerStandIn
from executor.adapters.lmcache import LMCacheExecutor, LMCacheParams
from executor.decision import Decision
from features.block_hash import HashParams, request_blocks_accessed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LMCACHE_PYTHON = os.environ.get("KVWARM_LMCACHE_PYTHON")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, method: str = "GET", body: object = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[str]:
    if not LMCACHE_PYTHON:
        pytest.skip("set KVWARM_LMCACHE_PYTHON to a Python with lmcache to run a real coordinator")
    port = free_port()
    log = (tmp_path / "coordinator.log").open("wb")
    proc = subprocess.Popen(
        [
            LMCACHE_PYTHON, "-m", "lmcache.v1.mp_coordinator",
            "--host", "127.0.0.1", "--port", str(port), "--disable-metrics",
            "--checkpoint-path", str(tmp_path / "ckpt"),
            "--metadata-path", str(tmp_path / "meta"),
        ],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if call(url + "/healthz").get("status") == "healthy":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"LMCache coordinator did not start: {(tmp_path / 'coordinator.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_adapter_drives_a_real_lmcache_coordinator(coordinator: str) -> None:
    mp = MPServerStandIn()
    try:
        call(
            coordinator + "/instances",
            "POST",
            {"instance_id": "mp-0", "ip": "127.0.0.1", "http_port": mp.port},
        )
        ex = LMCacheExecutor(LMCacheParams(coordinator, "mp-0", "qwen"))
        tokens = list(range(600))  # two whole 256-token chunks and a partial one
        event = request_blocks_accessed(tokens, HashParams(), request_id="r", ts_ms=0)
        assert event.token_ids is not None
        ex.tokens.record(event.block_hashes, event.token_ids, event.block_size_tokens)
        block = event.block_hashes[20]  # tokens 320..336: the second chunk
        now = int(time.time() * 1000)
        outcomes = ex.apply(
            [
                Decision("pin", now, block, "pin"),
                Decision("pf", now, block, "promote", "nvme", "dram"),
                Decision("unpin", now, block, "unpin"),
                Decision("ev", now, block, "evict", None),
                Decision("miss", now, 42, "promote", "nvme", "dram"),
            ]
        )
        assert [o.status for o in outcomes] == [
            "applied",
            "applied",
            "applied",
            "applied",
            "missing",
        ], outcomes
        # The coordinator proxied the prefetch to the MP server with the chunk's tokens.
        prefetches = [b for m, p, b in mp.calls if p == "/cache/prefetches"]
        assert prefetches and prefetches[0]["token_ids"] == tokens[:512]
        deletes = [b for m, p, b in mp.calls if p == "/cache/objects"]
        # Only the block's chunk (the second), with the key the coordinator resolved.
        lookup = call(
            coordinator + "/directory/lookup",
            "POST",
            {"model_name": "qwen", "world_size": 1, "token_ids": tokens[:512]},
        )
        assert deletes and deletes[0]["keys"] == [lookup["results"][-1]["key"]]
        assert deletes[0]["tier"] == "all"
        assert call(coordinator + "/cache/pins")["total"] == 0  # pinned, then unpinned
        assert ex.health()["status"] == "ok"
        assert ex.locate(block) is None  # no cache events reported placements
        assert set(ex.capacities()) == {"dram", "nvme"}
    finally:
        mp.close()
