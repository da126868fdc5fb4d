"""The README's commands, run exactly as written by ``scripts/readme_check.py`` against
a local broker it starts with ``kvwarm kafka up`` as the README says. Here with
``--quick`` (the blocks that take minutes, replay and demo, run in ``make
readme-check``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(3_000)  # train + two learned serves: ~20 min on a busy 2-core machine
def test_every_quick_readme_block_runs_as_written(shared_trace):
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "readme_check.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=3_000,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    ran = [line for line in done.stdout.splitlines() if line.startswith("ok  ")]
    assert any("kvwarm kafka up" in line for line in ran), done.stdout
    assert any("kvwarm serve" in line for line in ran), done.stdout
