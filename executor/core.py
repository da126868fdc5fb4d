"""``Executor``: holds tiers fastest to slowest, applies ``Decision``s, never loses a block.

Primitives:

- ``Executor(tiers, ExecutorParams(...))``: recovers on construction (see below);
  ``last_recovery`` says what it found.
- ``apply(decisions) -> list[Outcome]``: in parallel across blocks (each move runs in
  the thread pool of the tier it reads from), in order for the same block.
- ``apply_one(decision) -> Outcome``: the same, synchronously.
- ``sync()``: group commit, one journal fsync for everything handled so far (``apply``
  does it per batch; a caller of ``apply_one`` does it before acknowledging).
- ``read(block) -> Buffer | None``: from the fastest tier holding it; a corrupt copy
  is quarantined and reported as a miss (None), never served.
- ``write(block, data, tier)``: store a new block (KV an engine just computed).
- ``locate(block)``, ``is_pinned(block)``, ``stats()``, ``close()``.

A move (promote or demote) is: journal ``begin`` -> read the source (CRC32C verified)
-> make room at the destination if needed -> write the destination atomically (temp
name, fsync, verify, rename) -> discard the source -> journal ``done``. A crash
anywhere leaves the block in the source, or in both (recovery finishes the move), or
in the destination; never nowhere. Moves into volatile tiers (memory, GPU) lose the
block on a crash by nature: only durable tiers keep blocks across restarts.

Recovery on start: each tier rebuilds its index (temp files removed, every block's
CRC32C checked with ``verify_on_recovery``, corrupt blocks quarantined); then moves
the journal shows in flight are finished (block in both tiers: drop the source) or
rolled back (only in the source); any other duplicate keeps its fastest copy.

Idempotence: a decision id that was applied or skipped is remembered in the journal
and answered ``skipped: duplicate decision id`` forever after (the newest
``max_remembered_ids``). Capacity: tiers refuse writes that do not fit; a move into a
full tier first demotes the destination's least recently used unpinned blocks one
tier down (``on_full="demote"``), or is refused (``on_full="refuse"``). Nothing is
ever dropped to make room. Budgets: ``prefetch_budget_bytes_per_s`` caps promote
traffic into a tier; a promote that would wait past its deadline is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from executor.bandwidth import TokenBucket
from executor.block_ids import BlockId, block_key
from executor.decision import Decision
from executor.journal import Journal
from executor.names import TIER_RANK
from executor.tier import (
    BlockNotFoundError,
    Buffer,
    CorruptBlockError,
    RecoveryReport,
    Tier,
    TierError,
    TierFullError,
)

log = logging.getLogger(__name__)

Status = Literal["applied", "skipped", "failed"]
_NUM_LOCK_STRIPES = 1024


def wall_clock_ms() -> float:
    return time.time() * 1000.0


@dataclass(frozen=True)
class ExecutorParams:
    state_dir: str | Path | None = None
    """Where the journal lives. None: idempotence and pins last only this process."""
    on_full: Literal["demote", "refuse"] = "demote"
    """A promote into a full tier demotes its LRU unpinned blocks, or is refused."""
    max_demote_depth: int = 3
    """How many tiers down one move may cascade to make room."""
    fsync_journal: bool = True
    """fsync the journal (power-loss safety; a killed process loses nothing either
    way: records reach the kernel as they are written)."""
    group_commit: bool = True
    """With ``fsync_journal``: one fsync per batch (the end of ``apply``, or ``sync()``
    called by whoever acknowledges decisions, e.g. before committing Kafka offsets)
    instead of one per record. Off: one fsync per record (~2 per move)."""
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
        if self.on_full not in ("demote", "refuse"):
            raise ValueError(f"on_full must be 'demote' or 'refuse', got {self.on_full!r}")
        if self.progress_interval_s < 0:
            raise ValueError(f"progress_interval_s must be >= 0, got {self.progress_interval_s}")
        if self.max_demote_depth < 0:
            raise ValueError("max_demote_depth must be >= 0")
        for name, rate in self.prefetch_budget_bytes_per_s.items():
            if name not in TIER_RANK or not rate > 0:
                raise ValueError(
                    f"prefetch budget {name!r}: {rate} (need a tier name and a rate > 0)"
                )


@dataclass(frozen=True)
class Outcome:
    """What happened to one decision."""

    decision_id: str
    status: Status
    reason: str = ""
    """Why it was skipped or failed (empty when applied)."""
    block_hash: int | None = None
    from_tier: str | None = None
    """Where the block was (for moves: the tier it was read from)."""
    to_tier: str | None = None
    size_bytes: int = 0
    duration_ms: float = 0.0


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


class Executor:
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
        self._pools = {
            t.name: ThreadPoolExecutor(
                t.params.num_io_threads, thread_name_prefix=f"kvwarm-{t.name}"
            )
            for t in tiers
        }
        self._stripes = [threading.RLock() for _ in range(_NUM_LOCK_STRIPES)]
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
        """Store a new or recomputed block in ``tier`` (making room as a promote
        would); an older copy elsewhere is discarded after the write commits."""
        key = block_key(block)
        size = memoryview(data).nbytes
        start = time.perf_counter()
        with self._lock_for(key):
            target = self._tiers[tier]
            old = self._where.get(key)
            if (
                old != tier
                and target.free_bytes < size
                and not self._make_room(tier, size, f"write:{key}", 0, frozenset({key}))
            ):
                return self._outcome(
                    "write", "skipped", f"no room in {tier}", block, old, tier, start
                )
            try:
                target.write(key, data)
            except TierFullError as exc:
                return self._outcome("write", "skipped", str(exc), block, old, tier, start)
            except (OSError, TierError) as exc:
                return self._outcome(
                    "write", "failed", f"write to {tier} failed: {exc}", block, old, tier, start
                )
            if old is not None and old != tier:
                self._tiers[old].discard(key)
            self._index(key, tier)
            return self._outcome("write", "applied", "", block, old, tier, start, size)

    # -- decisions --------------------------------------------------------------------
    def apply(self, decisions: Iterable[Decision]) -> list[Outcome]:
        """Apply decisions in parallel across blocks; decisions for the same block run
        in the order given. Returns one ``Outcome`` per decision, in input order."""
        items = list(decisions)
        groups: dict[str, list[int]] = {}
        for i, decision in enumerate(items):
            groups.setdefault(block_key(decision.block_hash), []).append(i)
        outcomes: list[Outcome | None] = [None] * len(items)
        num_done = [0]

        def run(indexes: list[int]) -> None:
            for i in indexes:
                outcomes[i] = self.apply_one(items[i])
                num_done[0] += 1  # read only for progress: an approximate count is fine

        futures: list[Future[None]] = []
        for key, indexes in groups.items():
            first = items[indexes[0]]
            pool_tier = first.from_tier or self._where.get(key) or first.to_tier or self._order[0]
            pool = self._pools.get(pool_tier) or self._pools[self._order[0]]
            futures.append(pool.submit(run, indexes))
        self._wait_with_progress(futures, num_done, len(items))
        for future in futures:
            future.result()
        # Group commit: one journal fsync for the whole batch.
        self.journal.sync()
        return [o for o in outcomes if o is not None]

    def sync(self) -> None:
        """Make every decision handled so far durable (one journal fsync, a no-op when
        nothing is pending). ``apply`` does it per batch; callers of ``apply_one`` with
        ``group_commit`` call it before acknowledging what they applied."""
        self.journal.sync()

    def _wait_with_progress(
        self, futures: list[Future[None]], num_done: list[int], total: int
    ) -> None:
        interval_s = self.params.progress_interval_s
        if not interval_s:
            wait(futures)
            return
        start = time.perf_counter()
        while True:
            _, pending = wait(futures, timeout=interval_s)
            if not pending:
                return
            elapsed_s = time.perf_counter() - start
            log.info(
                "executor: %d of %d decisions applied in %.0f s (%.0f/s)",
                num_done[0],
                total,
                elapsed_s,
                num_done[0] / elapsed_s,
            )

    def apply_one(self, decision: Decision) -> Outcome:
        did = decision.decision_id
        start = time.perf_counter()
        with self._ids_lock:
            duplicate = self.journal.is_done(did) or did in self._inflight_ids
            if not duplicate:
                self._inflight_ids.add(did)
        if duplicate:
            out = self._outcome(
                did, "skipped", "duplicate decision id", decision.block_hash, None, None, start
            )
            self._count(num_skipped=1)
            return out
        try:
            out = self._apply(decision, start)
        except Exception as exc:  # an I/O error must not take the batch down
            out = self._outcome(
                did,
                "failed",
                f"{type(exc).__name__}: {exc}",
                decision.block_hash,
                None,
                None,
                start,
            )
        finally:
            with self._ids_lock:
                self._inflight_ids.discard(did)
        if out.status != "failed":
            self.journal.decision_done(did, out.status)
        self._count(**{f"num_{out.status}": 1})
        return out

    def _apply(self, d: Decision, start: float) -> Outcome:
        did, block = d.decision_id, d.block_hash
        if d.deadline_ms is not None and self._clock_ms() > d.deadline_ms:
            return self._outcome(
                did, "skipped", "deadline passed", block, d.from_tier, d.to_tier, start
            )
        key = block_key(block)
        with self._lock_for(key):
            where = self._where.get(key)

            def skip(reason: str) -> Outcome:
                return self._outcome(did, "skipped", reason, block, where, d.to_tier, start)

            if where is None:
                return skip("not cached")
            if d.from_tier is not None and d.from_tier != where:
                return skip(f"block is in {where}, not {d.from_tier}")
            pinned = key in self.journal.pins
            if d.action == "pin" or d.action == "unpin":
                if (d.action == "pin") == pinned:
                    return skip(f"already {d.action}ned")
                self.journal.set_pin(key, d.action == "pin")
                return self._outcome(did, "applied", "", block, where, where, start)
            if pinned:
                return skip("pinned")
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
                return skip(f"already in {where}")
            if (TIER_RANK[d.to_tier] < TIER_RANK[where]) != (d.action == "promote"):
                return skip(f"block is in {where}; {d.action} to {d.to_tier} does not apply")
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
                    return skip(f"prefetch bandwidth budget of {d.to_tier} exhausted")
                if wait_s > 0:
                    time.sleep(wait_s)
            status, reason, moved = self._move(key, where, d.to_tier, did, 0)
            return self._outcome(did, status, reason, block, where, d.to_tier, start, moved)

    # -- moves ------------------------------------------------------------------------
    def _move(
        self,
        key: str,
        src: str,
        dst: str,
        move_id: str,
        depth: int,
        moving: frozenset[str] = frozenset(),
    ) -> tuple[Status, str, int]:
        """Move one block; the caller holds its stripe lock. Returns (status, reason, bytes)."""
        if src == dst:
            # Recovery of such a move would drop "the source", the only copy.
            return "skipped", f"source and destination are both {src}", 0
        source, target = self._tiers[src], self._tiers[dst]
        self.journal.begin_move(move_id, key, src, dst)
        status: Status = "failed"
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
                if self.params.on_full == "refuse":
                    status = "skipped"
                    return status, f"no room in {dst} (on_full=refuse)", 0
                if not self._make_room(dst, size, move_id, depth, moving | {key}):
                    status = "skipped"
                    return status, f"no room in {dst}: cannot demote enough unpinned blocks", 0
            try:
                target.write(key, data, checksum=crc)
            except TierFullError as exc:
                status = "skipped"
                return status, str(exc), 0
            except (OSError, TierError) as exc:
                return "failed", f"write to {dst} failed: {exc}", 0
            # The destination copy is committed and verified: only now drop the source.
            source.discard(key)
            self._index(key, dst, old=src)
            with self._stats_lock:
                moved = self._stats.bytes_moved
                moved[(src, dst)] = moved.get((src, dst), 0) + size
            status = "applied"
            return status, "", size
        finally:
            # Decisions end their move with their "done" record; everything else here.
            if status == "failed" or depth > 0:
                self.journal.end_move(move_id)

    def _make_room(
        self, tier: str, size: int, parent_id: str, depth: int, moving: frozenset[str] = frozenset()
    ) -> bool:
        """Demote LRU unpinned blocks of ``tier`` one tier down until ``size`` fits.
        ``moving``: the blocks whose moves asked for this room (the whole cascade);
        they are never picked as victims (the stripe lock is reentrant, so the lock
        alone would not keep a block from being demoted from under its own promote,
        which left an orphan copy the index no longer knew)."""
        rank = self._order.index(tier)
        if depth >= self.params.max_demote_depth or rank + 1 >= len(self._order):
            return False
        lower = self._order[rank + 1]
        target = self._tiers[tier]
        tried: set[str] = set(moving)
        while target.free_bytes < size:
            victim = self._pick_victim(tier, tried)
            if victim is None:
                return False
            tried.add(victim)
            lock = self._lock_for(victim)
            if not lock.acquire(blocking=False):
                continue
            try:
                if self._where.get(victim) != tier or victim in self.journal.pins:
                    continue
                demote_id = f"{parent_id}>demote:{victim}"
                # A victim that cannot move is left where it is; the next one is tried.
                self._move(victim, tier, lower, demote_id, depth + 1, moving | {victim})
            finally:
                lock.release()
        return True

    def _pick_victim(self, tier: str, tried: set[str]) -> str | None:
        pins = self.journal.pins
        with self._index_lock:
            for key in self._lru[tier]:
                if key not in tried and key not in pins:
                    return key
        return None

    # -- index ------------------------------------------------------------------------
    def _lock_for(self, key: str) -> threading.RLock:
        return self._stripes[zlib.crc32(key.encode()) % _NUM_LOCK_STRIPES]

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

    def _outcome(
        self,
        decision_id: str,
        status: Status,
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
            # elsewhere), keep the fastest copy.
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

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self.journal.close()
        for tier in self._tiers.values():
            tier.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
