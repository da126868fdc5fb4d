"""``kvwarm bench executor``: promote throughput (NVMe directory -> DRAM), serial vs
parallel, for block sizes 1 MB..128 MB, against a plain sequential read of the same
files in the same run.

Each pass starts cold: the block files are fsynced when written and dropped from the
page cache with ``posix_fadvise(DONTNEED)`` before every measured pass, so reads come
from the device (as the seed's cold NVMe reads do). A promote is the executor's real
path: read, CRC32C verify, store in the memory tier, discard the file, journal.
Figures are ratios against the raw read of the same run, so they compare across
machines; the absolute GB/s are the device's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import click

from executor.block_ids import block_key
from executor.core import Executor, ExecutorParams
from executor.decision import Decision
from executor.tiers.directory import DirectoryTier, DirectoryTierParams
from executor.tiers.memory import MemoryTier, MemoryTierParams

MB = 1 << 20


def _drop_cache(root: Path) -> None:
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw_read_s(paths: list[Path], buffer: bytearray) -> tuple[float, float]:
    """Plain sequential read of the serial set's block files, one after the other.
    Returns (wall s, CPU s of this process)."""
    view = memoryview(buffer)
    cpu = time.process_time()
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start, time.process_time() - cpu


def _promote_s(executor: Executor, blocks: range, parallel: bool, tag: str) -> tuple[float, float]:
    decisions = [Decision(f"{tag}-{b}", 0, b, "promote", "nvme", "dram") for b in blocks]
    cpu = time.process_time()
    start = time.perf_counter()
    if parallel:
        outcomes = executor.apply(decisions)
    else:
        outcomes = [executor.apply_one(d) for d in decisions]
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    bad = [o for o in outcomes if o.status != "applied"]
    if bad:
        raise click.ClickException(f"promote failed: {bad[0]}")
    return elapsed


def run(sizes_mb: list[int], total_mb: int, threads: int, workdir: Path) -> list[dict[str, float]]:
    rows = []
    for size_mb in sizes_mb:
        num_blocks = max(2, total_mb // size_mb)
        size = size_mb * MB
        base = Path(tempfile.mkdtemp(prefix=f"kvwarm-bench-{size_mb}mb-", dir=workdir))
        try:
            tiers = [
                MemoryTier(
                    "dram",
                    MemoryTierParams(capacity_bytes=2 * num_blocks * size, verify_reads=False),
                ),
                DirectoryTier(
                    "nvme",
                    DirectoryTierParams(
                        capacity_bytes=2 * num_blocks * size,
                        root=base / "nvme",
                        num_io_threads=threads,
                    ),
                ),
            ]
            executor = Executor(
                tiers, ExecutorParams(state_dir=base / "state", fsync_journal=False)
            )
            payload = os.urandom(size)
            blocks = range(num_blocks)
            parallel_blocks = range(num_blocks, 2 * num_blocks)
            for b in range(2 * num_blocks):
                executor.write(b, payload, "nvme")
            del payload
            nvme_root = base / "nvme"
            buffer = bytearray(size + 64)
            _drop_cache(nvme_root)
            (raw_s, raw_cpu) = _raw_read_s([nvme_root / block_key(b) for b in blocks], buffer)
            _drop_cache(nvme_root)
            (serial_s, serial_cpu) = _promote_s(executor, blocks, parallel=False, tag="serial")
            _drop_cache(nvme_root)
            (parallel_s, _) = _promote_s(executor, parallel_blocks, parallel=True, tag="parallel")
            executor.close()
        finally:
            shutil.rmtree(base, ignore_errors=True)
        total_gb = num_blocks * size / 1e9
        rows.append(
            {
                "size_mb": size_mb,
                "num_blocks": num_blocks,
                "raw_gbps": total_gb / raw_s,
                "serial_gbps": total_gb / serial_s,
                "parallel_gbps": total_gb / parallel_s,
                "raw_cpu_s_per_gb": raw_cpu / total_gb,
                "promote_cpu_s_per_gb": serial_cpu / total_gb,
            }
        )
    return rows


@click.command("executor")
@click.option("--sizes-mb", default="1,4,16,64,128", show_default=True, help="Block sizes, MB.")
@click.option(
    "--total-mb",
    default=128,
    show_default=True,
    type=click.IntRange(8, 2048),
    help="Bytes of blocks per size and pass (disk use peaks at twice this).",
)
@click.option(
    "--threads",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="I/O threads of the NVMe tier.",
)
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to put the block files (default: the system temp dir). Put it on the disk to measure.",
)
def bench_executor(sizes_mb: str, total_mb: int, threads: int, workdir: Path | None) -> None:
    """Promote throughput serial vs parallel vs raw sequential read of the same files."""
    sizes = [int(s) for s in sizes_mb.split(",") if s.strip()]
    workdir = workdir or Path(tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    click.echo(
        f"promote nvme->dram, {total_mb} MB per size, {threads} threads, cold reads, dir {workdir}, "
        f"{os.cpu_count()} CPUs"
    )
    click.echo(
        f"{'block':>7} {'blocks':>6} {'raw GB/s':>9} {'serial':>8} {'parallel':>9} "
        f"{'serial/raw':>10} {'par/raw':>8} {'par/serial':>10} {'CPU s/GB raw':>12} {'promote':>8}"
    )
    for row in run(sizes, total_mb, threads, workdir):
        click.echo(
            f"{row['size_mb']:>5}MB {row['num_blocks']:>6} {row['raw_gbps']:>9.2f} "
            f"{row['serial_gbps']:>8.2f} {row['parallel_gbps']:>9.2f} "
            f"{row['serial_gbps'] / row['raw_gbps']:>10.0%} {row['parallel_gbps'] / row['raw_gbps']:>8.0%} "
            f"{row['parallel_gbps'] / row['serial_gbps']:>9.1f}x "
            f"{row['raw_cpu_s_per_gb']:>12.2f} {row['promote_cpu_s_per_gb']:>8.2f}"
        )
    click.echo(
        "CPU s/GB: this process's CPU time per GB moved (CRC32C, page faults, copies); on a "
        "busy machine it, not the disk, bounds promote throughput."
    )
