"""Run every ``bash`` block of README.md exactly as written, in order, as a new user would.

Each block runs as one ``bash -e -o pipefail`` script in a scratch folder laid out like
a checkout (``../shared`` resolves to the shared traces, ``.venv`` to this Python's
environment), with this checkout's code first on ``PYTHONPATH``, no ``KVWARM_*`` or
``MLFLOW_*`` variables from the caller, and a private Kafka state folder (the broker
jars are linked from the project cache, so nothing is downloaded). A block passes when
it exits 0 and prints no traceback; processes it left in the background (``cmd &``)
are stopped when it ends, and ``kvwarm kafka down`` runs at the end whatever happened.

- Blocks with a ``make`` line are not run: they are what CI runs itself (``make test``,
  ``make demo``, ``make install``).
- ``--quick`` (what ``make test`` runs through ``tests/integration/test_readme.py``) also
  skips the blocks that take minutes (``kvwarm replay``, ``kvwarm demo``, ``kvwarm
  bench``); ``make readme-check`` runs them too.

Usage: ``python scripts/readme_check.py [--quick] [--readme README.md]``; exit 0 when
every block run passed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SLOW_COMMANDS = ("kvwarm replay", "kvwarm demo", "kvwarm bench")
BLOCK_TIMEOUT_S = 3_600


@dataclass(frozen=True)
class Block:
    line: int
    """Line of the README where the block's first command is."""
    text: str

    @property
    def is_setup(self) -> bool:
        return any(line.lstrip().startswith("make ") for line in self.text.splitlines())

    @property
    def is_slow(self) -> bool:
        return any(cmd in self.text for cmd in SLOW_COMMANDS)

    @property
    def title(self) -> str:
        first = next(line for line in self.text.splitlines() if line.strip())
        return first.strip()[:90]


def bash_blocks(readme: Path) -> list[Block]:
    """The ```bash fenced blocks of ``readme``, in order."""
    blocks: list[Block] = []
    lines = readme.read_text(encoding="utf-8").splitlines()
    inside, start, body = False, 0, []
    for number, line in enumerate(lines, start=1):
        if not inside and re.match(r"^```bash\s*$", line):
            inside, start, body = True, number + 1, []
        elif inside and line.startswith("```"):
            inside = False
            blocks.append(Block(start, "\n".join(body) + "\n"))
        elif inside:
            body.append(line)
    return blocks


def scratch_env(root: Path) -> dict[str, str]:
    """The environment of a new user: this checkout's code, a private Kafka cache."""
    sys.path.insert(0, str(REPO_ROOT))
    from devtools.kafka_broker import default_cache_dir

    real_cache = default_cache_dir()
    cache = root / "cache"
    (cache / "kafka").mkdir(parents=True)
    for lib in real_cache.glob("lib-*"):
        (cache / "kafka" / lib.name).symlink_to(lib.resolve())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVWARM_", "MLFLOW_"))}
    venv_bin = str(Path(sys.prefix) / "bin")
    env.update(
        PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO_ROOT),
        KVWARM_CACHE_DIR=str(cache),
        # No colour codes or progress bars in the captured output.
        TERM="dumb",
    )
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str], log_dir: Path) -> tuple[bool, str]:
    out = log_dir / f"block-{block.line}.out"
    err = log_dir / f"block-{block.line}.err"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", block.text],
            cwd=cwd, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            with contextlib.suppress(ProcessLookupError):  # what it left in the background
                os.killpg(proc.pid, signal.SIGTERM)
    stderr = err.read_text(errors="replace")
    stdout = out.read_text(errors="replace")
    if code != 0:
        why = "timed out" if code == -1 else f"exit {code}"
        return (
            False,
            f"{why}\n--- stdout (tail)\n{stdout[-2000:]}\n--- stderr (tail)\n{stderr[-3000:]}",
        )
    if "Traceback (most recent call last)" in stderr + stdout:
        return False, f"printed a traceback\n{stderr[-3000:]}"
    return True, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Skip the blocks that take minutes.")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    parser.add_argument("--keep", action="store_true", help="Keep the scratch folder.")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="kvwarm-readme-"))
    work = root / "kvwarm"
    work.mkdir()
    shared = REPO_ROOT.parent / "shared"
    if shared.is_dir():
        (root / "shared").symlink_to(shared.resolve())
    (work / ".venv").symlink_to(Path(sys.prefix).resolve())
    env = scratch_env(root)
    failures = 0
    try:
        for block in bash_blocks(args.readme):
            if block.is_setup:
                print(f"skip  README.md:{block.line}  {block.title}  (make: what CI runs)")
                continue
            if args.quick and block.is_slow:
                print(f"skip  README.md:{block.line}  {block.title}  (--quick)")
                continue
            started = time.monotonic()
            ok, detail = run_block(block, work, env, root)
            took = time.monotonic() - started
            print(
                f"{'ok  ' if ok else 'FAIL'}  README.md:{block.line}  {block.title}  ({took:.0f} s)"
            )
            sys.stdout.flush()
            if not ok:
                failures += 1
                print(detail)
    finally:
        subprocess.run(
            ["bash", "-c", "kvwarm kafka down"], cwd=work, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=120,
        )  # fmt: skip
        if args.keep:
            print(f"scratch folder kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
