"""The sample ``executor.toml`` at the repository root loads as documented and runs."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from executor import Decision
from serving.serve_cli import load_local_executor

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_sample_executor_config_loads_and_moves_a_block(
    tmp_path: Path, payload: Callable[[int | str, int], bytes]
) -> None:
    config = tmp_path / "executor.toml"
    shutil.copy(REPO_ROOT / "executor.toml", config)  # its relative paths land in tmp_path
    ex = load_local_executor(config, clock_ms=lambda: 0.0)
    try:
        assert ex.tier_names == ["hbm", "dram", "nvme"]
        assert ex.params.fsync_journal and ex.params.group_commit
        assert ex.tier("nvme").params.read_parts == 4
        assert type(ex.tier("nvme")).__name__ == "SlabTier"
        assert ex.write(7, payload(7, 4096), "nvme").status == "applied"
        assert (tmp_path / ".kvwarm" / "executor" / "nvme").is_dir()
        out = ex.apply([Decision("s1", 0, 7, "promote", "nvme", "dram")])
        assert [o.status for o in out] == ["applied"] and ex.locate(7) == "dram"
        # Out of host memory into the slab tier: written back, durable at sync().
        out = ex.apply([Decision("s2", 0, 7, "demote", "dram", "nvme")])
        assert [o.status for o in out] == ["applied"] and ex.locate(7) == "nvme"
        assert bytes(ex.read(7) or b"") == payload(7, 4096)
    finally:
        ex.close()
