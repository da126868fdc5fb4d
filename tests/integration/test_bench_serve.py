"""``kvwarm bench serve`` end to end, from a file and through a real broker: each open
loop offers fractions of a live stream's maximum (the events paced to the saturated
run's rate), and its events are paced to the rate it offers."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from serving.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_open_loops_offer_half_of_the_live_maximum(kafka_bootstrap: str) -> None:
    args = ["bench", "serve", "--requests", "300", "--rates", "0.5", "--repeat", "1"]
    result = CliRunner().invoke(main, [*args, "--kafka", kafka_bootstrap])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert not any("skipped" in line or "stalled" in line for line in lines), result.output
    # The model alone is measured beside the model behind the guard, and the guard says
    # which candidate served each of the 300 requests.
    for run in ("file  model (no guard) ", "kafka model (no guard) "):
        assert sum(line.startswith(run) for line in lines) == 1, result.output
    for run in ("file  learned", "kafka learned"):
        served = [line for line in lines if line.startswith(f"{run}: the guard served ")]
        assert len(served) == 1, result.output
        counts = re.findall(r" ([\d,]+) \(\d+%\)", served[0])
        assert sum(int(c.replace(",", "")) for c in counts) == 300, served[0]
    for label in (
        *(f"open  {name}" for name in ("lru", "learned", "model")),
        *(f"kafka open  {name}" for name in ("lru", "learned", "model")),
    ):
        found = [
            m
            for line in lines
            if (m := re.match(rf"{label}: live maximum ([\d,]+) events/s, [\d,]+ block", line))
        ]
        assert len(found) == 1, result.output
        maximum = int(found[0].group(1).replace(",", ""))
        rows = [line for line in lines if line.startswith(f"{label} @0.5x")]
        assert len(rows) == 1, result.output
        offered = int(rows[0][26:37].replace(",", ""))  # the row's offered/s column
        assert maximum > 0 and abs(offered - maximum / 2) <= 1, rows[0]
