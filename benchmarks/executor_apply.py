"""``kvwarm bench executor-apply``: decisions per second the real executor applies
inside ``kvwarm serve --executor local:CONFIG`` on the shared trace, journal on.

The sidecar runs on the first ``--events`` requests (event clock, LRU) with the
executor built from ``--config`` (default: the repository's sample ``executor.toml``,
copied into a temp dir so its tiers and journal land there). Time spent applying
decisions (the executor sink's ``emit`` and ``flush``) is measured in wall and CPU
seconds, with the number of journal fsyncs (serve's sink syncs the journal at each
flush, before offsets commit); the engine stand-in's stores (``place_store``) are
timed apart. The config's NVMe tier is run as it is and, in the same process, as each
of the other disk tier kinds:

- ``slab`` (the sample config's): blocks in slots of one preallocated file per block
  size; moves out of host memory written back and synced once per flush, with the
  journal; moves between disk tiers group-committed;
- ``directory``: a file per block, a batch's moves into it group-committed (synced
  together, one directory fsync per group: the table shows the groups and the block
  writes in them), and the same with each block file synced on its own (as before
  block group commit).

The other baselines: the journal not fsynced at all (the most journal group commit
could reach) and optionally one fsync per journal record (as before journal group
commit) on the first ``--baseline-events`` requests. A short untimed run first warms
the process (imports, first calls), which would otherwise be charged to the first row.
"""

from __future__ import annotations

import gzip
import itertools
import re
import shutil
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import click

from benchmarks.traces import shared_trace_path

REPO_ROOT = Path(__file__).resolve().parents[1]
_EACH_BLOCK = "directory, each block"
"""The row whose block files are synced one by one (no block group commit)."""


_DISK_ONLY = {"directory": ("sync_method",), "slab": ("grow_slots", "max_slot_sizes")}
"""Fields of one disk tier kind that the other has not: dropped when switching."""


def _write_config(
    src: Path,
    dst_dir: Path,
    journal: str,
    *,
    group_blocks: bool = True,
    nvme_kind: str | None = None,
) -> Path:
    """``src`` with the journal mode set: "flush" or "batch" (group commit: fsync per
    flush of the sidecar, or per applied batch), "record" (fsync per record) or "off"
    (no fsync); ``group_blocks`` False: each block file synced on its own;
    ``nvme_kind``: the NVMe tier's kind ("slab" or "directory"; None: as configured)."""
    text = src.read_text()
    config = tomllib.loads(text)  # validate before editing
    if "executor" not in config:
        raise click.ClickException(f"{src}: no [executor] table")
    if nvme_kind is not None:
        text = _with_nvme_kind(text, config, nvme_kind)
    lines = [
        ln
        for ln in text.splitlines()
        if not ln.strip().startswith(("group_commit", "fsync_journal", "group_commit_writes"))
    ]
    out: list[str] = []
    for line in lines:
        out.append(line)
        if line.strip() == "[executor]":
            out.append(f"fsync_journal = {'false' if journal == 'off' else 'true'}")
            out.append(f"group_commit = {'false' if journal == 'record' else 'true'}")
            out.append(f"group_commit_writes = {'true' if group_blocks else 'false'}")
    path = dst_dir / "executor.toml"
    path.write_text("\n".join(out) + "\n")
    return path


def _nvme_kind(config: dict[str, Any]) -> str:
    kinds = [t.get("kind") for t in config.get("tiers", []) if t.get("name") == "nvme"]
    if not kinds or kinds[0] not in _DISK_ONLY:
        raise click.ClickException("the config needs an nvme tier of kind slab or directory")
    return str(kinds[0])


def _with_nvme_kind(text: str, config: dict[str, Any], kind: str) -> str:
    """The config text with its nvme tier's kind set to ``kind`` (fields the new kind
    has not dropped)."""
    old = _nvme_kind(config)
    if old == kind:
        return text
    # Split at the tables' own lines (comments may mention "[[tiers]]").
    blocks = re.split(r"(?m)^\[\[tiers\]\][ \t]*$", text)
    out = [blocks[0]]
    for block in blocks[1:]:
        if tomllib.loads(block).get("name") == "nvme":
            kept = [ln for ln in block.splitlines() if not ln.strip().startswith(_DISK_ONLY[old])]
            block = "\n".join(kept).replace(f'kind = "{old}"', f'kind = "{kind}"', 1) + "\n"
        out.append(block)
    return "[[tiers]]".join(out)


def _run(
    config: Path, trace: Path, block_size_bytes: int, target_ms: float, *, sync_each_apply: bool
) -> dict[str, Any]:
    from executor.core import Executor
    from serving.serve_cli import Service
    from serving.settings import load_settings

    settings = load_settings(
        None,
        source=f"file:{trace}",
        executor=f"local:{config}",
        clock="event",
        http_enabled=False,
        model_poll_interval_s=0,
        block_size_bytes=block_size_bytes,
        target_batch_latency_ms=target_ms,
    )
    service = Service(settings)
    sink = service.executor_sink
    assert sink is not None
    # serve's sink syncs at each flush; True: also after every applied batch.
    executor = service.executor
    assert isinstance(executor, Executor)
    executor.sync_each_apply = sync_each_apply
    spent = {"wall": 0.0, "cpu": 0.0, "store": 0.0}

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args)
            finally:
                spent["wall"] += time.perf_counter() - wall
                spent["cpu"] += time.process_time() - cpu

        return wrapper

    def timed_store(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            wall = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent["store"] += time.perf_counter() - wall

        return wrapper

    sink.emit = timed(sink.emit)  # type: ignore[method-assign]
    sink.flush = timed(sink.flush)  # type: ignore[method-assign]
    service.decisions.on_store = timed_store(service.decisions.on_store)
    try:
        stats = service.run()
    finally:
        service.close()
    num = sum(n for (action, _), n in sink.outcomes.items() if action != "store")
    executor_stats = executor.stats()
    return {
        "groups": executor_stats.num_group_commits,
        "grouped": executor_stats.num_group_committed_writes,
        "events": stats.events,
        "decisions": num,
        "stores": sum(n for (action, _), n in sink.outcomes.items() if action == "store"),
        "wall_s": spent["wall"],
        "cpu_s": spent["cpu"],
        "store_s": spent["store"],
        "fsyncs": executor.journal.num_fsyncs,
        "per_s": num / spent["wall"] if spent["wall"] else 0.0,
        "per_cpu_s": num / spent["cpu"] if spent["cpu"] else 0.0,
    }


def _head(trace: Path, n: int, dst: Path) -> Path:
    """The trace's first ``n`` lines, as they are (gzip or plain)."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rb") as src, dst.open("wb") as out:
        out.writelines(itertools.islice(src, n))
    return dst


@click.command("executor-apply")
@click.option("--events", default=500, show_default=True, type=click.IntRange(1, 100_000))
@click.option(
    "--baseline-events",
    default=0,
    show_default=True,
    type=click.IntRange(0, 100_000),
    help="Also run one fsync per journal record on this many requests (slow: ~2 fsyncs "
    "per move; 0: skip it).",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=REPO_ROOT / "executor.toml",
    show_default=True,
)
@click.option("--block-size-bytes", default=65536, show_default=True, type=click.IntRange(1))
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the executor's tiers and journal go (default: the system temp dir). Put "
    "it on the disk to measure: creating files in some temp dirs is much slower.",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1, 20),
    help="Runs of each journal mode, taken in turn; the median run (by decisions/s) of "
    "each is shown (on a shared machine one run can be off by 2x).",
)
@click.option(
    "--target-batch-latency-ms",
    default=300.0,
    show_default=True,
    help="The sidecar's batch target.",
)
def bench_executor_apply(
    events: int,
    baseline_events: int,
    config: Path,
    block_size_bytes: int,
    workdir: Path | None,
    repeats: int,
    target_batch_latency_ms: float,
) -> None:
    """Decisions/s applied by the local executor in serve: journal fsynced per flush
    (serve's default), per batch, per record; against no fsync in the same process."""
    trace = shared_trace_path()
    if trace is None:
        raise click.ClickException("the shared trace is missing (set KVWARM_SHARED_TRACE)")
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvwarm-bench-apply-", dir=workdir))
    try:
        runs: dict[str, list[dict[str, Any]]] = {}
        kind = _nvme_kind(tomllib.loads(config.read_text()))
        other = "directory" if kind == "slab" else "slab"
        # (label, requests, journal mode, block files group-committed, nvme kind)
        modes = [
            ("per flush", events, "flush", True, kind),
            ("per batch", events, "batch", True, kind),
            ("no fsync", events, "off", True, kind),
            (f"{other}, per flush", events, "flush", True, other),
        ]
        directory_kind = kind if kind == "directory" else other
        modes.append((_EACH_BLOCK, events, "flush", False, directory_kind))
        schedule = [("warm-up", min(events, 50), "off", True, kind)] + modes * repeats
        if baseline_events:
            schedule.append(("per record", baseline_events, "record", True, kind))
        for i, (label, n, journal, group_blocks, nvme_kind) in enumerate(schedule):
            run_dir = work / f"{i}-{label.replace(' ', '-').replace(',', '')}"
            run_dir.mkdir()
            path = _write_config(
                config, run_dir, journal, group_blocks=group_blocks, nvme_kind=nvme_kind
            )
            result = _run(
                path,
                _head(trace, n, run_dir / "t.jsonl"),
                block_size_bytes,
                target_batch_latency_ms,
                sync_each_apply=journal == "batch",
            )
            shutil.rmtree(run_dir, ignore_errors=True)
            if label != "warm-up":
                runs.setdefault(label, []).append(result)
        rows = [
            (label, sorted(results, key=lambda r: r["per_s"])[len(results) // 2])
            for label, results in runs.items()
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    click.echo(
        "decisions: promote/demote/evict applied by the executor; stores: blocks the "
        "engine stand-in wrote; per s: decisions per second of time spent applying them "
        "(emit + flush); store s: time in the stores, apart; groups: block-file group "
        "commits (one directory fsync each), grouped: block writes in them."
    )
    click.echo(
        f"local executor from {config.name} (NVMe tier: {kind}) in {work.parent}, "
        f"{block_size_bytes} B blocks, "
        f"batch target {target_batch_latency_ms:g} ms; median of {repeats} runs per mode, "
        "taken in turn"
    )
    click.echo(
        f"{'journal fsync':>22} {'events':>7} {'decisions':>10} {'stores':>7} {'fsyncs':>7} "
        f"{'groups':>7} {'grouped':>8} {'wall s':>7} {'CPU s':>6} {'per s':>8} "
        f"{'per CPU s':>10} {'store s':>8}"
    )
    for label, r in rows:
        click.echo(
            f"{label:>22} {r['events']:>7} {r['decisions']:>10} {r['stores']:>7} {r['fsyncs']:>7} "
            f"{r['groups']:>7} {r['grouped']:>8} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} "
            f"{r['per_s']:>8.0f} {r['per_cpu_s']:>10.0f} {r['store_s']:>8.2f}"
        )
    by_label = dict(rows)
    base = by_label["no fsync"]["per_s"]
    if base:
        for label in ("per flush", "per batch"):
            click.echo(
                f"journal fsynced {label} (group commit) / journal not fsynced: "
                f"{by_label[label]['per_s'] / base:.2f}x decisions/s"
            )
    each = by_label[_EACH_BLOCK]["per_s"]
    other_row = by_label[f"{other}, per flush"]["per_s"]
    if other_row:
        click.echo(
            f"NVMe tier {kind} / {other} (journal per flush): "
            f"{by_label['per flush']['per_s'] / other_row:.2f}x decisions/s"
        )
    grouped = by_label["per flush" if kind == "directory" else f"{other}, per flush"]["per_s"]
    if each:
        click.echo(
            "directory tier, block files group-committed / each synced on its own: "
            f"{grouped / each:.2f}x decisions/s"
        )
