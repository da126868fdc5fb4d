"""The ``Tier`` interface every storage tier implements, real or simulated.

Primitives (all thread-safe; ``block_id`` is an int hash or a safe string id, see
``executor.block_ids``):

- ``contains(block_id) -> bool``: is a committed copy here.
- ``read(block_id) -> Buffer``: the payload, checksum verified. Raises
  ``BlockNotFoundError``; raises ``CorruptBlockError`` after quarantining a block
  whose checksum fails (callers treat that as a miss, never serve the bytes).
- ``write(block_id, data, checksum=None)``: store atomically. A tier may keep a
  read-only ``memoryview`` or ``bytes`` it is given instead of copying it. Either the whole
  block is committed and verified, or nothing is left behind. Raises
  ``TierFullError`` when it does not fit: a tier never exceeds its capacity.
- ``discard(block_id) -> bool``: drop it (True if it was here).
- ``used_bytes`` / ``capacity_bytes``: payload bytes held / allowed.

Group commit (a batch of writes made durable together, fewer syncs than one by one):
``stage_write(block_id, data, checksum=None) -> StagedWrite`` reserves room and
writes the payload where no reader sees it (``TierFullError`` as ``write``); then
``commit_staged(staged)`` makes a group durable and visible, together, reporting
each write's error or None; ``abort_staged(staged)`` drops them. Every tier
supports it (by default a staged write holds its payload and commits it as ``write``
does); tiers whose writes cost less together declare ``group_commits_writes``
(directory tiers: the group's files synced in parallel, one directory sync per
group), and the executor stages a batch's moves into those.

Write-back (a block whose only other copy is volatile, so syncing it before its
source is dropped protects nothing a power loss would not take anyway):
``write_unsynced(block_id, data, checksum=None)`` commits a block visibly without
making it durable; ``sync()`` makes every such write durable. By default
``write_unsynced`` is ``write`` and ``sync`` does nothing; tiers that gain from it
declare ``writes_back`` (slab tiers: one file sync per ``sync()``), and the executor
writes moves out of volatile tiers into those this way, syncing them with its journal.

Helpers with default implementations: ``read_with_checksum`` (moves pass the
source's CRC32C on to the destination so it is computed once), ``block_keys``, ``size_of``,
``recover`` (called once at executor start: drop temp files, rebuild the index,
quarantine corrupt blocks) and ``close``.

Constructor shape, the same for every tier: ``SomeTier(name, SomeTier.Params(...))``
where ``name`` is one of ``executor.names.TIER_NAMES`` and ``Params`` is a frozen
dataclass that validates its fields. Metrics wrap tiers from outside; tiers do not
count for anyone.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, cast

from executor.block_ids import BlockId, block_key
from executor.crc import checksum as checksum  # re-exported for the tiers
from executor.names import check_tier_name

Buffer = bytes | bytearray | memoryview
"""Block payloads: serialized KV tensors. Tiers return whichever avoids a copy."""


class TierError(Exception):
    """Base of the errors tiers raise."""


class BlockNotFoundError(TierError, KeyError):
    """The block is not in this tier."""

    def __init__(self, tier: str, key: str) -> None:
        self.tier = tier
        self.key = key
        super().__init__(f"block {key} is not in tier {tier!r}; check contains() first")

    def __str__(self) -> str:
        return str(self.args[0])


class CorruptBlockError(TierError):
    """A stored block failed verification; it has been quarantined and must be
    treated as missing (fetch it from elsewhere or recompute it)."""

    def __init__(self, tier: str, key: str, problem: str) -> None:
        self.tier = tier
        self.key = key
        self.problem = problem
        super().__init__(f"block {key} in tier {tier!r} is corrupt ({problem}); quarantined")


class TierFullError(TierError):
    """A write does not fit. Make room (demote or discard) or write elsewhere."""

    def __init__(self, tier: str, key: str, size_bytes: int, free_bytes: int) -> None:
        self.tier = tier
        self.key = key
        self.size_bytes = size_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"tier {tier!r} has {free_bytes} bytes free, block {key} needs {size_bytes}; "
            "make room first or raise the tier's capacity_bytes"
        )


@dataclass(frozen=True)
class TierParams:
    """Fields every tier has. Subclasses add their own, each validated."""

    capacity_bytes: int
    """Payload bytes this tier may hold; writes that would exceed it are refused."""
    num_io_threads: int = 4
    """Size of this tier's thread pool in the executor (parallel reads/writes)."""

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int):
            raise ValueError(f"capacity_bytes must be an int, got {self.capacity_bytes!r}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if not 1 <= self.num_io_threads <= 256:
            raise ValueError(f"num_io_threads must be in [1, 256], got {self.num_io_threads}")


@dataclass
class RecoveryReport:
    """What ``recover`` found in one tier."""

    tier: str
    num_blocks: int = 0
    num_temp_files_removed: int = 0
    quarantined: list[str] = field(default_factory=list)


@dataclass(eq=False)
class StagedWrite:
    """A block written by ``Tier.stage_write`` and not yet committed: room is
    reserved for it, readers do not see it. Pass it to ``commit_staged`` or
    ``abort_staged`` of the same tier, once."""

    key: str
    size_bytes: int
    handle: object = None
    """The tier's own (a directory tier: the temp file's path)."""


class Tier(ABC):
    """Base class: holds the name, params and the capacity bookkeeping.

    Subclasses implement ``_read``/``_commit``/``_discard``/``_list`` and keep
    ``self._sizes`` (key -> payload bytes of committed blocks) up to date; capacity
    is enforced here with reservations, so concurrent writes can never overshoot.
    """

    Params: ClassVar[type[TierParams]] = TierParams
    durable: ClassVar[bool] = False
    """True when blocks survive a process restart (directory tiers)."""
    blocking_io: bool = True
    """True when reads and writes wait on a device (disk, network, GPU copies): the
    executor runs such moves in the tier's thread pool, in parallel. False (host
    memory): a move of a small block costs less than handing it to a thread, so the
    executor runs it in the caller's thread."""
    group_commits_writes: ClassVar[bool] = False
    """True when committing staged writes as a group (``stage_write`` each, then one
    ``commit_staged``) costs less than as many ``write``s, e.g. fewer syncs; the
    executor then stages a batch's moves into this tier and commits them together."""

    writes_back: ClassVar[bool] = False
    """True when ``write_unsynced`` + ``sync`` cost less than ``write`` (the executor
    then writes moves out of volatile tiers with it, synced with its journal)."""

    def __init__(self, name: str, params: TierParams) -> None:
        self.name = check_tier_name(name)
        if not isinstance(params, self.Params):
            raise TypeError(
                f"{type(self).__name__} needs {self.Params.__qualname__}, got {type(params).__name__}"
            )
        self.params = params
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._used_bytes = 0
        self._reserved_bytes = 0
        self.quarantined: list[str] = []
        """Keys found corrupt since start (their bytes are moved aside or dropped)."""

    # -- public interface -------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.params.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Committed payload bytes (in-progress writes are not counted)."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes a new write can still take, net of in-progress writes; never negative
        (a tier found over capacity at start, e.g. after its capacity was lowered,
        has no room until blocks leave it)."""
        with self._lock:
            return max(0, self.capacity_bytes - self._used_bytes - self._reserved_bytes)

    def contains(self, block_id: BlockId) -> bool:
        return self._key(block_id) in self._sizes

    def size_of(self, block_id: BlockId) -> int | None:
        return self._sizes.get(self._key(block_id))

    def block_keys(self) -> list[str]:
        """Keys of committed blocks (a snapshot)."""
        with self._lock:
            return list(self._sizes)

    def read(self, block_id: BlockId) -> Buffer:
        return self.read_with_checksum(block_id)[0]

    def read_with_checksum(self, block_id: BlockId) -> tuple[Buffer, int]:
        key = self._key(block_id)
        if key not in self._sizes:
            raise BlockNotFoundError(self.name, key)
        return self._read(key)

    def write(self, block_id: BlockId, data: Buffer, checksum: int | None = None) -> None:
        """Store ``data`` atomically. ``checksum``: the payload's CRC32C when the caller
        already has it (a move); it is written as the block's checksum, so a wrong
        value makes the block read as corrupt, never silently wrong."""
        self._write_with(self._commit, block_id, data, checksum)

    def _write_with(
        self,
        commit: Callable[[str, Buffer, int | None], None],
        block_id: BlockId,
        data: Buffer,
        checksum: int | None,
    ) -> None:
        """Reserve room, ``commit(key, data, checksum)``, then count the block (or, if
        it raised, release the room)."""
        key = self._key(block_id)
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._reserve(key, size)
        committed = False
        try:
            commit(key, data, checksum)
            committed = True
        finally:
            with self._lock:
                self._reserved_bytes -= size
                if committed:
                    self._used_bytes += size - self._sizes.get(key, 0)
                    self._sizes[key] = size

    def write_unsynced(self, block_id: BlockId, data: Buffer, checksum: int | None = None) -> None:
        """``write``, visible at once but durable only at the next ``sync()`` (a power
        loss before it may leave the block torn: its checksum then fails, and it is
        quarantined, never served). Default: ``write``."""
        self.write(block_id, data, checksum)

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Make every ``write_unsynced`` so far durable. Default: nothing to do."""

    def stage_write(
        self, block_id: BlockId, data: Buffer, checksum: int | None = None
    ) -> StagedWrite:
        """First half of a group-committed ``write``: reserve room (``TierFullError``
        when there is none) and write the payload where no reader sees it. Nothing is
        committed until ``commit_staged``; a failure here leaves nothing behind."""
        key = self._key(block_id)
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._reserve(key, size)
        try:
            handle = self._stage(key, data, checksum)
        except BaseException:
            with self._lock:
                self._reserved_bytes -= size
            raise
        return StagedWrite(key, size, handle)

    def commit_staged(self, staged: Sequence[StagedWrite]) -> list[Exception | None]:
        """Second half: make every staged write durable and visible, together. One
        entry per write, in order: None when it is committed (as ``write`` would have
        left it), else its error (nothing of it left behind)."""
        unfinished = RuntimeError("the group commit did not finish")
        errors: list[Exception | None] = [unfinished] * len(staged)
        try:
            if staged:
                errors = self._commit_staged(staged)
        finally:
            with self._lock:
                for s, error in zip(staged, errors, strict=True):
                    self._reserved_bytes -= s.size_bytes
                    if error is None:
                        self._used_bytes += s.size_bytes - self._sizes.get(s.key, 0)
                        self._sizes[s.key] = s.size_bytes
        return errors

    def abort_staged(self, staged: Sequence[StagedWrite]) -> None:
        """Drop staged writes without committing them."""
        try:
            self._abort_staged(staged)
        finally:
            with self._lock:
                for s in staged:
                    self._reserved_bytes -= s.size_bytes

    def discard(self, block_id: BlockId) -> bool:
        key = self._key(block_id)
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self._used_bytes -= size
        self._discard(key)
        return True

    def recover(self, verify: bool = True) -> RecoveryReport:
        """Rebuild the index from storage. Volatile tiers start empty."""
        return RecoveryReport(self.name, num_blocks=len(self._sizes))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (file handles, device memory)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.params!r})"

    # -- for subclasses ---------------------------------------------------------
    def _reserve(self, key: str, size: int) -> None:
        """Reserve ``size`` bytes for a write of ``key`` (replacing its old copy)."""
        with self._lock:
            old = self._sizes.get(key, 0)
            free = self.capacity_bytes - self._used_bytes - self._reserved_bytes + old
            if size > free:
                raise TierFullError(self.name, key, size, free)
            self._reserved_bytes += size

    def _stage(self, key: str, data: Buffer, crc: int | None) -> object:
        """Write a payload that ``_commit_staged`` will commit; returns the tier's
        handle for it. Default: hold the payload (a copy of a mutable buffer, which
        the caller may reuse) for ``_commit`` at commit time."""
        immutable = isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly)
        return (data if immutable else bytes(data), crc)

    def _commit_staged(self, staged: Sequence[StagedWrite]) -> list[Exception | None]:
        """Commit staged writes together; per write None or its error. Default: one
        ``_commit`` each."""
        errors: list[Exception | None] = []
        for s in staged:
            data, crc = cast("tuple[Buffer, int | None]", s.handle)  # from the default _stage
            try:
                self._commit(s.key, data, crc)
                errors.append(None)
            except Exception as exc:  # reported for this write; the others go on
                errors.append(exc)
        return errors

    def _abort_staged(self, staged: Sequence[StagedWrite]) -> None:  # noqa: B027
        """Remove what ``_stage`` left. Default: nothing (it only held the payload)."""

    def _key(self, block_id: BlockId) -> str:
        """``block_key(block_id)``; a key this tier holds was checked when it came in
        (written, or found by ``recover``), so the executor's calls with keys skip the
        check."""
        if type(block_id) is str and block_id in self._sizes:
            return block_id
        return block_key(block_id)

    def _quarantine_index(self, key: str) -> None:
        """Drop a corrupt ``key`` from the index and record it in ``quarantined``."""
        with self._lock:
            self.quarantined.append(key)
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used_bytes -= size

    def _index(self, key: str, size: int) -> None:
        with self._lock:
            self._used_bytes += size - self._sizes.get(key, 0)
            self._sizes[key] = size

    @abstractmethod
    def _read(self, key: str) -> tuple[Buffer, int]:
        """Return (payload, crc32) for a committed key, verified; on a checksum
        failure quarantine it, call ``_quarantine_index`` and raise ``CorruptBlockError``."""

    @abstractmethod
    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        """Store the payload under ``key`` atomically (all or nothing)."""

    @abstractmethod
    def _discard(self, key: str) -> None:
        """Remove the stored payload of a key already dropped from the index."""
