"""``kvwarm bench zmq`` runs end to end on a small stream (a smoke test, not a measurement)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from serving.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("encoding", "hashes"), [("tagged", "bytes"), ("positional", "int")])
def test_bench_zmq_small_run(encoding, hashes):
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "zmq",
            "--batches",
            "40",
            "--encoding",
            encoding,
            "--hashes",
            hashes,
            "--no-kafka",
        ],
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "decode + residency, from memory" in out and "ZMQ -> decode + residency" in out
    # 40 batches: 40 stores + 24 removals (from step 16) = 64 events, nothing lost or rejected.
    assert re.search(r"events 64, gaps 0, replayed 0, unfilled 0, rejects 0", out)
    assert "bridge -> Kafka: skipped" in out
