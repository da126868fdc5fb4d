"""``Executor``: holds tiers fastest to slowest, applies ``Decision``s, never loses a block.

Primitives:

- ``Executor(tiers, ExecutorParams(...))``: recovers on construction (see below);
  ``last_recovery`` says what it found.
- ``apply(decisions) -> list[Outcome]``: the ``executor.protocol.Executor`` batch
  call. In order, with moves of different blocks run in parallel (each in the thread
  pool of the tier it reads from; small blocks moved between host-memory tiers run in
  the caller's thread, where a hand-off would cost more than the move) within stretches of the batch whose writes fit in
  their destinations whatever the interleaving, so a promote that the batch makes room
  for never races the demote that makes it.
- ``apply_one(decision) -> Outcome``: one decision, synchronously.
- ``sync()``: group commit, one sync of each write-back tier and one journal fsync for
  everything handled so far (``apply`` does it per batch unless ``sync_each_apply`` is
  off, as serve's executor sink sets it: that sink syncs at each flush, before
  anything is acknowledged; a caller of ``apply_one`` does it before acknowledging).
- ``read(block) -> Buffer | None``: from the fastest tier holding it; a corrupt copy
  is quarantined and reported as a miss (None), never served.
- ``write(block, data, tier)``: store a new block (KV an engine just computed);
  ``store(block, tier, size_bytes)`` does it with a zero payload (an engine stand-in).
- ``locate(block)``, ``capacities()``, ``occupancy()``, ``health()``, ``is_pinned(block)``,
  ``stats()``, ``close()``.

A move (promote or demote) is: journal ``begin`` -> read the source (CRC32C verified)
-> refuse if the destination has no room -> write the destination atomically (temp
name, fsync, verify, rename) -> discard the source -> journal ``done``. A crash
anywhere leaves the block in the source, or in both (recovery finishes the move), or
in the destination; never nowhere. Moves into volatile tiers (memory, GPU) lose the
block on a crash by nature: only durable tiers keep blocks across restarts.

Group commit of block writes (``group_commit_writes``): in ``apply``, the moves of a
stretch into tiers that declare ``Tier.group_commits_writes`` (disk tiers) stop after
writing their destination where no reader sees it (``Tier.stage_write``); once the
stretch's moves have all run, each such tier commits its group at once
(``Tier.commit_staged``: one sync for the group), and only then are the sources
discarded and the decisions journaled ``done``, in the caller's thread. The order per
move is the one above, so recovery is unchanged. A block with a staged move is held by that ``apply``
until its commit: other calls that would change it wait (reads still get the source
copy); ``apply`` calls run one at a time.

Write-back (``Tier.writes_back``, slab tiers): a move out of a volatile tier (host
memory) into such a tier is written with ``write_unsynced`` (visible at once, source
dropped, journaled done) and made durable by ``sync()`` with the journal: a sync
before dropping a volatile source protects nothing a power loss would not take
anyway, and a write torn by one fails its CRC32C (quarantined, never served). Moves
out of durable tiers are group-committed as above.

Recovery on start: each tier rebuilds its index (temp files removed, every block's
CRC32C checked with ``verify_on_recovery``, corrupt blocks quarantined); then moves
the journal shows in flight are finished (block in both tiers: drop the source, once
the destination copy reads through its CRC32C) or rolled back (only in the source, or
the destination torn); any other duplicate keeps its fastest whole copy.

Idempotence: a decision id that was applied or skipped is remembered in the journal
and answered ``duplicate`` forever after (the newest ``max_remembered_ids``).
Capacity: a move or write into a tier without room is refused (``refused_full``); the
executor never picks a victim to make room (the planner alone decides what leaves a
tier, and sends the demotes first). Budgets: ``prefetch_budget_bytes_per_s`` caps promote
traffic into a tier; a promote that would wait past its deadline is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor import protocol
from executor.bandwidth import TokenBucket
from executor.block_ids import BlockId, block_key
from executor.crc import checksum
from executor.decision import Decision
from executor.journal import Journal
from executor.names import TIER_RANK
from executor.protocol import Outcome, OutcomeStatus, TierSpace
from executor.tier import (
    BlockNotFoundError,
    Buffer,
    CorruptBlockError,
    RecoveryReport,
    StagedWrite,
    Tier,
    TierError,
    TierFullError,
)

log = logging.getLogger(__name__)

_NUM_LOCK_STRIPES = 1024
_INLINE_MAX_BYTES = 1 << 20
"""Moves of blocks up to this size between host-memory tiers run in the caller's
thread; larger ones (a CRC pass of many MB) go to the tier's pool, in parallel."""


def wall_clock_ms() -> float:
    return time.time() * 1000.0


@dataclass(frozen=True)
class ExecutorParams:
    state_dir: str | Path | None = None
    """Where the journal lives. None: idempotence and pins last only this process."""
    fsync_journal: bool = True
    """fsync the journal (power-loss safety; a killed process loses nothing either
    way: records reach the kernel as they are written)."""
    group_commit: bool = True
    """With ``fsync_journal``: one fsync per batch (the end of ``apply``, or ``sync()``
    called by whoever acknowledges decisions, e.g. before committing Kafka offsets)
    instead of one per record. Off: one fsync per record (~2 per move)."""
    group_commit_writes: bool = True
    """``apply`` commits a stretch's block writes into directory tiers as one group:
    their files fsynced in parallel, one directory fsync, then the moves journaled done
    (a 64 KiB block demoted to disk: ~0.2 ms instead of ~1 ms on this project's ext4 VM).
    Off: each block file synced on its own, as ``write`` does."""
    progress_interval_s: float = 10.0
    """``apply`` of a long batch logs its progress (decisions done of total, rate)
    every this many seconds; 0: never."""
    max_remembered_ids: int = 1_000_000
    verify_on_recovery: bool = True
    """Read every durable block through its CRC32C at start. Off: only sizes checked
    (faster start on large tiers; corruption is still caught on read)."""
    prefetch_budget_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    """Destination tier -> bytes/s that promotes into it may use."""
    prefetch_burst_bytes: int = 1 << 30
    max_budget_wait_ms: float = 1000.0
    """Longest a promote without a deadline waits for budget before it is skipped."""

    def __post_init__(self) -> None:
        if self.progress_interval_s < 0:
            raise ValueError(f"progress_interval_s must be >= 0, got {self.progress_interval_s}")
        for name, rate in self.prefetch_budget_bytes_per_s.items():
            if name not in TIER_RANK or not rate > 0:
                raise ValueError(
                    f"prefetch budget {name!r}: {rate} (need a tier name and a rate > 0)"
                )


@dataclass
class ExecutorRecovery:
    tiers: list[RecoveryReport]
    moves_finished: list[str] = field(default_factory=list)
    moves_rolled_back: list[str] = field(default_factory=list)
    duplicates_resolved: list[str] = field(default_factory=list)
    moves_lost: list[str] = field(default_factory=list)
    """Pending moves whose block is nowhere (its only copy was in a volatile tier)."""
    num_torn_journal_lines: int = 0
    num_malformed_journal_records: int = 0
    """Journal lines that were not valid records (skipped, copied aside)."""
    moves_ignored: list[str] = field(default_factory=list)
    """Pending moves naming a tier that is not configured (left alone)."""

    @property
    def quarantined(self) -> dict[str, list[str]]:
        return {r.tier: r.quarantined for r in self.tiers if r.quarantined}


@dataclass
class ExecutorStats:
    num_applied: int = 0
    num_skipped: int = 0
    num_failed: int = 0
    num_reads: int = 0
    num_read_misses: int = 0
    num_corrupt_reads: int = 0
    bytes_moved: dict[tuple[str, str], int] = field(default_factory=dict)
    """(from tier, to tier) -> payload bytes moved."""
    num_group_commits: int = 0
    """Groups of staged block writes committed together (``group_commit_writes``): one
    per destination tier per stretch of an ``apply`` that staged any."""
    num_group_committed_writes: int = 0
    """Block writes committed in those groups (the rest were committed one by one)."""


@dataclass(eq=False)
class _StagedMove:
    """A move of ``apply`` stopped after staging its destination write; finished (or
    failed) when the stretch's group commits."""

    decision: Decision
    key: str
    src: str
    dst: str
    write: StagedWrite
    start: float


class Executor(protocol.Executor):
    """The bundled executor of real tiers; implements ``executor.protocol.Executor``."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        params: ExecutorParams | None = None,
        *,
        clock_ms: Callable[[], float] = wall_clock_ms,
    ) -> None:
        """``tiers`` fastest first, one per name. ``clock_ms`` is the clock decisions'
        ``deadline_ms`` are compared with (wall-clock ms by default)."""
        self.params = params if params is not None else ExecutorParams()
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"need at least one tier and distinct names, got {names}")
        if names != sorted(names, key=TIER_RANK.__getitem__):
            raise ValueError(
                f"tiers must be ordered fastest first (hbm, dram, nvme, remote), got {names}"
            )
        self._order: list[str] = names
        self._tiers: dict[str, Tier] = {t.name: t for t in tiers}
        self._clock_ms = clock_ms
        self._zeros: dict[int, tuple[bytes, int]] = {}
        self.sync_each_apply = True
        """With group commit, ``apply`` ends with a journal fsync. A caller that calls
        ``sync()`` itself before acknowledging anything (serve's executor sink, at each
        flush before the source's offsets commit) sets this False: one fsync per flush
        instead of per batch. A power loss can then lose the decisions since the last
        ``sync()``; none was acknowledged, so they are redelivered."""
        self._pools = {
            t.name: ThreadPoolExecutor(
                t.params.num_io_threads, thread_name_prefix=f"kvwarm-{t.name}"
            )
            for t in tiers
        }
        self._inline_tiers = {t.name for t in tiers if not t.blocking_io}
        self._staging_tiers = {t.name for t in tiers if t.group_commits_writes}
        self._writeback_tiers = [t.name for t in tiers if t.writes_back]
        self._stripes = [threading.RLock() for _ in range(_NUM_LOCK_STRIPES)]
        self._apply_lock = threading.Lock()
        self._staged_keys: set[str] = set()
        """Keys with a staged move (``group_commit_writes``): changed by nothing else
        until their group commits. Added and removed under the key's stripe lock."""
        self._staged_done = threading.Condition()
        self._index_lock = threading.Lock()
        self._where: dict[str, str] = {}
        self._lru: dict[str, OrderedDict[str, None]] = {name: OrderedDict() for name in names}
        self._ids_lock = threading.Lock()
        self._inflight_ids: set[str] = set()
        self._budgets = {
            name: TokenBucket(rate, self.params.prefetch_burst_bytes)
            for name, rate in self.params.prefetch_budget_bytes_per_s.items()
            if name in self._tiers
        }
        self._stats = ExecutorStats()
        self._stats_lock = threading.Lock()
        state_dir = self.params.state_dir
        self.journal = Journal(
            Path(state_dir) / "journal.jsonl" if state_dir is not None else None,
            fsync=self.params.fsync_journal,
            group_commit=self.params.group_commit,
            max_ids=self.params.max_remembered_ids,
        )
        self.last_recovery = self._recover()

    # -- queries ------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return list(self._order)

    def tier(self, name: str) -> Tier:
        return self._tiers[name]

    def locate(self, block: BlockId) -> str | None:
        """The tier holding ``block``, or None."""
        return self._where.get(block_key(block))

    def capacities(self) -> dict[str, TierSpace]:
        """Tier -> capacity in bytes (blocks vary in size: no block count)."""
        return {n: TierSpace(None, self._tiers[n].capacity_bytes) for n in self._order}

    def occupancy(self) -> dict[str, TierSpace]:
        """Tier -> blocks and payload bytes held now."""
        with self._index_lock:
            counts = {n: len(self._lru[n]) for n in self._order}
        return {n: TierSpace(counts[n], self._tiers[n].used_bytes) for n in self._order}

    def health(self) -> dict[str, Any]:
        """``status`` "ok", tier names, decisions by outcome, and what recovery found."""
        st = self.stats()
        return {
            "status": "ok",
            "tiers": list(self._order),
            "num_decisions": {"applied": st.num_applied, "skipped": st.num_skipped,
                              "failed": st.num_failed},
            "recovery_quarantined": self.last_recovery.quarantined,
            "recovery_moves_lost": len(self.last_recovery.moves_lost),
        }  # fmt: skip

    def is_pinned(self, block: BlockId) -> bool:
        return block_key(block) in self.journal.pins

    def blocks_in(self, tier: str) -> list[str]:
        """Keys in ``tier``, least recently used first."""
        with self._index_lock:
            return list(self._lru[tier])

    def stats(self) -> ExecutorStats:
        with self._stats_lock:
            s = self._stats
            return ExecutorStats(
                s.num_applied,
                s.num_skipped,
                s.num_failed,
                s.num_reads,
                s.num_read_misses,
                s.num_corrupt_reads,
                dict(s.bytes_moved),
                s.num_group_commits,
                s.num_group_committed_writes,
            )

    # -- data path ------------------------------------------------------------------
    def read(self, block: BlockId) -> Buffer | None:
        """The block's payload, verified; None on a miss (absent, or corrupt: then it
        is quarantined and forgotten)."""
        key = block_key(block)
        with self._lock_for(key):
            where = self._where.get(key)
            result: Buffer | None = None
            if where is not None:
                try:
                    result = self._tiers[where].read(key)
                    self._touch(key, where)
                except CorruptBlockError:
                    self._unindex(key)
                    self._count(num_corrupt_reads=1)
                except BlockNotFoundError:
                    self._unindex(key)
            self._count(num_reads=1, num_read_misses=int(result is None))
            return result

    def write(self, block: BlockId, data: Buffer, tier: str) -> Outcome:
        """Store a new or recomputed block in ``tier`` (refused when it has no room);
        an older copy elsewhere is discarded after the write commits."""
        return self._write(block_key(block), block, data, tier, None)

    def _write(self, key: str, block: BlockId, data: Buffer, tier: str, crc: int | None) -> Outcome:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        start = time.perf_counter()
        with self._locked(key):
            target = self._tiers[tier]
            old = self._where.get(key)
            if old != tier and target.free_bytes < size:
                return self._outcome(
                    "write", "refused_full", f"no room in {tier}", block, old, tier, start
                )
            try:
                target.write(key, data, checksum=crc)
            except TierFullError as exc:
                return self._outcome("write", "refused_full", str(exc), block, old, tier, start)
            except (OSError, TierError) as exc:
                return self._outcome(
                    "write", "failed", f"write to {tier} failed: {exc}", block, old, tier, start
                )
            if old is not None and old != tier:
                self._tiers[old].discard(key)
            self._index(key, tier)
            return self._outcome("write", "applied", "", block, old, tier, start, size)

    def store(self, block: BlockId, tier: str, size_bytes: int) -> Outcome:
        """``write`` a zero payload of ``size_bytes``: an engine stand-in storing the KV
        it just computed (``serve --executor local:``). The payload is one shared
        immutable zero buffer per size, its CRC32C computed once: no allocation, page
        faults or checksum pass per store."""
        zeros = self._zeros.get(size_bytes)
        if zeros is None:
            if len(self._zeros) >= 4:
                self._zeros.clear()
            payload = bytes(size_bytes)
            zeros = self._zeros[size_bytes] = (payload, checksum(payload))
        return self._write(block_key(block), block, zeros[0], tier, zeros[1])

    # -- decisions --------------------------------------------------------------------
    def apply(self, decisions: Sequence[Decision]) -> list[Outcome]:
        """Apply a batch in order; one ``Outcome`` per decision, in input order.

        The batch is cut into stretches whose writes fit in their destinations' free
        bytes even if none of the stretch's moves out of those tiers had run; within a
        stretch, different blocks' moves run in parallel (same block: in order).
        So a promote never runs before the demote the batch put ahead of it to make
        its room."""
        items = list(decisions)
        keys = [block_key(d.block_hash) for d in items]
        outcomes: list[Outcome | _StagedMove | None] = [None] * len(items)
        num_done = [0]
        started = time.perf_counter()
        start = 0
        # One batch at a time: a batch's pool tasks may wait for keys another batch
        # has staged, whose own tasks could then be queued behind them.
        with self._apply_lock:
            while start < len(items):
                end = self._fitting_stretch(items, keys, start)
                self._apply_parallel(items, keys, range(start, end), outcomes, num_done, started)
                start = end
        if self.sync_each_apply:
            # Group commit: one journal fsync (and write-back tier sync) for the batch.
            self.sync()
        return [o for o in outcomes if isinstance(o, Outcome)]

    def sync(self) -> None:
        """Make every decision handled so far durable: the blocks written back into
        ``writes_back`` tiers (one file sync each), then the journal (one fsync; each a
        no-op when nothing is pending). ``apply`` does it per batch; callers of
        ``apply_one`` with ``group_commit`` call it before acknowledging what they
        applied."""
        for name in self._writeback_tiers:
            self._tiers[name].sync()
        self.journal.sync()

    def _fitting_stretch(self, items: list[Decision], keys: list[str], start: int) -> int:
        """End (exclusive) of the longest stretch from ``start`` whose moves fit in
        their destinations whatever their order; a move that does not fit now is a
        stretch of its own."""
        free = {name: self._tiers[name].free_bytes for name in self._order}
        end = start
        while end < len(items):
            d = items[end]
            if d.action in ("promote", "demote") and d.to_tier in free:
                key = keys[end]
                where = self._where.get(key)
                size = (self._tiers[where].size_of(key) or 0) if where else 0
                if free[d.to_tier] < size:
                    # Alone, so that it is refused before what follows makes room.
                    return end if end > start else end + 1
                free[d.to_tier] -= size
            end += 1
        return end

    def _apply_parallel(
        self,
        items: list[Decision],
        keys: list[str],
        span: range,
        outcomes: list[Outcome | _StagedMove | None],
        num_done: list[int],
        started: float,
    ) -> None:
        groups: dict[str, list[int]] = {}
        for i in span:
            groups.setdefault(keys[i], []).append(i)
        group_commit = self.params.group_commit_writes

        def run(indexes: list[int]) -> None:
            for i in indexes:
                # Only a block's last decision in the stretch may stage its move: the
                # ones before it need the block where their move left it.
                stage = group_commit and i == indexes[-1]
                outcomes[i] = self._apply_one(items[i], keys[i], stage=stage)
                num_done[0] += 1  # read only for progress: an approximate count is fine

        futures: list[Future[None]] = []
        inline: list[list[int]] = []
        for key, indexes in groups.items():
            first = items[indexes[0]]
            where = self._where.get(key)
            if self._runs_inline(key, where, items, indexes):
                inline.append(indexes)
                continue
            pool_tier = first.from_tier or where or first.to_tier or self._order[0]
            pool = self._pools.get(pool_tier) or self._pools[self._order[0]]
            futures.append(pool.submit(run, indexes))
        try:
            try:
                # Moves within host memory: here, while the pools do the I/O-bound ones.
                interval_s = self.params.progress_interval_s
                next_log = time.perf_counter() + interval_s
                for indexes in inline:
                    run(indexes)
                    if interval_s and time.perf_counter() >= next_log:
                        self._log_progress(num_done[0], len(items), started)
                        next_log += interval_s
            finally:
                self._wait_with_progress(futures, num_done, len(items), started)
        finally:
            # Before the next stretch, which may need the room these moves free.
            self._commit_staged_moves(outcomes, span)
        for future in futures:
            future.result()

    def _commit_staged_moves(
        self, outcomes: list[Outcome | _StagedMove | None], span: range
    ) -> None:
        """Commit the stretch's staged moves, one group per destination tier, then
        finish each: drop the source, index the block, journal the decision done (or,
        if its write failed, end the move: the block stays in its source)."""
        by_tier: dict[str, list[int]] = {}
        for i in span:
            staged = outcomes[i]
            if isinstance(staged, _StagedMove):
                by_tier.setdefault(staged.dst, []).append(i)
        for dst, indexes in by_tier.items():
            moves = [outcomes[i] for i in indexes]
            assert all(isinstance(m, _StagedMove) for m in moves)
            group: list[_StagedMove] = moves  # type: ignore[assignment]
            try:
                errors = self._tiers[dst].commit_staged([m.write for m in group])
            except Exception as exc:  # the tier reports errors per write; belt and braces
                errors = [exc] * len(group)
            self._count(num_group_commits=1, num_group_committed_writes=len(group))
            for i, move, error in zip(indexes, group, errors, strict=True):
                outcomes[i] = self._finish_staged(move, error)

    def _runs_inline(
        self, key: str, where: str | None, items: list[Decision], indexes: list[int]
    ) -> bool:
        """Whether a block's decisions run in the caller's thread: every tier they
        touch holds blocks in host memory (``Tier.blocking_io`` False) and the block is
        small, so a move costs less than a hand-off to a thread (a skip, e.g. of a block
        that is not cached, touches nothing)."""
        cheap = self._inline_tiers
        if where is not None and (
            where not in cheap or (self._tiers[where].size_of(key) or 0) > _INLINE_MAX_BYTES
        ):
            return False
        for i in indexes:
            d = items[i]
            if d.from_tier is not None and d.from_tier not in cheap:
                return False
            if d.to_tier is not None and d.to_tier not in cheap:
                # A staged move only writes its temp file (page cache): CPU work. Its
                # fsync runs on the tier's sync threads; the group waits at the commit.
                # A move written back (from host memory, as here) is page-cache work too.
                staged = i == indexes[-1] and self.params.group_commit_writes
                if d.to_tier in self._writeback_tiers:
                    continue
                if not (staged and d.to_tier in self._staging_tiers):
                    return False
        return True

    def _wait_with_progress(
        self, futures: list[Future[None]], num_done: list[int], total: int, started: float
    ) -> None:
        interval_s = self.params.progress_interval_s
        if not interval_s:
            wait(futures)
            return
        while True:
            _, pending = wait(futures, timeout=interval_s)
            if not pending:
                return
            self._log_progress(num_done[0], total, started)

    @staticmethod
    def _log_progress(num_done: int, total: int, started: float) -> None:
        elapsed_s = time.perf_counter() - started
        log.info(
            "executor: %d of %d decisions applied in %.0f s (%.0f/s)",
            num_done,
            total,
            elapsed_s,
            num_done / elapsed_s,
        )

    def apply_one(self, decision: Decision) -> Outcome:
        out = self._apply_one(decision, block_key(decision.block_hash), stage=False)
        assert isinstance(out, Outcome)
        return out

    def _apply_one(self, decision: Decision, key: str, *, stage: bool) -> Outcome | _StagedMove:
        """``stage``: a move into a tier with ``group_commits_writes`` stops once its
        write is staged; the caller commits it (``_commit_staged_moves``)."""
        did = decision.decision_id
        start = time.perf_counter()
        with self._ids_lock:
            duplicate = self.journal.is_done(did) or did in self._inflight_ids
            if not duplicate:
                self._inflight_ids.add(did)
        if duplicate:
            self._count_outcome("skipped")
            return self._outcome(
                did, "duplicate", "duplicate decision id", decision.block_hash, None, None, start
            )
        result: Outcome | _StagedMove
        try:
            result = self._apply(decision, key, start, stage)
        except Exception as exc:  # an I/O error must not take the batch down
            result = self._outcome(
                did,
                "failed",
                f"{type(exc).__name__}: {exc}",
                decision.block_hash,
                None,
                None,
                start,
            )
        except BaseException:
            with self._ids_lock:
                self._inflight_ids.discard(did)
            raise
        if isinstance(result, _StagedMove):
            return result  # in flight until its group commits
        return self._conclude(result)

    def _conclude(self, out: Outcome) -> Outcome:
        """A decision's end: journalled done (unless it failed), then out of the
        in-flight set (in that order: a duplicate arriving in between finds one or the
        other, never neither), then counted."""
        did = out.decision_id
        try:
            if out.status != "failed":
                self.journal.decision_done(did, out.status)
        finally:
            with self._ids_lock:
                self._inflight_ids.discard(did)
        self._count_outcome(out.status if out.status in ("applied", "failed") else "skipped")
        return out

    def _apply(self, d: Decision, key: str, start: float, stage: bool) -> Outcome | _StagedMove:
        did, block = d.decision_id, d.block_hash
        if d.deadline_ms is not None and self._clock_ms() > d.deadline_ms:
            return self._outcome(
                did, "expired", "deadline passed", block, d.from_tier, d.to_tier, start
            )
        with self._locked(key):
            where = self._where.get(key)

            def skip(status: OutcomeStatus, reason: str) -> Outcome:
                return self._outcome(did, status, reason, block, where, d.to_tier, start)

            if where is None:
                return skip("missing", "not cached")
            if d.from_tier is not None and d.from_tier != where:
                return skip("stale", f"block is in {where}, not {d.from_tier}")
            pinned = key in self.journal.pins
            if d.action == "pin" or d.action == "unpin":
                if (d.action == "pin") == pinned:
                    return skip("stale", f"already {d.action}ned")
                self.journal.set_pin(key, d.action == "pin")
                return self._outcome(did, "applied", "", block, where, where, start)
            if pinned:
                return skip("refused_pinned", "pinned")
            if d.action == "evict":
                self._tiers[where].discard(key)
                self._unindex(key)
                return self._outcome(did, "applied", "", block, where, None, start)
            assert d.to_tier is not None
            if d.to_tier not in self._tiers:
                return self._outcome(
                    did,
                    "failed",
                    f"tier {d.to_tier} is not configured",
                    block,
                    where,
                    d.to_tier,
                    start,
                )
            if d.to_tier == where:
                return skip("stale", f"already in {where}")
            if (TIER_RANK[d.to_tier] < TIER_RANK[where]) != (d.action == "promote"):
                return skip(
                    "stale", f"block is in {where}; {d.action} to {d.to_tier} does not apply"
                )
            size = self._tiers[where].size_of(key) or 0
            budget = self._budgets.get(d.to_tier) if d.action == "promote" else None
            if budget is not None:
                limit_ms = (
                    d.deadline_ms - self._clock_ms()
                    if d.deadline_ms is not None
                    else self.params.max_budget_wait_ms
                )
                wait_s = budget.reserve(size, max(0.0, limit_ms) / 1000.0)
                if wait_s is None:
                    return skip(
                        "refused_budget", f"prefetch bandwidth budget of {d.to_tier} exhausted"
                    )
                if wait_s > 0:
                    time.sleep(wait_s)
            target = self._tiers[d.to_tier]
            # Out of a volatile tier, a sync before the source is dropped protects
            # nothing a power loss would not take anyway: written back, synced with
            # the journal (``sync``).
            write_back = target.writes_back and not self._tiers[where].durable
            stage = stage and not write_back and target.group_commits_writes
            result = self._move(key, where, d.to_tier, did, stage, write_back)
            if isinstance(result, StagedWrite):
                self._staged_keys.add(key)
                return _StagedMove(d, key, where, d.to_tier, result, start)
            status, reason, moved = result
            return self._outcome(did, status, reason, block, where, d.to_tier, start, moved)

    # -- moves ------------------------------------------------------------------------
    def _move(
        self,
        key: str,
        src: str,
        dst: str,
        move_id: str,
        stage: bool = False,
        write_back: bool = False,
    ) -> tuple[OutcomeStatus, str, int] | StagedWrite:
        """Move one block; the caller holds its stripe lock. Returns (status, reason,
        bytes); with ``stage``, a staged destination write instead of the move's end
        (the caller commits it, then finishes the move with ``_finish_staged``); with
        ``write_back``, the destination written with ``write_unsynced`` (durable at
        the next ``sync``)."""
        if src == dst:
            # Recovery of such a move would drop "the source", the only copy.
            return "stale", f"source and destination are both {src}", 0
        source, target = self._tiers[src], self._tiers[dst]
        self.journal.begin_move(move_id, key, src, dst)
        status: OutcomeStatus = "failed"
        try:
            try:
                data, crc = source.read_with_checksum(key)
            except CorruptBlockError as exc:
                self._unindex(key)
                self._count(num_corrupt_reads=1)
                return "failed", str(exc), 0
            except BlockNotFoundError:
                self._unindex(key)
                return "failed", f"block vanished from {src}", 0
            size = memoryview(data).nbytes
            if target.free_bytes < size:
                # Never a victim of our own choosing: the planner sends the demotes.
                status = "refused_full"
                return status, f"no room in {dst}", 0
            try:
                if stage:
                    staged = target.stage_write(key, data, checksum=crc)
                    status = "applied"  # so far: the move's end comes after the commit
                    return staged
                if write_back:
                    target.write_unsynced(key, data, checksum=crc)
                else:
                    target.write(key, data, checksum=crc)
            except TierFullError as exc:
                status = "refused_full"
                return status, str(exc), 0
            except (OSError, TierError) as exc:
                return "failed", f"write to {dst} failed: {exc}", 0
            self._finish_move(key, src, dst, size)
            status = "applied"
            return status, "", size
        finally:
            # Decisions end their move with their "done" record; a failed one here.
            if status == "failed":
                self.journal.end_move(move_id)

    def _finish_staged(self, move: _StagedMove, error: Exception | None) -> Outcome:
        """End a staged move after its group commit: as ``_move`` and ``_apply_one``
        end an unstaged one. ``error``: its write failed (nothing of it was left)."""
        d, key, src, dst = move.decision, move.key, move.src, move.dst
        size = move.write.size_bytes
        with self._lock_for(key):
            try:
                if error is None:
                    self._finish_move(key, src, dst, size)
                    out = self._outcome(
                        d.decision_id, "applied", "", d.block_hash, src, dst, move.start, size
                    )
                else:
                    self.journal.end_move(d.decision_id)
                    out = self._outcome(
                        d.decision_id,
                        "failed",
                        f"write to {dst} failed: {error}",
                        d.block_hash,
                        src,
                        dst,
                        move.start,
                    )
            finally:
                with self._staged_done:
                    self._staged_keys.discard(key)
                    self._staged_done.notify_all()
        return self._conclude(out)

    def _finish_move(self, key: str, src: str, dst: str, size: int) -> None:
        """The destination copy is committed and verified: only now drop the source,
        index the block where it went, count the bytes. Under the key's stripe lock."""
        self._tiers[src].discard(key)
        self._index(key, dst, old=src)
        with self._stats_lock:
            moved = self._stats.bytes_moved
            moved[(src, dst)] = moved.get((src, dst), 0) + size

    # -- index ------------------------------------------------------------------------
    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Hold ``key``'s stripe lock, once no staged move holds the key (its group
        commit releases it)."""
        lock = self._lock_for(key)
        while True:
            lock.acquire()
            if key not in self._staged_keys:
                break
            lock.release()
            with self._staged_done:
                self._staged_done.wait_for(lambda: key not in self._staged_keys)
        try:
            yield
        finally:
            lock.release()

    def _lock_for(self, key: str) -> threading.RLock:
        # str hashes are cached in the string and fixed for the process: all a stripe needs.
        return self._stripes[hash(key) % _NUM_LOCK_STRIPES]

    def _index(self, key: str, tier: str, old: str | None = None) -> None:
        with self._index_lock:
            previous = self._where.get(key)
            if previous is not None:
                self._lru[previous].pop(key, None)
            self._where[key] = tier
            self._lru[tier][key] = None

    def _unindex(self, key: str) -> None:
        with self._index_lock:
            previous = self._where.pop(key, None)
            if previous is not None:
                self._lru[previous].pop(key, None)

    def _touch(self, key: str, tier: str) -> None:
        with self._index_lock:
            if key in self._lru[tier]:
                self._lru[tier].move_to_end(key)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _count_outcome(self, kind: str) -> None:
        """One decision "applied", "failed" or "skipped" (the per-decision ``_count``)."""
        with self._stats_lock:
            s = self._stats
            if kind == "applied":
                s.num_applied += 1
            elif kind == "failed":
                s.num_failed += 1
            else:
                s.num_skipped += 1

    def _outcome(
        self,
        decision_id: str,
        status: OutcomeStatus,
        reason: str,
        block: BlockId | None,
        src: str | None,
        dst: str | None,
        start: float,
        size: int = 0,
    ) -> Outcome:
        return Outcome(
            decision_id,
            status,
            reason,
            block if isinstance(block, int) else None,
            src,
            dst,
            size,
            (time.perf_counter() - start) * 1000.0,
        )

    # -- recovery ---------------------------------------------------------------------
    def _recover(self) -> ExecutorRecovery:
        reports = [
            tier.recover(verify=self.params.verify_on_recovery)
            if tier.durable
            else RecoveryReport(tier.name, num_blocks=len(tier.block_keys()))
            for tier in self._tiers.values()
        ]
        found: dict[str, list[str]] = {}
        for name in self._order:
            for key in self._tiers[name].block_keys():
                found.setdefault(key, []).append(name)
        recovery = ExecutorRecovery(
            reports,
            num_torn_journal_lines=self.journal.num_torn_lines,
            num_malformed_journal_records=self.journal.num_malformed_records,
        )
        for move in self.journal.pending.values():
            if move.src not in self._tiers or move.dst not in self._tiers:
                # A tier removed from the configuration: nothing here to finish.
                recovery.moves_ignored.append(move.move_id)
                continue
            holders = found.get(move.key, [])
            if move.dst in holders and move.src in holders and not self._whole(move.dst, move.key):
                holders.remove(move.dst)  # its write was cut short: quarantined, keep the source
            if move.dst in holders and move.src in holders:
                self._tiers[move.src].discard(move.key)
                holders.remove(move.src)
                recovery.moves_finished.append(move.move_id)
            elif move.dst in holders:
                recovery.moves_finished.append(move.move_id)
            elif move.src in holders:
                recovery.moves_rolled_back.append(move.move_id)
            elif not holders:
                recovery.moves_lost.append(move.move_id)
        for key, holders in found.items():
            # Without a journal record (journal off, or a write() that replaced a copy
            # elsewhere), keep the fastest whole copy.
            while len(holders) > 1 and not self._whole(holders[0], key):
                holders.pop(0)
            for extra in holders[1:]:
                self._tiers[extra].discard(key)
                recovery.duplicates_resolved.append(f"{key}@{extra}")
            if holders:
                self._index(key, holders[0])
        for key in list(self.journal.pins):
            if key not in self._where:
                self.journal.pins.discard(key)
        self.journal.compact(drop_pending=True)
        return recovery

    def _whole(self, tier: str, key: str) -> bool:
        """Whether ``tier``'s copy of ``key`` reads through its checksum, before
        recovery drops another copy for it (a corrupt one is quarantined). Copies the
        tiers' own recovery verified (``verify_on_recovery``), and volatile ones, are
        taken as whole."""
        if self.params.verify_on_recovery or not self._tiers[tier].durable:
            return True
        try:
            self._tiers[tier].read(key)
        except (CorruptBlockError, BlockNotFoundError):
            return False
        return True

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        for name in self._writeback_tiers:
            try:
                self._tiers[name].sync()
            except OSError as exc:  # what was not synced may be lost on a power loss
                log.warning("tier %s: sync at close failed: %s", name, exc)
        self.journal.close()
        for tier in self._tiers.values():
            tier.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
