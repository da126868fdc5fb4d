"""Directory tiers: each block is one file in a directory (local NVMe, or a mount
that stands for NVMe-oF / object storage).

Layout under ``root``::

    <key>                 committed blocks: 24-byte header + payload
    .tmp/<key>.<nonce>    writes in progress, and large discarded blocks waiting for
                          their unlink in the background (removed by ``recover``)
    .quarantine/<key>.<ns> blocks that failed verification, kept for inspection

Header: magic ``KVWB``, format version, payload length (u64), CRC32C (u32). A write
goes to ``.tmp``, is fsynced, optionally read back and verified, then renamed over
``<key>`` (atomic on POSIX) and the directory fsynced; a crash at any point leaves
either the old state or the new one, plus at most a temp file. Group commit
(``stage_write`` then ``commit_staged``, what the executor does with a batch's moves):
every temp file written and verified first (no sync), then all made durable
(``sync_method``), renamed, and the directory fsynced once for the group. Reads open with
``O_NOFOLLOW`` and check header, length and CRC32C; a failure moves the file to
``.quarantine`` and raises ``CorruptBlockError``. Large blocks are read in parallel
parts (``read_parts``), each checksummed where it lands, the CRCs combined. Keys are validated by
``executor.block_ids`` before they are joined to ``root``, and every path is checked
to sit directly in ``root``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from executor.bandwidth import Pacer
from executor.block_ids import InvalidBlockIdError, block_key
from executor.crc import combine
from executor.tier import (
    BlockNotFoundError,
    Buffer,
    CorruptBlockError,
    RecoveryReport,
    StagedWrite,
    Tier,
    TierParams,
    checksum,
)

log = logging.getLogger(__name__)

SYNC_METHODS = ("fsync", "syncfs")


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs`` (Linux; the ``os`` module has none), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Callable[[int], int]", fn)


_syncfs = _load_syncfs()

_HEADER = struct.Struct("<4sB3xQI4x")
_MAGIC = b"KVWB"
_VERSION = 1
HEADER_BYTES = _HEADER.size
_CHUNK_BYTES = 8 << 20
_TMP = ".tmp"
_QUARANTINE = ".quarantine"
_DEFERRED_UNLINK_BYTES = 4 << 20
"""Discarded block files from this size on are renamed into ``.tmp`` and unlinked by a
background thread: freeing a large file's extents takes tens of ms (a 128 MB file:
60-70 ms on this project's ext4 test VM), which would otherwise stall the promote
that discards its source."""
# O_NONBLOCK: opening a FIFO planted under a block's name returns at once instead of
# waiting for a writer (the fstat that follows then refuses it). Regular files ignore it.
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Corrupt(Exception):
    pass


_HUGE_PAGE_BYTES = 2 << 20
_DIRECT_ALIGN = 4096


def _payload_buffer(length: int) -> memoryview:
    """A writable buffer for a block read from disk, which the reader keeps (a memory
    tier holds it as the block). Large blocks get anonymous memory with transparent
    huge pages: no zero-fill pass in user space and 512x fewer page faults as the read
    fills it (a fresh ``bytearray`` costs a memset plus a fault per 4 KiB page: on a
    2-core VM, 128 MB read at 0.25 GB/s from the page cache into a new bytearray, 1.2
    GB/s into huge-page memory). The mapping is freed when the last view of it goes."""
    if length < _HUGE_PAGE_BYTES:
        return memoryview(bytearray(length))
    area = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, still correct
        area.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(area)


@dataclass(frozen=True)
class DiskTierParams(TierParams):
    """Fields of every local-disk tier kind (``DirectoryTier``, ``SlabTier``)."""

    root: str | Path = ""
    """Directory holding the tier's blocks (created if missing). Not shared by two tiers."""
    fsync: bool = True
    """Sync each block before a write counts as done (a directory tier: the file and
    the directory; a slab tier: its slab file, once per group or ``sync()``). Off only
    for tests on throwaway data: without it a power loss can lose acknowledged blocks."""
    verify_writes: bool = True
    """Read each written block back and check its CRC32C before it is committed. After
    the fsync this usually reads the page cache: it catches a wrong or torn write from
    this process, not media errors (those are caught when the block is next read cold).
    The read-back streams through a small buffer: no second copy of the block."""
    read_parts: int = 4
    """Parallel reads of one block: its payload is split into up to this many parts
    (each at least ``min_part_bytes``), read at once by this tier's part readers and
    checksummed where they land (as LMCache's parallel-read patch does for cold NVMe).
    1: one sequential read per block."""
    min_part_bytes: int = 4 << 20
    """Smallest part worth its own read; smaller blocks are read in one piece."""
    drop_written_pages: bool = True
    """Once a written block is durable, drop its pages from the OS page cache
    (``POSIX_FADV_DONTNEED``): the DRAM tier is the cache, and the next writes reuse
    the freed pages (on this project's VM, writing a 64 KiB file into fresh page-cache
    memory costs ~160-260 us, into pages just freed ~30-50 us). Off: small blocks
    read back soon after their write may come from the page cache."""
    direct_reads: bool = True
    """Read blocks of 2 MiB and more with O_DIRECT (no page-cache copy: the CPU a
    buffered read spends copying is most of a promote's). Filesystems without it
    (tmpfs) fall back to buffered reads by themselves."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not str(self.root):
            raise ValueError("root is required: the directory that holds this tier's blocks")
        if not 1 <= self.read_parts <= 64:
            raise ValueError(f"read_parts must be in [1, 64], got {self.read_parts}")
        if self.min_part_bytes < 4096:
            raise ValueError(f"min_part_bytes must be >= 4096, got {self.min_part_bytes}")


def split_parts(length: int, params: DiskTierParams) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of ``length`` bytes read as parallel parts: up to
    ``read_parts``, each at least ``min_part_bytes``, page-aligned boundaries."""
    num = max(1, min(params.read_parts, length // params.min_part_bytes))
    step = -(-length // num)
    step += -step % 4096
    return [(a, min(a + step, length)) for a in range(0, length, step)] or [(0, 0)]


def checksum_range(fd: int, offset: int, length: int) -> int:
    """CRC32C of ``length`` bytes of ``fd`` from ``offset``, read through one reused
    chunk buffer (no copy of the block kept); raises _Corrupt if the file ends first."""
    chunk = memoryview(bytearray(min(_CHUNK_BYTES, max(length, 1))))
    crc_acc = 0
    done = 0
    while done < length:
        n = os.preadv(fd, [chunk[: min(_CHUNK_BYTES, length - done)]], offset + done)
        if n == 0:
            raise _Corrupt("truncated payload")
        crc_acc = checksum(chunk[:n], crc_acc)
        done += n
    return crc_acc


def write_all(fd: int, parts: Sequence[Buffer], offset: int | None = None) -> None:
    """Write every byte of ``parts``: appended (``writev``), or at ``offset``
    (``pwritev``)."""
    pending = [memoryview(p).cast("B") for p in parts]
    while pending:
        if offset is None:
            n = os.writev(fd, pending)
        else:
            n = os.pwritev(fd, pending, offset)
            offset += n
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0


class PartReaders:
    """The thread pool a disk tier reads one block's parts on, started on first use."""

    def __init__(self, name: str, num_threads: int) -> None:
        self._name = name
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._num_threads, thread_name_prefix=f"kvwarm-{self._name}-part"
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


@dataclass(frozen=True)
class DirectoryTierParams(DiskTierParams):
    sync_method: str = "fsync"
    """How a group of written blocks (``commit_staged``: the executor's moves of one
    batch) is made durable before the blocks are renamed to their names: "fsync" each
    file, the group's files in parallel on ``num_io_threads`` threads; or "syncfs",
    one ``syncfs(2)`` call (Linux) for the group, which also writes back everything
    else dirty on the filesystem: only for a filesystem the tier has to itself. On
    this project's 2-core test VM (ext4 without a journal, where each file's fsync
    writes its inode on its own) syncfs spends ~60 us of CPU per 64 KiB block, fsync
    ~125-200 us. Either way the directory is fsynced once per group."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sync_method not in SYNC_METHODS:
            raise ValueError(
                f"unknown sync_method {self.sync_method!r}; use one of {', '.join(SYNC_METHODS)}"
            )
        if self.sync_method == "syncfs" and _syncfs is None:
            raise ValueError('sync_method "syncfs" needs Linux (libc syncfs); use "fsync"')


class DirectoryTier(Tier):
    """A local-disk tier; durable across restarts.

    Only regular files are ever read: names are ``lstat``-ed first, opened with
    ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-ed again (FIFOs, devices, sockets and links
    are quarantined, never opened for data). A header's declared length must match the
    file's size and fit in the tier's capacity before a byte of payload is allocated.
    A read-only tier (read-only mount, no write permission) still starts: its blocks
    are served, writes fail, and corrupt blocks it cannot move aside are left in place
    and ignored (reported as quarantined).
    """

    Params = DirectoryTierParams
    params: DirectoryTierParams
    durable = True
    group_commits_writes = True

    def __init__(self, name: str, params: DirectoryTierParams) -> None:
        super().__init__(name, params)
        self.root = Path(os.path.realpath(params.root))
        self._tmp_dir = self.root / _TMP
        self._quarantine_dir = self.root / _QUARANTINE
        self._ignored: set[str] = set()
        """Names found bad that could not be moved aside (read-only tier): skipped."""
        self._part_readers = PartReaders(name, params.read_parts)
        self._unlink_pool: ThreadPoolExecutor | None = None
        self._sync_pool: ThreadPoolExecutor | None = None
        self._parts_lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        for path in (self._tmp_dir, self._quarantine_dir):
            try:
                path.mkdir(exist_ok=True)
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                log.warning("tier %s: cannot create %s (%s): read-only", name, path, exc.strerror)
                continue
            # A link planted in place of .tmp or .quarantine would send writes elsewhere.
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise NotADirectoryError(
                    f"{path} must be a real directory, not a link; remove it and restart"
                )
        # Index what is there now (names and headers only); the executor's recovery then
        # reads everything through its checksum. What this pass found is reported by
        # the next recover() call.
        self._carried: RecoveryReport | None = None
        self._carried = self.recover(verify=False)

    # -- paths ------------------------------------------------------------------
    def _path(self, key: str) -> str:
        path = os.path.join(self.root, key)
        # block_key already refused separators and '..'; this is the belt to those braces.
        if os.path.dirname(path) != str(self.root):
            raise InvalidBlockIdError(key, "resolves outside the tier directory")
        return path

    # -- I/O ----------------------------------------------------------------------
    def _open_block(self, path: str) -> tuple[int, int, int]:
        """Open a block file for reading and check its header against the file.
        Returns (fd, payload length, stored crc); the caller closes fd. Raises
        FileNotFoundError, or _Corrupt with the reason (nothing left open)."""
        try:
            before = os.lstat(path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _Corrupt(f"cannot stat: {exc.strerror}") from exc
        if not stat.S_ISREG(before.st_mode):
            raise _Corrupt("not a regular file")
        try:
            fd = os.open(path, _OPEN_READ)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _Corrupt(f"cannot open: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            # Swapped between lstat and open (a FIFO or device put in its place)?
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (
                before.st_dev,
                before.st_ino,
            ):
                raise _Corrupt("not a regular file")
            header = os.pread(fd, HEADER_BYTES, 0)
            if len(header) != HEADER_BYTES:
                raise _Corrupt("truncated header")
            magic, version, length, crc = _HEADER.unpack(header)
            if magic != _MAGIC or version != _VERSION:
                raise _Corrupt("bad magic or version")
            if st.st_size != HEADER_BYTES + length:
                raise _Corrupt(f"file is {st.st_size} bytes, header says {HEADER_BYTES + length}")
            if length > self.capacity_bytes:
                # A sparse file can declare (and be) 8 GiB while holding nothing:
                # refuse before allocating a buffer for it.
                raise _Corrupt(
                    f"declares {length} payload bytes, more than the tier's capacity "
                    f"({self.capacity_bytes})"
                )
            return fd, length, crc
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _read_range(fd: int, view: memoryview, start: int, end: int) -> int:
        """Read payload bytes [start, end) into ``view[start:end]``; their CRC32C.
        Chunked, with the next chunk's read-ahead started before this one is
        checksummed, so I/O and CRC overlap even in one thread."""
        crc_acc = 0
        done = start
        while done < end:
            stop = min(done + _CHUNK_BYTES, end)
            if stop < end:
                os.posix_fadvise(
                    fd, HEADER_BYTES + stop, min(_CHUNK_BYTES, end - stop), os.POSIX_FADV_WILLNEED
                )
            n = os.preadv(fd, [view[done:stop]], HEADER_BYTES + done)
            if n == 0:
                raise _Corrupt("truncated payload")
            crc_acc = checksum(view[done : done + n], crc_acc)
            done += n
        return crc_acc

    def _parts(self, length: int) -> list[tuple[int, int]]:
        return split_parts(length, self.params)

    def _read_file(self, path: str) -> tuple[memoryview, int]:
        """Read and verify one block file; raises _Corrupt with the reason."""
        fd, length, crc = self._open_block(path)
        try:
            if self.params.direct_reads and length >= _HUGE_PAGE_BYTES:
                direct = self._read_direct(fd, path, length, crc)
                if direct is not None:
                    return direct
            view = _payload_buffer(length)
            parts = self._parts(length)
            if len(parts) == 1:
                crc_acc = self._read_range(fd, view, 0, length)
            else:
                futures = [
                    self._part_readers.get().submit(self._read_range, fd, view, a, b)
                    for a, b in parts
                ]
                # Wait for every part before fd is closed, even when one fails.
                wait(futures)
                crc_acc = 0
                for (a, b), future in zip(parts, futures, strict=True):
                    crc_acc = combine(crc_acc, future.result(), b - a)
            if crc_acc != crc:
                raise _Corrupt("crc32c mismatch")
            # Read-only view of a buffer nobody else holds: a memory tier keeps it as is.
            return view.toreadonly(), crc
        finally:
            os.close(fd)

    def _read_direct(
        self, fd: int, path: str, length: int, crc: int
    ) -> tuple[memoryview, int] | None:
        """Read a large block with O_DIRECT: the device writes straight into the
        (page-aligned, huge-page) buffer, skipping the page cache and its copy, which is
        most of a buffered read's CPU. The whole file (header included) is read in
        page-aligned parts, in parallel; the payload is a view past the header. None when
        the filesystem refuses O_DIRECT (tmpfs): the caller reads buffered."""
        try:
            dfd = os.open(path, _OPEN_READ | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise _Corrupt(f"cannot open: {exc.strerror}") from exc
        try:
            st, opened = os.fstat(dfd), os.fstat(fd)
            if (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino):
                raise _Corrupt("replaced while being read")
            total = HEADER_BYTES + length
            aligned = total + (-total % _DIRECT_ALIGN)
            view = _payload_buffer(aligned)
            parts = self._parts(aligned)

            def read_part(start: int, end: int) -> int:
                """Read file bytes [start, end) (stops at end of file); the CRC32C of the
                payload bytes among them."""
                done = start
                while done < end:
                    try:
                        n = os.preadv(dfd, [view[done : min(done + _CHUNK_BYTES, end)]], done)
                    except OSError as exc:
                        raise _Corrupt(f"read failed: {exc.strerror}") from exc
                    if n == 0:
                        break
                    done += n
                lo, hi = max(start, HEADER_BYTES), min(end, total)
                if done < hi:
                    raise _Corrupt("truncated payload")
                return checksum(view[lo:hi]) if hi > lo else 0

            if len(parts) == 1:
                crc_acc = read_part(0, aligned)
            else:
                futures = [self._part_readers.get().submit(read_part, a, b) for a, b in parts]
                wait(futures)  # every part done before dfd is closed, even when one fails
                crc_acc = 0
                for (a, b), future in zip(parts, futures, strict=True):
                    payload_bytes = max(0, min(b, total) - max(a, HEADER_BYTES))
                    crc_acc = combine(crc_acc, future.result(), payload_bytes)
            if crc_acc != crc:
                raise _Corrupt("crc32c mismatch")
            return view[HEADER_BYTES:total].toreadonly(), crc
        finally:
            os.close(dfd)

    def _verify_file(self, path: str) -> int:
        """Check one block file through its CRC32C without holding its payload (a
        fixed chunk buffer is reused). Returns the payload length; raises _Corrupt."""
        fd, length, crc = self._open_block(path)
        try:
            if checksum_range(fd, HEADER_BYTES, length) != crc:
                raise _Corrupt("crc32c mismatch")
            return length
        finally:
            os.close(fd)

    def _read(self, key: str) -> tuple[Buffer, int]:
        path = self._path(key)
        try:
            return self._read_file(path)
        except FileNotFoundError:
            raise BlockNotFoundError(self.name, key) from None
        except _Corrupt as exc:
            self._quarantine_file(key, path)
            self._quarantine_index(key)
            raise CorruptBlockError(self.name, key, str(exc)) from None

    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        tmp = self._write_temp(key, data, crc, sync=self.params.fsync)
        try:
            os.replace(tmp, self._path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.params.fsync:
            self._fsync_dir()

    def _write_temp(self, key: str, data: Buffer, crc: int | None, *, sync: bool) -> str:
        """Write the block file under ``.tmp`` (fsynced with ``sync``, verified with
        ``verify_writes``); its path. On any failure nothing is left."""
        self._path(key)  # checked before anything is written
        tmp = os.path.join(self._tmp_dir, f"{key}.{uuid.uuid4().hex}")
        view = memoryview(data).cast("B")
        crc = checksum(view) if crc is None else crc
        try:
            fd = os.open(tmp, _OPEN_CREATE, 0o644)
            try:
                write_all(fd, [_HEADER.pack(_MAGIC, _VERSION, view.nbytes, crc), view])
                if sync:
                    self._sync_fd(fd)
            finally:
                os.close(fd)
            if self.params.verify_writes:
                try:
                    self._verify_file(tmp)
                except _Corrupt as exc:
                    raise OSError(f"written block {key} failed verification: {exc}") from exc
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    # -- group commit -----------------------------------------------------------------
    def _stage(self, key: str, data: Buffer, crc: int | None) -> str:
        """The temp file, written and verified but not synced: ``_commit_staged`` syncs
        the group's files together. Page-cache writes only: CPU work, no device wait."""
        return self._write_temp(key, data, crc, sync=False)

    def _commit_staged(self, staged: Sequence[StagedWrite]) -> list[Exception | None]:
        """Every temp file made durable (``sync_method``), then each renamed to its
        block's name, then the directory fsynced once for the group. No file is renamed
        before its data is durable, so a crash at any point leaves each block whole
        under its name or absent (its temp file removed by ``recover``); the caller
        counts a block written only once this returns, after the directory sync made
        every name durable."""
        tmps = [str(s.handle) for s in staged]
        errors: list[Exception | None] = [None] * len(staged)
        if self.params.fsync:
            if self.params.sync_method == "syncfs":
                try:
                    self._syncfs()
                except OSError as exc:
                    errors = [exc] * len(staged)
            elif len(tmps) == 1:
                errors = [self._sync_file(tmps[0])]
            else:
                errors = list(self._syncer().map(self._sync_file, tmps))
        for i, (s, tmp) in enumerate(zip(staged, tmps, strict=True)):
            try:
                if errors[i] is None:
                    if self.params.fsync and self.params.sync_method == "syncfs":
                        self._drop_pages(tmp)
                    os.replace(tmp, self._path(s.key))
                    continue
            except OSError as exc:
                errors[i] = exc
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if self.params.fsync and any(e is None for e in errors):
            try:
                self._fsync_dir()
            except OSError as exc:
                # Names not known to be durable: none of the group counts as written. A
                # copy one of them replaced is gone too (never the case for a move).
                for i, s in enumerate(staged):
                    if errors[i] is None:
                        with contextlib.suppress(OSError):
                            os.unlink(self._path(s.key))
                        with self._lock:
                            self._used_bytes -= self._sizes.pop(s.key, 0)
                        errors[i] = exc
        return errors

    def _sync_file(self, path: str) -> Exception | None:
        """fsync one written file (then drop its pages); its error, or None."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                self._sync_fd(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            return exc
        return None

    def _sync_fd(self, fd: int) -> None:
        """fsync a written file, then drop its pages (``drop_written_pages``)."""
        os.fsync(fd)
        if self.params.drop_written_pages:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _drop_pages(self, path: str) -> None:
        if self.params.drop_written_pages:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _syncfs(self) -> None:
        assert _syncfs is not None  # checked by the params
        fd = os.open(self._tmp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs of {self.root}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def _abort_staged(self, staged: Sequence[StagedWrite]) -> None:
        for s in staged:
            with contextlib.suppress(OSError):
                os.unlink(str(s.handle))

    def _syncer(self) -> ThreadPoolExecutor:
        with self._parts_lock:
            if self._sync_pool is None:
                self._sync_pool = ThreadPoolExecutor(
                    self.params.num_io_threads,
                    thread_name_prefix=f"kvwarm-{self.name}-sync",
                )
            return self._sync_pool

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _discard(self, key: str) -> None:
        path = self._path(key)
        try:
            large = os.lstat(path).st_size >= _DEFERRED_UNLINK_BYTES
        except FileNotFoundError:
            return
        if large:
            # Gone from its name at once (an atomic rename); its extents are freed off
            # the caller's path. A crash before the unlink leaves a temp file, which
            # recover() removes.
            gone = os.path.join(self._tmp_dir, f"{key}.{uuid.uuid4().hex}.discarded")
            try:
                os.replace(path, gone)
            except OSError:
                pass  # no .tmp (a read-only tier), or another error: unlink in place
            else:
                self._unlinker().submit(self._unlink_quietly, gone)
                return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _unlinker(self) -> ThreadPoolExecutor:
        with self._parts_lock:
            if self._unlink_pool is None:
                self._unlink_pool = ThreadPoolExecutor(
                    1, thread_name_prefix=f"kvwarm-{self.name}-unlink"
                )
            return self._unlink_pool

    @staticmethod
    def _unlink_quietly(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # left for recover() to remove at the next start
            log.warning("cannot remove discarded block file %s: %s", path, exc)

    def _quarantine_file(self, name: str, path: str) -> None:
        """Move a bad file aside; where that is impossible (read-only tier), leave it
        and ignore its name from now on."""
        target = os.path.join(self._quarantine_dir, f"{name}.{time.time_ns()}")
        try:
            os.replace(path, target)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("tier %s: cannot quarantine %s (%s); ignoring it", self.name, name, exc)
            self._ignored.add(name)

    # -- recovery -------------------------------------------------------------------
    def recover(self, verify: bool = True) -> RecoveryReport:
        """Drop temp files, rebuild the index from the directory and (``verify``) read
        every block through its CRC32C, quarantining what fails. Also quarantines
        entries that are not regular files (links, directories, FIFOs, devices), whose
        names are not valid keys, or whose header does not match the file. Each entry
        is handled on its own: one bad block (or a read-only tier) never stops start-up."""
        report = RecoveryReport(self.name)
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._tmp_dir):
                try:
                    os.unlink(entry.path)
                    report.num_temp_files_removed += 1
                except OSError:
                    pass
        sizes: dict[str, int] = {}
        for entry in os.scandir(self.root):
            if entry.name in (_TMP, _QUARANTINE):
                continue
            if entry.name in self._ignored:
                report.quarantined.append(entry.name)
                continue
            try:
                valid_name = block_key(entry.name) == entry.name
            except InvalidBlockIdError:
                valid_name = False
            try:
                if not valid_name or not entry.is_file(follow_symlinks=False):
                    raise _Corrupt("not a block file")
                if verify:
                    size = self._verify_file(entry.path)
                else:
                    fd, size, _ = self._open_block(entry.path)
                    os.close(fd)
            except _Corrupt:
                self._quarantine_file(entry.name, entry.path)
                report.quarantined.append(entry.name)
                continue
            except FileNotFoundError:
                continue
            sizes[entry.name] = size
        with self._lock:
            self._sizes = sizes
            self._used_bytes = sum(sizes.values())
            self.quarantined.extend(report.quarantined)
        report.num_blocks = len(sizes)
        carried, self._carried = self._carried, None
        if carried is not None:
            report.num_temp_files_removed += carried.num_temp_files_removed
            report.quarantined = sorted(set(carried.quarantined) | set(report.quarantined))
        return report

    def close(self) -> None:
        self._part_readers.close()
        with self._parts_lock:
            pools = [self._unlink_pool, self._sync_pool]
            self._unlink_pool = self._sync_pool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)  # discarded files are unlinked before close returns


@dataclass(frozen=True)
class RemoteDirectoryTierParams(DirectoryTierParams):
    bandwidth_bytes_per_s: float | None = None
    """Cap on reads plus writes through this tier, emulating the network link
    (NVMe-oF or object storage). None: as fast as the directory is."""
    latency_ms: float = 0.0
    """Added to every read and write (network round trip)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"bandwidth_bytes_per_s must be > 0 or None, got {self.bandwidth_bytes_per_s}"
            )
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")


class RemoteDirectoryTier(DirectoryTier):
    """A directory standing for remote storage, with an optional bandwidth cap: each
    transfer books its bytes on a shared link and completes no earlier than its slot."""

    Params = RemoteDirectoryTierParams
    params: RemoteDirectoryTierParams
    group_commits_writes = False
    """Each transfer waits for its own slot on the link: staged, the wait would move
    into ``stage_write``, which the executor runs in the caller's thread."""

    def __init__(self, name: str, params: RemoteDirectoryTierParams) -> None:
        self._pacer = Pacer(params.bandwidth_bytes_per_s) if params.bandwidth_bytes_per_s else None
        super().__init__(name, params)

    def _paced(self, size_bytes: int) -> float:
        end_s = self._pacer.slot_end(size_bytes) if self._pacer else time.monotonic()
        return end_s + self.params.latency_ms / 1000.0

    def _read(self, key: str) -> tuple[Buffer, int]:
        size = self._sizes.get(key, 0)
        end_s = self._paced(size + HEADER_BYTES)
        result = super()._read(key)
        Pacer.wait_until(end_s)
        return result

    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        end_s = self._paced(memoryview(data).nbytes + HEADER_BYTES)
        super()._commit(key, data, crc)
        Pacer.wait_until(end_s)

    def _stage(self, key: str, data: Buffer, crc: int | None) -> str:
        end_s = self._paced(memoryview(data).nbytes + HEADER_BYTES)
        tmp = super()._stage(key, data, crc)
        Pacer.wait_until(end_s)
        return tmp
