"""Directory tiers: each block is one file in a directory (local NVMe, or a mount
that stands for NVMe-oF / object storage).

Layout under ``root``::

    <key>                 committed blocks: 24-byte header + payload
    .tmp/<key>.<nonce>    writes in progress (removed by ``recover``)
    .quarantine/<key>.<ns> blocks that failed verification, kept for inspection

Header: magic ``KVWB``, format version, payload length (u64), CRC32C (u32). A write
goes to ``.tmp``, is fsynced, optionally read back and verified, then renamed over
``<key>`` (atomic on POSIX) and the directory fsynced; a crash at any point leaves
either the old state or the new one, plus at most a temp file. Reads open with
``O_NOFOLLOW`` and check header, length and CRC32C; a failure moves the file to
``.quarantine`` and raises ``CorruptBlockError``. Keys are validated by
``executor.block_ids`` before they are joined to ``root``, and every path is checked
to sit directly in ``root``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from executor.bandwidth import Pacer
from executor.block_ids import InvalidBlockIdError, block_key
from executor.tier import (
    BlockNotFoundError,
    Buffer,
    CorruptBlockError,
    RecoveryReport,
    Tier,
    TierParams,
    checksum,
)

_HEADER = struct.Struct("<4sB3xQI4x")
_MAGIC = b"KVWB"
_VERSION = 1
HEADER_BYTES = _HEADER.size
_CHUNK_BYTES = 8 << 20
_TMP = ".tmp"
_QUARANTINE = ".quarantine"
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Corrupt(Exception):
    pass


@dataclass(frozen=True)
class DirectoryTierParams(TierParams):
    root: str | Path = ""
    """Directory holding the blocks (created if missing). Must not be shared by two tiers."""
    fsync: bool = True
    """fsync each block and the directory before a write counts as done. Off only for
    tests on throwaway data: without it a power loss can lose acknowledged blocks."""
    verify_writes: bool = True
    """Read each written temp file back and check its CRC32C before the rename. After
    the fsync this usually reads the page cache: it catches a wrong or torn write from
    this process, not media errors (those are caught when the block is next read cold)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not str(self.root):
            raise ValueError("root is required: the directory that holds this tier's blocks")


class DirectoryTier(Tier):
    """A local-disk tier; durable across restarts."""

    Params = DirectoryTierParams
    params: DirectoryTierParams
    durable = True

    def __init__(self, name: str, params: DirectoryTierParams) -> None:
        super().__init__(name, params)
        self.root = Path(os.path.realpath(params.root))
        self._tmp_dir = self.root / _TMP
        self._quarantine_dir = self.root / _QUARANTINE
        for path in (self.root, self._tmp_dir, self._quarantine_dir):
            path.mkdir(parents=True, exist_ok=True)
            # A link planted in place of .tmp or .quarantine would send writes elsewhere.
            if path != self.root and not stat.S_ISDIR(os.lstat(path).st_mode):
                raise NotADirectoryError(
                    f"{path} must be a real directory, not a link; remove it and restart"
                )
        # Index what is there now (names and sizes only); the executor's recovery then
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
    def _read_file(self, path: str) -> tuple[memoryview, int]:
        """Read and verify one block file; raises _Corrupt with the reason."""
        try:
            fd = os.open(path, _OPEN_READ)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise _Corrupt(f"cannot open: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Corrupt("not a regular file")
            header = os.pread(fd, HEADER_BYTES, 0)
            if len(header) != HEADER_BYTES:
                raise _Corrupt("truncated header")
            magic, version, length, crc = _HEADER.unpack(header)
            if magic != _MAGIC or version != _VERSION:
                raise _Corrupt("bad magic or version")
            if st.st_size != HEADER_BYTES + length:
                raise _Corrupt(f"file is {st.st_size} bytes, header says {HEADER_BYTES + length}")
            buf = bytearray(length)
            view = memoryview(buf)
            crc_acc = 0
            done = 0
            while done < length:
                end = min(done + _CHUNK_BYTES, length)
                if end < length:
                    # Start reading the next chunk in the background while this one is
                    # checksummed: I/O and CRC overlap even in one thread.
                    os.posix_fadvise(
                        fd,
                        HEADER_BYTES + end,
                        min(_CHUNK_BYTES, length - end),
                        os.POSIX_FADV_WILLNEED,
                    )
                n = os.preadv(fd, [view[done:end]], HEADER_BYTES + done)
                if n == 0:
                    raise _Corrupt("truncated payload")
                crc_acc = checksum(view[done : done + n], crc_acc)
                done += n
            if crc_acc != crc:
                raise _Corrupt("crc32c mismatch")
            # Read-only view of a buffer nobody else holds: a memory tier keeps it as is.
            return view.toreadonly(), crc
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
        final = self._path(key)
        tmp = os.path.join(self._tmp_dir, f"{key}.{uuid.uuid4().hex}")
        view = memoryview(data).cast("B")
        crc = checksum(view) if crc is None else crc
        try:
            fd = os.open(tmp, _OPEN_CREATE, 0o644)
            try:
                self._write_all(fd, [_HEADER.pack(_MAGIC, _VERSION, view.nbytes, crc), view])
                if self.params.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.params.verify_writes:
                try:
                    self._read_file(tmp)
                except _Corrupt as exc:
                    raise OSError(f"written block {key} failed verification: {exc}") from exc
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if self.params.fsync:
            self._fsync_dir()

    @staticmethod
    def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
        pending = [memoryview(p) for p in parts]
        while pending:
            n = os.writev(fd, pending)
            while n and pending:
                if n >= pending[0].nbytes:
                    n -= pending[0].nbytes
                    pending.pop(0)
                else:
                    pending[0] = pending[0][n:]
                    n = 0

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _discard(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def _quarantine_file(self, name: str, path: str) -> None:
        target = os.path.join(self._quarantine_dir, f"{name}.{time.time_ns()}")
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, target)

    # -- recovery -------------------------------------------------------------------
    def recover(self, verify: bool = True) -> RecoveryReport:
        """Drop temp files, rebuild the index from the directory and (``verify``) read
        every block through its CRC32C, quarantining what fails. Also quarantines
        entries that are not plain files (links, directories) or whose names are not
        valid keys."""
        report = RecoveryReport(self.name)
        for entry in os.scandir(self._tmp_dir):
            try:
                os.unlink(entry.path)
                report.num_temp_files_removed += 1
            except FileNotFoundError:
                pass
        sizes: dict[str, int] = {}
        for entry in os.scandir(self.root):
            if entry.name in (_TMP, _QUARANTINE):
                continue
            try:
                valid_name = block_key(entry.name) == entry.name
            except InvalidBlockIdError:
                valid_name = False
            try:
                if not valid_name or not entry.is_file(follow_symlinks=False):
                    raise _Corrupt("not a block file")
                if verify:
                    payload, _ = self._read_file(entry.path)
                    size = len(payload)
                else:
                    size = entry.stat(follow_symlinks=False).st_size - HEADER_BYTES
                    if size < 0:
                        raise _Corrupt("truncated header")
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
            report.quarantined = carried.quarantined + report.quarantined
        return report


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
