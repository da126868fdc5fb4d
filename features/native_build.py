"""Build C sources into shared libraries with the system compiler, cached by hash.

Used where kvwarm runs generated or bundled C on its hot paths (compiled tree
ensembles in ``predictor.compiled_trees``, the feature-row kernel in
``features.native_rows``). Every user keeps a pure-Python path and falls back to it
when ``build_library`` raises ``BuildError``: no compiler (``$CC``, else ``cc``), a
compile that fails or outlasts its timeout.

Libraries live under ``$KVWARM_CACHE_DIR/<kind>`` (default ``~/.cache/kvwarm/<kind>``;
a per-user temporary directory when that is not writable), named by the hash of their
source and flags, so a second process (or a second run) loads what the first built. A
library is written under a temporary name and renamed into place, so a process never
loads a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

DEFAULT_FLAGS: tuple[str, ...] = ("-O2", "-fno-math-errno", "-ffp-contract=off")
"""No contraction of a * b + c into a fused multiply-add: the C must round as numpy does."""


class BuildError(RuntimeError):
    """The library could not be built; the message says why."""


def cache_dir(kind: str) -> Path:
    """The writable directory that caches libraries of ``kind``."""
    base = os.environ.get("KVWARM_CACHE_DIR") or str(Path.home() / ".cache" / "kvwarm")
    path = Path(base) / kind
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return path
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"kvwarm-{kind}-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def library_path(source: str, directory: Path, stem: str, flags: Sequence[str]) -> Path:
    """Where the library of ``source`` built with ``flags`` is cached."""
    key = "\0".join((*flags, source))
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return directory / f"{stem}-{digest}.so"


def build_library(
    source: str,
    library: Path,
    *,
    timeout_s: float,
    flags: Sequence[str] = DEFAULT_FLAGS,
) -> bool:
    """Compile ``source`` into ``library`` unless it is already there; True when it was
    built now. Raises ``BuildError`` naming the cause."""
    if library.is_file():
        return False
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise BuildError(f"no C compiler ({compiler!r} not found; set CC)")
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        src, out = Path(tmp) / "source.c", Path(tmp) / "library.so"
        src.write_text(source)
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(src)]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildError(f"compiler did not finish: {exc}") from exc
        if done.returncode != 0:
            raise BuildError(f"compiler exit {done.returncode}: {done.stderr.strip()[:300]}")
        os.replace(out, library)  # atomic: another process may be loading it
    return True
