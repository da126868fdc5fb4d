"""``kvwarm bench executor``: promote throughput (NVMe -> DRAM), serial vs parallel, for
block sizes 1 MB..128 MB, against a plain sequential read of the same bytes (serial)
and a many-threaded read of them (parallel) in the same run. The NVMe tier is a slab
(``--kind slab``, the sample config's: blocks in slots of one file) or a directory of
block files (``--kind directory``); the raw reads read the same byte ranges (a block
file, or a block's slot in the slab file).

Serial: one block at a time, each read in one piece (``read_parts=1``). Parallel:
blocks at once through ``apply`` (the tier's ``num_io_threads``), each block's parts
at once (``read_parts``), checksummed where they land.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from executor.block_ids import block_key
from executor.core import Executor, ExecutorParams
from executor.decision import Decision
from executor.tiers import make_tier
from executor.tiers.directory import DirectoryTier
from executor.tiers.memory import MemoryTier, MemoryTierParams
from executor.tiers.slab import SlabTier

MB = 1 << 20


def _drop_cache(root: Path) -> None:
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


Extent = tuple[Path, int, int]
"""A block's bytes on disk: (file, offset, length)."""


def _extents(executor: Executor, blocks: range) -> list[Extent]:
    tier = executor.tier("nvme")
    if isinstance(tier, SlabTier):
        out = []
        for b in blocks:
            slot_bytes, index = tier._where[block_key(b)]
            out.append((Path(tier._slabs[slot_bytes].path), index * slot_bytes, slot_bytes))
        return out
    assert isinstance(tier, DirectoryTier)
    return [
        (tier.root / block_key(b), 0, (tier.root / block_key(b)).stat().st_size) for b in blocks
    ]


def _read_range(fd: int, view: memoryview, offset: int, length: int) -> None:
    done = 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(view), length - done)]], offset + done)
        if n <= 0:
            break
        done += n


def _raw_read_s(extents: list[Extent], buffer: bytearray) -> tuple[float, float]:
    """Plain sequential buffered read of the serial set's blocks, one after the other
    (what ``dd`` of each block file does). Returns (wall s, CPU s of this process)."""
    view = memoryview(buffer)
    cpu = time.process_time()
    start = time.perf_counter()
    for path, offset, length in extents:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
            _read_range(fd, view, offset, length)
        finally:
            os.close(fd)
    return time.perf_counter() - start, time.process_time() - cpu


def _raw_parallel_read_s(extents: list[Extent], threads: int) -> float:
    """What the device gives to ``threads`` concurrent readers: every block split into
    page-aligned parts, all parts read at once with pread (no checksum, no copy kept).
    The ceiling for a parallel promote on this machine."""
    size = max(length for _, _, length in extents)
    part = max(1 << 20, -(-size // threads))
    part += -part % 4096
    jobs = [
        (path, offset + off, min(part, length - off))
        for path, offset, length in extents
        for off in range(0, length, part)
    ]

    def read(job: Extent) -> None:
        path, offset, length = job
        view = memoryview(bytearray(min(part, 8 << 20)))
        fd = os.open(path, os.O_RDONLY)
        try:
            _read_range(fd, view, offset, length)
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    return time.perf_counter() - start


def _promote_s(executor: Executor, blocks: range, parallel: bool, tag: str) -> tuple[float, float]:
    decisions = [Decision(f"{tag}-{b}", 0, b, "promote", "nvme", "dram") for b in blocks]
    cpu = time.process_time()
    start = time.perf_counter()
    if parallel:
        outcomes = executor.apply(decisions)
    else:
        outcomes = [executor.apply_one(d) for d in decisions]
        executor.sync()
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    bad = [o for o in outcomes if o.status != "applied"]
    if bad:
        raise click.ClickException(f"promote failed: {bad[0]}")
    return elapsed


def _open(
    base: Path, num_blocks: int, size: int, threads: int, read_parts: int, kind: str
) -> Executor:
    """The executor as a user would run it: journal fsynced with group commit, the
    blocks verified through CRC32C on every read."""
    disk = {
        "capacity_bytes": 3 * num_blocks * size,
        "root": str(base / "nvme"),
        "num_io_threads": threads,
        "read_parts": read_parts,
    }
    if kind == "slab":
        disk["grow_slots"] = 3 * num_blocks
    tiers = [
        MemoryTier(
            "dram",
            MemoryTierParams(capacity_bytes=3 * num_blocks * size, verify_reads=False),
        ),
        make_tier(kind, "nvme", disk),
    ]
    params = ExecutorParams(
        state_dir=base / "state", fsync_journal=True, group_commit=True, verify_on_recovery=False
    )
    return Executor(tiers, params)


def run(
    sizes_mb: list[int], total_mb: int, threads: int, workdir: Path, kind: str = "slab"
) -> list[dict[str, float]]:
    rows = []
    for size_mb in sizes_mb:
        num_blocks = max(2, total_mb // size_mb)
        size = size_mb * MB
        base = Path(tempfile.mkdtemp(prefix=f"kvwarm-bench-{size_mb}mb-", dir=workdir))
        try:
            executor = _open(base, num_blocks, size, threads, read_parts=1, kind=kind)
            payload = os.urandom(size)
            sets = [range(k * num_blocks, (k + 1) * num_blocks) for k in range(3)]
            serial_blocks, one_blocks, parallel_blocks = sets
            for b in range(3 * num_blocks):
                executor.write(b, payload, "nvme")
            del payload
            nvme_root = base / "nvme"
            buffer = bytearray(min(size + 8192, 8 << 20))
            _drop_cache(nvme_root)
            (raw_s, raw_cpu) = _raw_read_s(_extents(executor, serial_blocks), buffer)
            _drop_cache(nvme_root)
            raw_par_s = _raw_parallel_read_s(_extents(executor, parallel_blocks), threads)
            # Serial: one block at a time, each read in one piece.
            _drop_cache(nvme_root)
            (serial_s, serial_cpu) = _promote_s(
                executor, serial_blocks, parallel=False, tag="serial"
            )
            executor.close()
            # Promote as configured by default: one block at a time, its parts at once.
            executor = _open(base, num_blocks, size, threads, read_parts=threads, kind=kind)
            _drop_cache(nvme_root)
            (one_s, one_cpu) = _promote_s(executor, one_blocks, parallel=False, tag="one")
            # Parallel: blocks at once, and each block's parts at once.
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
                "raw_parallel_gbps": total_gb / raw_par_s,
                "serial_gbps": total_gb / serial_s,
                "promote_gbps": total_gb / one_s,
                "parallel_gbps": total_gb / parallel_s,
                "raw_cpu_s_per_gb": raw_cpu / total_gb,
                "promote_cpu_s_per_gb": one_cpu / total_gb,
                "serial_cpu_s_per_gb": serial_cpu / total_gb,
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
    help="Bytes of blocks per size and pass (disk use peaks at three times this).",
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
@click.option(
    "--kind",
    type=click.Choice(["slab", "directory"]),
    default="slab",
    show_default=True,
    help="The NVMe tier's kind (the sample executor.toml's is slab).",
)
def bench_executor(
    sizes_mb: str, total_mb: int, threads: int, workdir: Path | None, kind: str
) -> None:
    """Promote throughput serial vs parallel vs raw sequential read of the same files."""
    sizes = [int(s) for s in sizes_mb.split(",") if s.strip()]
    workdir = workdir or Path(tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    click.echo(
        f"promote nvme ({kind}) -> dram, {total_mb} MB per size, {threads} threads, cold reads, "
        f"dir {workdir}, "
        f"{os.cpu_count()} CPUs"
    )
    click.echo(
        f"{'block':>7} {'blocks':>6} {'raw GB/s':>9} {'raw par':>8} {'serial':>7} "
        f"{'promote':>8} {'parallel':>9} {'promote/raw':>11} {'par/raw par':>11} "
        f"{'par/serial':>10} {'raw par/raw':>11} {'CPU s/GB raw':>12} {'promote':>8}"
    )
    for row in run(sizes, total_mb, threads, workdir, kind):
        click.echo(
            f"{row['size_mb']:>5}MB {row['num_blocks']:>6} {row['raw_gbps']:>9.2f} "
            f"{row['raw_parallel_gbps']:>8.2f} {row['serial_gbps']:>7.2f} "
            f"{row['promote_gbps']:>8.2f} {row['parallel_gbps']:>9.2f} "
            f"{row['promote_gbps'] / row['raw_gbps']:>11.0%} "
            f"{row['parallel_gbps'] / row['raw_parallel_gbps']:>11.0%} "
            f"{row['parallel_gbps'] / row['serial_gbps']:>9.1f}x "
            f"{row['raw_parallel_gbps'] / row['raw_gbps']:>10.1f}x "
            f"{row['raw_cpu_s_per_gb']:>12.2f} {row['promote_cpu_s_per_gb']:>8.2f}"
        )
    click.echo(
        "raw: sequential buffered read of each block's bytes in 8 MB reads (as dd bs=8M "
        "does); raw par: the same bytes "
        f"read by {threads} threads at once (what parallel reads can give on this device and "
        "CPU). serial: promotes one block at a time, one read per block; promote: one block "
        "at a time, its parts read at once (the default); parallel: blocks and parts at once."
    )
    click.echo(
        "CPU s/GB: this process's CPU time per GB moved (CRC32C, page faults, copies); on a "
        "busy machine it, not the disk, bounds promote throughput."
    )
