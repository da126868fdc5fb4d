"""``kvwarm bench executor-apply`` runs the sample config's NVMe tier as each disk tier
kind: the config it writes must be the sample with only the kind (and the fields the
other kind has not) changed, and load as an executor."""

from __future__ import annotations

import tomllib
from pathlib import Path

from benchmarks.executor_apply import REPO_ROOT, _write_config
from serving.serve_cli import load_local_executor


def test_the_nvme_tier_is_switched_between_slab_and_directory(tmp_path: Path) -> None:
    sample = tomllib.loads((REPO_ROOT / "executor.toml").read_text())
    for kind in ("slab", "directory"):
        path = _write_config(REPO_ROOT / "executor.toml", tmp_path, "flush", nvme_kind=kind)
        config = tomllib.loads(path.read_text())
        nvme = next(t for t in config["tiers"] if t["name"] == "nvme")
        before = next(t for t in sample["tiers"] if t["name"] == "nvme")
        assert nvme["kind"] == kind
        assert {k: v for k, v in nvme.items() if k != "kind"} == {
            k: v for k, v in before.items() if k not in ("kind", "grow_slots", "sync_method")
        } | ({"grow_slots": before["grow_slots"]} if kind == "slab" else {})
        assert [t for t in config["tiers"] if t["name"] != "nvme"] == [
            t for t in sample["tiers"] if t["name"] != "nvme"
        ]
        assert config["executor"]["fsync_journal"] is True
        executor = load_local_executor(path, clock_ms=lambda: 0.0)
        assert type(executor.tier("nvme")).__name__ == (
            "SlabTier" if kind == "slab" else "DirectoryTier"
        )
        executor.close()
