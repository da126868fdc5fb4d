"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl.gz"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def shared_trace() -> Path:
    """The real Mooncake conversation trace from ../shared/traces (never copied into the
    repo). CI always has it: there a missing trace fails the test instead of skipping."""
    path = Path(os.environ.get("KVWARM_SHARED_TRACE", SHARED_TRACE))
    if not path.is_file():
        if in_ci():
            pytest.fail(f"shared trace missing at {path}; CI must run the shared-trace tests")
        pytest.skip(f"shared trace not present at {path}")
    return path


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated mixed workload of 3,000 requests (seed 7), written once per session."""
    from features.generator import generate_to_file, params_for

    path = tmp_path_factory.mktemp("traces") / "mixed-3000.jsonl"
    return generate_to_file(params_for("mixed", num_requests=3000, seed=7), path)
