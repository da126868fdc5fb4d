"""Slab tiers: blocks stored in fixed-size slots of a few large preallocated files,
instead of a file per block (``DirectoryTier``).

Why: on a disk tier most of a small block's write cost is the file, not the bytes:
create, fsync its inode, rename, fsync the directory, unlink it later. On this
project's 2-core test VM a 64 KiB block costs ~0.8 ms as its own file (synced in
groups of 20) and ~0.1 ms as a slot of a slab file synced once per group. Engines'
KV blocks have one size per model, so a slab per size wastes nothing but the slot's
header and padding.

Layout under ``root``::

    slab-<slot_bytes>.dat     slot i at offset i * slot_bytes: a 512-byte header, then
                              the payload, padded to a multiple of 4 KiB
    .quarantine/<key>.<ns>    bytes of slots that failed verification, for inspection

Header (one 512-byte sector): magic ``KVWSLAB1``, version, state, key length, payload
length, CRC32C of the payload, a sequence number, the key, and a CRC32C of the header
itself. A free slot's header is zeros.

A write (``write``, or ``stage_write`` + ``commit_staged`` for a group): take a free
slot (or grow the file), write payload then header, verify them by reading back
(``verify_writes``); then one ``fdatasync`` of the slab file per group, after which the
block is visible and an older copy of the same key freed. A crash (or power loss)
before the sync can leave a slot whose header landed without its payload: its payload
CRC32C fails, so recovery frees it (``verify_on_recovery``) or the executor's recovery
does, when it reads the destination of an unfinished move before dropping its source;
a slot written whole may also come back, as a renamed file can in ``DirectoryTier``,
and the executor's recovery finishes that move. A discard zeroes the slot's header
(not synced: like an unlink, a crash right after may bring the block back, and the
executor's recovery keeps one copy of any block found twice). A replaced key's two
copies after a crash: the higher sequence number wins.

Reads (one ``preadv`` of header and payload; blocks of 2 MiB and more with O_DIRECT,
in parallel parts, as ``DirectoryTier`` does) check header, key, length and CRC32C; a
failure copies the slot to ``.quarantine``, frees it and raises ``CorruptBlockError``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path

from executor.block_ids import MAX_KEY_CHARS, BlockId, InvalidBlockIdError, block_key
from executor.crc import combine
from executor.tier import (
    BlockNotFoundError,
    Buffer,
    CorruptBlockError,
    RecoveryReport,
    StagedWrite,
    Tier,
    TierError,
    checksum,
)
from executor.tiers.directory import (
    _HUGE_PAGE_BYTES,
    DiskTierParams,
    PartReaders,
    _Corrupt,
    _payload_buffer,
    checksum_range,
    split_parts,
    write_all,
)

log = logging.getLogger(__name__)

SLOT_HEADER_BYTES = 512
_ALIGN = 4096
_FIELDS = struct.Struct("<8sBBHQIQ")  # magic, version, state, key len, length, crc, seq
_MAGIC = b"KVWSLAB1"
_VERSION = 1
_COMMITTED = 2
_HEADER_CRC_AT = SLOT_HEADER_BYTES - 4
_ZERO_PAGE = bytes(_ALIGN)
"""Written over a freed slot's first page: its header zeroed without the kernel reading
the page first (a partial-page write of an uncached page reads it)."""
_DEFERRED_FREE_BYTES = 2 << 20
"""Slots from this size on (read with O_DIRECT) are freed later, at the next ``sync``,
allocation or ``close``: a buffered write to the slab file takes its inode lock
exclusively, so it waits for the file's in-flight direct reads and holds back the next
ones (a discard took ~100 ms during a batch of 64 MB promotes, and the batch's reads
slowed to a third)."""
_CHUNK_BYTES = 8 << 20
_QUARANTINE = ".quarantine"
_GROW_MAX_BYTES = 256 << 20
"""A slab file grows by at most this much at once (whatever ``grow_slots`` says):
large blocks grow it a slot at a time."""
_SLAB_RE = re.compile(r"slab-([0-9]{4,15})\.dat")
assert _FIELDS.size + MAX_KEY_CHARS <= _HEADER_CRC_AT


def slot_bytes_for(size_bytes: int) -> int:
    """Slot size holding a payload of ``size_bytes``: header plus payload, rounded up to
    4 KiB (slot starts stay aligned for O_DIRECT)."""
    total = SLOT_HEADER_BYTES + size_bytes
    return total + (-total % _ALIGN)


def _pack_header(key: str, length: int, crc: int, seq: int, state: int) -> bytes:
    raw = key.encode("ascii")
    body = _FIELDS.pack(_MAGIC, _VERSION, state, len(raw), length, crc, seq) + raw
    body += bytes(_HEADER_CRC_AT - len(body))
    return body + struct.pack("<I", checksum(body))


def _unpack_header(header: Buffer) -> tuple[str, int, int, int, int] | None:
    """(key, length, crc, seq, state) of a valid header; None for a free slot (zeros);
    raises _Corrupt for anything else."""
    view = memoryview(header)
    if view[:8] == bytes(8) and not any(view):
        return None
    if len(view) < SLOT_HEADER_BYTES:
        raise _Corrupt("truncated header")
    (stored,) = struct.unpack_from("<I", view, _HEADER_CRC_AT)
    if checksum(view[:_HEADER_CRC_AT]) != stored:
        raise _Corrupt("header checksum mismatch")
    magic, version, state, key_len, length, crc, seq = _FIELDS.unpack_from(view)
    if magic != _MAGIC or version != _VERSION or state != _COMMITTED:
        raise _Corrupt("bad magic, version or state")
    if key_len > MAX_KEY_CHARS:
        raise _Corrupt("key too long")
    key = bytes(view[_FIELDS.size : _FIELDS.size + key_len]).decode("ascii", "replace")
    return key, length, crc, seq, state


@dataclass(frozen=True)
class SlabTierParams(DiskTierParams):
    """``DiskTierParams`` (root, fsync, verify_writes, read_parts, min_part_bytes,
    direct_reads, drop_written_pages) and the slab's own."""

    grow_slots: int = 64
    """Slots a slab file grows by when it has no free one, at most 256 MiB of them
    (allocated with ``posix_fallocate``, so a full disk shows at growth, not
    mid-write)."""
    max_slot_sizes: int = 64
    """Distinct slot sizes (one slab file each) the tier accepts; a write of one more
    block size is refused with an error that says so."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.grow_slots <= 1 << 20:
            raise ValueError(f"grow_slots must be in [1, 1048576], got {self.grow_slots}")
        if not 1 <= self.max_slot_sizes <= 1024:
            raise ValueError(f"max_slot_sizes must be in [1, 1024], got {self.max_slot_sizes}")


@dataclass
class _Slab:
    """One slab file: its slots' size, descriptors and free slots."""

    slot_bytes: int
    path: str
    fd: int
    num_slots: int
    free: list[int]
    direct_fd: int | None = None
    """O_DIRECT descriptor for large reads (-1: the filesystem refused O_DIRECT)."""


@dataclass(frozen=True)
class _Slot:
    """A written slot not yet committed (a ``StagedWrite``'s handle)."""

    slab: _Slab
    index: int
    length: int
    crc: int
    seq: int


class SlabTier(Tier):
    """A local-disk tier storing blocks in slots of per-size slab files; durable
    across restarts. Only regular files are opened (``O_NOFOLLOW``, ``fstat``-checked);
    a header's declared length must match its slab's slot size before any payload is
    read."""

    Params = SlabTierParams
    params: SlabTierParams
    durable = True
    group_commits_writes = True
    writes_back = True

    def __init__(self, name: str, params: SlabTierParams) -> None:
        super().__init__(name, params)
        self.root = Path(os.path.realpath(params.root))
        self.root.mkdir(parents=True, exist_ok=True)
        self._quarantine_dir = self.root / _QUARANTINE
        with contextlib.suppress(FileExistsError):
            self._quarantine_dir.mkdir()
        if not stat.S_ISDIR(os.lstat(self._quarantine_dir).st_mode):
            raise NotADirectoryError(
                f"{self._quarantine_dir} must be a real directory, not a link; remove it"
            )
        self._slabs: dict[int, _Slab] = {}
        self._where: dict[str, tuple[int, int]] = {}
        """key -> (slot bytes, slot index) of its committed copy."""
        self._seq = 0
        self._unsynced: dict[int, set[int]] = {}
        """Slot bytes -> slots written by ``write_unsynced`` since the last ``sync``
        (a set: bounded by the slots there are, however long ``sync`` is not called)."""
        self._io_lock = threading.Lock()
        """Serializes slab growth and descriptor opening (not reads or writes)."""
        self._part_readers = PartReaders(name, params.read_parts)
        self._to_free: list[tuple[_Slab, int]] = []
        """Discarded large slots whose headers are zeroed at the next ``sync``, slot
        allocation or ``close`` (``_release_later``)."""
        self._carried: RecoveryReport | None = None
        self._carried = self.recover(verify=False)

    # -- slots ----------------------------------------------------------------------
    def _slab(self, slot_bytes: int) -> _Slab:
        slab = self._slabs.get(slot_bytes)
        if slab is not None:
            return slab
        with self._io_lock:
            slab = self._slabs.get(slot_bytes)
            if slab is None:
                if len(self._slabs) >= self.params.max_slot_sizes:
                    raise TierError(
                        f"tier {self.name!r} already holds blocks of {len(self._slabs)} "
                        f"sizes (max_slot_sizes); a block of slot size {slot_bytes} B "
                        "needs one more: raise max_slot_sizes or use fewer block sizes"
                    )
                path = str(self.root / f"slab-{slot_bytes}.dat")
                slab = _Slab(slot_bytes, path, self._open_slab(path, create=True), 0, [])
                self._slabs[slot_bytes] = slab
            return slab

    @staticmethod
    def _open_slab(path: str, *, create: bool) -> int:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        fd = os.open(path, flags | os.O_NONBLOCK, 0o644)  # a FIFO there must not block
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise TierError(f"{path} is not a regular file: move it out of the tier's root")
        os.set_blocking(fd, True)
        return fd

    def _allocate(self, slot_bytes: int) -> tuple[_Slab, int]:
        slab = self._slab(slot_bytes)
        with self._lock:
            if slab.free:
                return slab, slab.free.pop()
            deferred = bool(self._to_free)
        if deferred:
            self._free_deferred()
            with self._lock:
                if slab.free:
                    return slab, slab.free.pop()
        with self._io_lock:
            with self._lock:
                if slab.free:
                    return slab, slab.free.pop()
                start = slab.num_slots
            grow = max(1, min(self.params.grow_slots, _GROW_MAX_BYTES // slot_bytes))
            os.posix_fallocate(slab.fd, start * slot_bytes, grow * slot_bytes)
            with self._lock:
                slab.num_slots = start + grow
                slab.free.extend(range(start + grow - 1, start, -1))  # lowest popped first
                return slab, start

    def _release_later(self, slab: _Slab, index: int) -> None:
        """``_release`` now for small slots; large ones are queued for
        ``_free_deferred`` (not reused before their header is zeroed; a crash before
        that brings the block back, as an unsynced discard may)."""
        if slab.slot_bytes < _DEFERRED_FREE_BYTES:
            self._release(slab, index)
            return
        with self._lock:
            self._to_free.append((slab, index))

    def _free_deferred(self) -> None:
        """Zero the headers of the slots ``_release_later`` queued and free them."""
        with self._lock:
            queued, self._to_free = self._to_free, []
        for slab, index in queued:
            self._release(slab, index)

    def _release(self, slab: _Slab, index: int) -> None:
        """Zero a slot's header and return it to the free list."""
        try:
            os.pwrite(slab.fd, _ZERO_PAGE, index * slab.slot_bytes)
        except OSError as exc:  # the slot stays out of use; recovery looks at it again
            log.warning("tier %s: cannot free slot %d of %s: %s", self.name, index, slab.path, exc)
            return
        with self._lock:
            slab.free.append(index)

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    # -- writes ---------------------------------------------------------------------
    def _write_slot(self, key: str, data: Buffer, crc: int | None) -> _Slot:
        """Payload, then header, into a free slot (page cache), verified with
        ``verify_writes``; on failure the slot is freed."""
        view = memoryview(data).cast("B")
        crc = checksum(view) if crc is None else crc
        slab, index = self._allocate(slot_bytes_for(view.nbytes))
        offset = index * slab.slot_bytes
        seq = self._next_seq()
        try:
            header = _pack_header(key, view.nbytes, crc, seq, _COMMITTED)
            write_all(slab.fd, [view], offset + SLOT_HEADER_BYTES)
            write_all(slab.fd, [header], offset)
            if self.params.verify_writes:
                try:
                    self._verify_slot(slab, index, key, view.nbytes, crc)
                except _Corrupt as exc:
                    raise OSError(f"written block {key} failed verification: {exc}") from exc
        except BaseException:
            self._release(slab, index)
            raise
        return _Slot(slab, index, view.nbytes, crc, seq)

    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        slot = self._write_slot(key, data, crc)
        error = self._commit_slots([StagedWrite(key, slot.length, slot)])[0]
        if error is not None:
            raise error

    def write_unsynced(self, block_id: BlockId, data: Buffer, checksum: int | None = None) -> None:
        """A slot written and indexed at once; its file is synced by ``sync()``."""
        self._write_with(self._commit_unsynced, block_id, data, checksum)

    def _commit_unsynced(self, key: str, data: Buffer, crc: int | None) -> None:
        slot = self._write_slot(key, data, crc)
        with self._lock:
            self._unsynced.setdefault(slot.slab.slot_bytes, set()).add(slot.index)
        self._place(key, slot.slab, slot.index)

    def sync(self) -> None:
        """One ``fdatasync`` per slab file written by ``write_unsynced`` since the last
        call (then its pages dropped, ``drop_written_pages``). On a failure the slots
        are kept for the next call and the error raised: nothing is lost in memory,
        and the caller acknowledges nothing."""
        self._free_deferred()
        with self._lock:
            dirty, self._unsynced = self._unsynced, {}
        for done, (slot_bytes, indexes) in enumerate(dirty.items()):
            slab = self._slabs[slot_bytes]
            try:
                if self.params.fsync:
                    os.fdatasync(slab.fd)
            except OSError:
                with self._lock:
                    for later, more in list(dirty.items())[done:]:
                        self._unsynced.setdefault(later, set()).update(more)
                raise
            if self.params.fsync and self.params.drop_written_pages:
                for index in indexes:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(
                            slab.fd, index * slot_bytes, slot_bytes, os.POSIX_FADV_DONTNEED
                        )

    def _stage(self, key: str, data: Buffer, crc: int | None) -> object:
        return self._write_slot(key, data, crc)

    def _commit_staged(self, staged: Sequence[StagedWrite]) -> list[Exception | None]:
        return self._commit_slots(staged)

    def _commit_slots(self, staged: Sequence[StagedWrite]) -> list[Exception | None]:
        """Sync each slab file the group wrote, once, then index its slots (freeing a
        replaced copy). A failed sync fails that file's writes: their slots are freed."""
        errors: list[Exception | None] = [None] * len(staged)
        by_slab: dict[int, list[int]] = {}
        for i, s in enumerate(staged):
            by_slab.setdefault(_slot(s).slab.slot_bytes, []).append(i)
        for slot_bytes, members in by_slab.items():
            slab = self._slabs[slot_bytes]
            slots = [_slot(staged[i]) for i in members]
            try:
                if self.params.fsync:
                    os.fdatasync(slab.fd)
                    if self.params.drop_written_pages:
                        for slot in slots:
                            os.posix_fadvise(
                                slab.fd, slot.index * slot_bytes, slot_bytes, os.POSIX_FADV_DONTNEED
                            )
            except OSError as exc:
                for i, slot in zip(members, slots, strict=True):
                    errors[i] = exc
                    self._release(slab, slot.index)
                continue
            for i, slot in zip(members, slots, strict=True):
                self._place(staged[i].key, slab, slot.index)
        return errors

    def _place(self, key: str, slab: _Slab, index: int) -> None:
        """Point ``key`` at its new slot; free the slot of the copy it replaces."""
        with self._lock:
            old = self._where.get(key)
            self._where[key] = (slab.slot_bytes, index)
        if old is not None:
            self._release(self._slabs[old[0]], old[1])

    def _abort_staged(self, staged: Sequence[StagedWrite]) -> None:
        for s in staged:
            slot = _slot(s)
            self._release(slot.slab, slot.index)

    # -- reads ----------------------------------------------------------------------
    def _locate(self, key: str) -> tuple[_Slab, int]:
        with self._lock:
            where = self._where.get(key)
        if where is None:
            raise BlockNotFoundError(self.name, key)
        return self._slabs[where[0]], where[1]

    def _read(self, key: str) -> tuple[Buffer, int]:
        slab, index = self._locate(key)
        length = self._sizes.get(key)
        if length is None:
            raise BlockNotFoundError(self.name, key)
        try:
            return self._read_slot(slab, index, key, length)
        except _Corrupt as exc:
            with self._lock:
                moved = self._where.get(key) != (slab.slot_bytes, index)
            if moved:  # discarded or replaced while being read: not corruption
                raise BlockNotFoundError(self.name, key) from None
            self._quarantine_slot(key, slab, index)
            raise CorruptBlockError(self.name, key, str(exc)) from None

    def _read_slot(self, slab: _Slab, index: int, key: str, length: int) -> tuple[Buffer, int]:
        offset = index * slab.slot_bytes
        total = SLOT_HEADER_BYTES + length
        if self.params.direct_reads and length >= _HUGE_PAGE_BYTES:
            dfd = self._direct_fd(slab)
            if dfd is not None:
                aligned = total + (-total % _ALIGN)
                view = _payload_buffer(aligned)
                crc = self._read_parts(dfd, view, offset, total, aligned)
                self._check(view, key, length, crc)
                return view[SLOT_HEADER_BYTES:total].toreadonly(), crc
        view = _payload_buffer(total)
        crc = self._read_parts(slab.fd, view, offset, total, total)
        self._check(view, key, length, crc)
        return view[SLOT_HEADER_BYTES:total].toreadonly(), crc

    @staticmethod
    def _check(view: memoryview, key: str, length: int, payload_crc: int) -> None:
        parsed = _unpack_header(view[:SLOT_HEADER_BYTES])
        if parsed is None:
            raise _Corrupt("slot is free")
        got_key, got_length, crc, _, state = parsed
        if state != _COMMITTED or got_key != key or got_length != length:
            raise _Corrupt(f"slot holds {got_key!r} ({got_length} B, state {state})")
        if crc != payload_crc:
            raise _Corrupt("crc32c mismatch")

    def _read_parts(self, fd: int, view: memoryview, offset: int, total: int, end: int) -> int:
        """Read slot bytes [0, end) at ``offset`` into ``view`` (parallel parts for large
        blocks); the CRC32C of the payload bytes [header, total)."""

        def read_part(start: int, stop: int) -> int:
            done = start
            while done < stop:
                try:
                    n = os.preadv(fd, [view[done : min(done + _CHUNK_BYTES, stop)]], offset + done)
                except OSError as exc:
                    raise _Corrupt(f"read failed: {exc.strerror}") from exc
                if n == 0:
                    raise _Corrupt("truncated slot")
                done += n
            lo, hi = max(start, SLOT_HEADER_BYTES), min(stop, total)
            return checksum(view[lo:hi]) if hi > lo else 0

        parts = split_parts(end, self.params)
        if len(parts) == 1:
            return read_part(0, end)
        futures = [self._part_readers.get().submit(read_part, a, b) for a, b in parts]
        wait(futures)  # every part done before the caller reuses anything
        crc = 0
        for (a, b), future in zip(parts, futures, strict=True):
            crc = combine(crc, future.result(), max(0, min(b, total) - max(a, SLOT_HEADER_BYTES)))
        return crc

    def _direct_fd(self, slab: _Slab) -> int | None:
        if slab.direct_fd is None:
            with self._io_lock:
                if slab.direct_fd is None:
                    try:
                        slab.direct_fd = os.open(
                            slab.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
                        )
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        slab.direct_fd = -1
        return None if slab.direct_fd < 0 else slab.direct_fd

    def _verify_slot(self, slab: _Slab, index: int, key: str, length: int, crc: int) -> None:
        """Read a slot back through its CRC32C in fixed chunks (no copy of the block
        kept); raises _Corrupt."""
        offset = index * slab.slot_bytes
        header = os.pread(slab.fd, SLOT_HEADER_BYTES, offset)
        parsed = _unpack_header(header)
        if parsed is None or parsed[0] != key or parsed[1] != length or parsed[2] != crc:
            raise _Corrupt("header does not match what was written")
        if checksum_range(slab.fd, offset + SLOT_HEADER_BYTES, length) != crc:
            raise _Corrupt("crc32c mismatch")

    # -- discard, quarantine --------------------------------------------------------
    def _discard(self, key: str) -> None:
        with self._lock:
            where = self._where.pop(key, None)
        if where is not None:
            self._release_later(self._slabs[where[0]], where[1])

    def _quarantine_slot(self, key: str, slab: _Slab, index: int) -> None:
        """Copy a bad slot's bytes aside, free it and drop the key from the index."""
        self._set_aside(key, slab, index)
        with self._lock:
            if self._where.get(key) == (slab.slot_bytes, index):
                del self._where[key]
        self._quarantine_index(key)

    def _set_aside(self, key: str, slab: _Slab, index: int) -> None:
        """Copy a bad slot's bytes to ``.quarantine`` (best effort) and free the slot."""
        with contextlib.suppress(OSError):
            data = os.pread(slab.fd, slab.slot_bytes, index * slab.slot_bytes)
            target = self._quarantine_dir / f"{key}.{time.time_ns()}"
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                write_all(fd, [data], 0)
            finally:
                os.close(fd)
        self._release(slab, index)

    # -- recovery -------------------------------------------------------------------
    def recover(self, verify: bool = True) -> RecoveryReport:
        """Rebuild the index from the slab files' headers: slots with a torn header or
        a size that does not fit their slab are freed (counted as temp files removed), a key found twice keeps its higher
        sequence number, and (``verify``) every block is read through its CRC32C,
        what fails quarantined. Files that are not slabs are left alone and logged."""
        report = RecoveryReport(self.name)
        where: dict[str, tuple[int, int, int]] = {}  # key -> (slot bytes, index, seq)
        sizes: dict[str, int] = {}
        stale: list[tuple[_Slab, int]] = []
        max_seq = self._seq
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            match = _SLAB_RE.fullmatch(entry.name)
            if entry.name == _QUARANTINE:
                continue
            if (
                match is None
                or int(match.group(1)) % _ALIGN
                or not entry.is_file(follow_symlinks=False)
            ):
                log.warning("tier %s: ignoring %s (not a slab file)", self.name, entry.path)
                continue
            slab = self._adopt(entry.path, int(match.group(1)))
            for index, header in self._headers(slab):
                try:
                    parsed = _unpack_header(header)
                except _Corrupt:
                    stale.append((slab, index))
                    report.num_temp_files_removed += 1
                    continue
                if parsed is None:
                    slab.free.append(index)
                    continue
                key, length, crc, seq, _ = parsed
                max_seq = max(max_seq, seq)
                try:
                    valid_key = block_key(key) == key
                except InvalidBlockIdError:
                    valid_key = False
                if slot_bytes_for(length) != slab.slot_bytes:
                    stale.append((slab, index))
                    report.num_temp_files_removed += 1
                    continue
                if not valid_key or length > self.capacity_bytes:
                    self._set_aside(key if valid_key else "invalid-key", slab, index)
                    report.quarantined.append(key)
                    continue
                if verify:
                    try:
                        self._verify_slot(slab, index, key, length, crc)
                    except _Corrupt:
                        self._set_aside(key, slab, index)
                        report.quarantined.append(key)
                        continue
                prior = where.get(key)
                if prior is not None:
                    loser = (prior[0], prior[1]) if prior[2] < seq else (slab.slot_bytes, index)
                    stale.append((self._slabs[loser[0]], loser[1]))
                    if prior[2] > seq:
                        continue
                where[key] = (slab.slot_bytes, index, seq)
                sizes[key] = length
        with self._lock:
            self._seq = max_seq
            self._where = {key: (w[0], w[1]) for key, w in where.items()}
            self._sizes = sizes
            self._used_bytes = sum(sizes.values())
            self.quarantined.extend(report.quarantined)
        for slab, index in stale:
            self._release(slab, index)
        for slab in self._slabs.values():
            slab.free.sort(reverse=True)  # lowest index popped first
        report.num_blocks = len(sizes)
        carried, self._carried = self._carried, None
        if carried is not None:
            report.num_temp_files_removed += carried.num_temp_files_removed
            report.quarantined = sorted(set(carried.quarantined) | set(report.quarantined))
        return report

    def _adopt(self, path: str, slot_bytes: int) -> _Slab:
        """The slab for ``path``, opened once; its free list rebuilt by the caller."""
        slab = self._slabs.get(slot_bytes)
        if slab is None:
            slab = _Slab(slot_bytes, path, self._open_slab(path, create=False), 0, [])
            self._slabs[slot_bytes] = slab
        size = os.fstat(slab.fd).st_size
        slab.num_slots = size // slot_bytes
        slab.free = []
        return slab

    @staticmethod
    def _headers(slab: _Slab) -> Iterator[tuple[int, bytes]]:
        """Every slot's index and header."""
        for index in range(slab.num_slots):
            yield index, os.pread(slab.fd, SLOT_HEADER_BYTES, index * slab.slot_bytes)

    def close(self) -> None:
        self._free_deferred()
        self._part_readers.close()
        with self._io_lock:
            slabs = list(self._slabs.values())
        for slab in slabs:
            for fd in (slab.fd, slab.direct_fd):
                if fd is not None and fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            slab.direct_fd = None


def _slot(staged: StagedWrite) -> _Slot:
    assert isinstance(staged.handle, _Slot), "a StagedWrite of another tier"
    return staged.handle
