"""``kvwarm bench features`` runs on a small trace and compares the native per-request
paths with numpy alone in the same process."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.feature_state import features


def test_bench_features_prints_rates_and_the_numpy_comparison(small_trace: Path) -> None:
    result = CliRunner().invoke(
        features, ["--trace", str(small_trace), "--repeats", "1", "--no-dataset"]
    )
    assert result.exit_code == 0, result.output
    assert re.search(r"update \(observe, 1 by 1\): +[\d,]+ accesses/s", result.output)
    line = next(x for x in result.output.splitlines() if x.startswith("per-request paths"))
    expected = "native" if shutil.which("cc") is not None else "numpy ("
    assert f"feature rows {expected}" in line
    slower = [float(v) for v in re.findall(r"\(([\d.]+)x slower\)", line)]
    assert len(slower) == 2 and all(v > 0 for v in slower)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from features import native_rows

    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path))
    native_rows.reset()
    yield
    native_rows.reset()
