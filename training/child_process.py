"""How kvwarm starts a Python child that runs one of its own modules (the replay
workers, the libCacheSim peer server): this checkout first on the path, and ``-P`` so
that the working directory is not on it at all, since ``python -m`` would put it first
and a directory holding another checkout would then supply the child's packages."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def module_command(module: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that run ``python -m module`` from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return [sys.executable, "-P", "-m", module], env
