"""``SimulatedExecutor``: the tiers of the one simulation, on simulated time.

It keeps where every block is (one tier per block: moves are exclusive, like the real
executor's), when its copy there becomes usable, and per-tier occupancy, and books
every transfer on the timing model of ``executor.sim.timing``. No payloads, no
sleeping, O(1) work per block (O(log parallelism) per transfer). Not thread-safe: one
replay (or one ``serve --executor sim:``) drives one instance.

It never chooses a victim: the planner is the only component that decides what
leaves a tier. A move or store that does not fit is refused (a clear outcome).

Primitives (``now_ms`` is simulated time in ms, float):

- ``apply_batch(decisions, stores=()) -> list[Outcome]``: the planner's decisions
  for one round, plus the blocks the engine computed (``stores``: (block, tier,
  now_ms)), applied atomically with respect to capacity: a batch may swap blocks
  between two full tiers, and capacity holds at the end of every batch. When it
  would not, the latest moves into the over-full tier are refused ("no room") until
  it fits. ``apply(decision)`` is a batch of one. Idempotent by decision id; stale
  decisions (block elsewhere, deadline passed) are answered stale or expired with the reason.
- ``admit_prefetch(from_tier, to_tier, now_ms) -> bool``: the prefetch bandwidth
  budget of both links (the planner asks before it decides a speculative promote;
  a True answer takes the room). Applying a decision never charges it again.
- ``place(block, tier, now_ms=..., computing=False)``: initial contents (no transfer);
  ``computing=True`` marks KV the engine is still computing (not usable until
  ``mark_computed``).
- ``cached_prefix(blocks) -> (first_miss, tiers)``: how far a request's prefix is
  usable (block i's hash depends on blocks 0..i, and engines stop at the first miss)
  and where each of those blocks sits.
- ``prefix_ready_ms(blocks, now_ms)``: when those blocks are all in HBM: blocks
  already there are ready when their copy lands (a promote in flight counts; a
  write-back in flight does not delay a read: the faster copy serves it), blocks
  still below HBM (a promote that was refused) are streamed through at demand.
- ``locate``, ``capacities``, ``occupancy``, ``health``, ``stats``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from executor.decision import Decision
from executor.names import TIER_RANK, check_tier_name
from executor.protocol import Outcome, TierSpace
from executor.sim.clock import SimClock
from executor.sim.profile import Profile, load_profile

Kind = Literal["promote", "demote", "stream"]
KINDS: tuple[str, ...] = ("promote", "demote", "stream")
"""Transfer kinds in the stats: decided moves up or down, and demand reads of a block
streamed to HBM for one request without moving it (its promote was refused)."""
_PROMOTE, _DEMOTE, _STREAM = 0, 1, 2
COMPUTING = math.inf
"""``ready_ms`` of a block whose KV the engine is still computing."""

Store = tuple[Hashable, str, float]
"""(block, tier, now_ms): the engine computed a block and keeps it in that tier."""


class SimulationError(ValueError):
    """A call does not match the simulated state (e.g. moving a block that is not
    cached). ``apply_batch`` never raises it: it reports a refused or stale outcome instead."""


@dataclass(frozen=True)
class SimStats:
    bytes_read: dict[str, dict[str, int]]
    """tier -> kind -> bytes read out of that tier."""
    bytes_written: dict[str, dict[str, int]]
    """tier -> kind -> bytes written into that tier."""
    num_transfers: dict[str, int]
    """kind -> transfers booked."""
    num_refused: int
    """Moves and stores refused for lack of room."""
    num_over_budget: int
    """Speculative promotes the prefetch budget refused (``admit_prefetch``)."""


class SimulatedExecutor:
    def __init__(
        self,
        profile: Profile | None = None,
        *,
        tiers: Sequence[str] | None = None,
        capacity_bytes: Mapping[str, int] | None = None,
        capacity_blocks: Mapping[str, int] | None = None,
        block_size_tokens: int | None = None,
        clock: SimClock | None = None,
    ) -> None:
        """``tiers``: which of the profile's tiers to simulate (default: all of them;
        the first must be ``hbm``). Capacities come from the profile unless given here,
        in bytes or in blocks of ``block_bytes``. ``block_size_tokens`` overrides the
        profile's (a trace hashed in 16-token blocks needs 16)."""
        self.profile = profile if profile is not None else load_profile()
        names = tuple(tiers) if tiers is not None else self.profile.tier_names
        for name in names:
            check_tier_name(name)
            self.profile.tier(name)
        if list(names) != sorted(names, key=TIER_RANK.__getitem__) or len(set(names)) != len(names):
            raise ValueError(f"tiers must be distinct and fastest first, got {names}")
        if names[0] != "hbm":
            raise ValueError("the first simulated tier must be 'hbm' (requests load into it)")
        self.tier_names: tuple[str, ...] = names
        self._index = {name: i for i, name in enumerate(names)}
        self.host_tier: int | None = self._index.get("dram")
        """Index of host memory (the tier named ``dram``), through which synchronous
        retrieves stage storage reads (``host_copy_done_ms``); None without one."""
        self.block_size_tokens = (
            self.profile.model.block_size_tokens if block_size_tokens is None else block_size_tokens
        )
        self.block_bytes = self.profile.model.block_bytes(self.block_size_tokens)
        self.clock = clock if clock is not None else SimClock()
        caps = {name: self.profile.tier(name).capacity_bytes for name in names}
        for source, scale in ((capacity_bytes, 1), (capacity_blocks, self.block_bytes)):
            for name, value in (source or {}).items():
                if name not in caps:
                    raise ValueError(f"capacity given for {name!r}, not one of {names}")
                if value < 0:
                    raise ValueError(f"capacity for {name!r} must be >= 0, got {value}")
                caps[name] = int(value) * scale
        self._cap = [caps[name] for name in names]
        self._channels = [self.profile.tier(name).channels() for name in names]
        n = len(names)
        self._used = [0] * n
        self._members: list[dict[Hashable, None]] = [{} for _ in names]
        self._tier_of: dict[Hashable, int] = {}
        self._ready_ms: dict[Hashable, float] = {}
        self._pinned: set[Hashable] = set()
        self._applied_ids: set[str] = set()
        self._num_outcomes: dict[str, int] = {}
        self.last_store_statuses: list[str] = []
        """Status of each store of the last ``apply_batch`` (applied, refused_full, stale or failed)."""
        self.reset_stats()

    # -- state ----------------------------------------------------------------------
    def reset_stats(self) -> None:
        n = len(self.tier_names)
        self._bytes_read = [[0, 0, 0] for _ in range(n)]
        self._bytes_written = [[0, 0, 0] for _ in range(n)]
        self._num_transfers = [0, 0, 0]
        self._num_refused = 0
        self._num_over_budget = 0

    def locate(self, block: Hashable) -> str | None:
        """The tier holding ``block``, or None."""
        t = self._tier_of.get(block)
        return None if t is None else self.tier_names[t]

    where = locate

    def ready_at_ms(self, block: Hashable) -> float | None:
        """When the block's copy is usable where it is (None when not cached;
        ``COMPUTING`` while the engine computes it)."""
        if block not in self._tier_of:
            return None
        return self._ready_ms.get(block, 0.0)

    def capacities(self) -> dict[str, TierSpace]:
        """Tier -> capacity (blocks and bytes)."""
        return {
            name: TierSpace(cap // self.block_bytes, cap)
            for name, cap in zip(self.tier_names, self._cap, strict=True)
        }

    def occupancy(self) -> dict[str, TierSpace]:
        """Tier -> what it holds (blocks in flight count at their destination)."""
        return {
            name: TierSpace(len(members), used)
            for name, members, used in zip(self.tier_names, self._members, self._used, strict=True)
        }

    def health(self) -> dict[str, object]:
        """Always healthy: nothing here can fail but a caller's bug."""
        return {
            "status": "ok",
            "tiers": list(self.tier_names),
            "blocks": len(self._tier_of),
            "num_decisions": dict(self._num_outcomes),
        }

    def used_bytes(self, tier: str) -> int:
        return self._used[self._tier(tier)]

    def capacity_bytes(self, tier: str) -> int:
        return self._cap[self._tier(tier)]

    def free_bytes(self, tier: str) -> int:
        t = self._tier(tier)
        return self._cap[t] - self._used[t]

    def num_blocks(self, tier: str) -> int:
        return len(self._members[self._tier(tier)])

    def blocks_in(self, tier: str) -> list[Hashable]:
        """Blocks of a tier, in the order they arrived there."""
        return list(self._members[self._tier(tier)])

    def is_pinned(self, block: Hashable) -> bool:
        return block in self._pinned

    def transfer_time_ms(self, size_bytes: int, from_tier: str, to_tier: str) -> float:
        """The model's time for one transfer on idle channels (no queueing)."""
        src = self._channels[self._tier(from_tier)].read
        dst = self._channels[self._tier(to_tier)].write
        return max(src.idle_time_ms(size_bytes), dst.idle_time_ms(size_bytes))

    def stats(self) -> SimStats:
        names = self.tier_names

        def per_tier(rows: list[list[int]]) -> dict[str, dict[str, int]]:
            return {names[t]: dict(zip(KINDS, rows[t], strict=True)) for t in range(len(names))}

        return SimStats(
            bytes_read=per_tier(self._bytes_read),
            bytes_written=per_tier(self._bytes_written),
            num_transfers=dict(zip(KINDS, self._num_transfers, strict=True)),
            num_refused=self._num_refused,
            num_over_budget=self._num_over_budget,
        )

    # -- placement without transfers --------------------------------------------------
    def place(
        self,
        block: Hashable,
        tier: str,
        *,
        now_ms: float | None = None,
        computing: bool = False,
    ) -> bool:
        """Put ``block`` in ``tier`` without booking a transfer (initial contents).
        ``computing``: the engine is computing it; unusable until ``mark_computed``.
        Returns False, changing nothing, when the block is already cached or there is
        no room."""
        t = self._tier(tier)
        if block in self._tier_of:
            return False
        if self._used[t] + self.block_bytes > self._cap[t]:
            self._num_refused += 1
            return False
        now = self.clock.now_ms if now_ms is None else now_ms
        self._add(block, t, COMPUTING if computing else now)
        return True

    def mark_computed(self, blocks: Iterable[Hashable], now_ms: float) -> None:
        """The engine finished computing ``blocks``: copies still marked computing are
        usable from ``now_ms``."""
        ready = self._ready_ms
        for block in blocks:
            if ready.get(block) == COMPUTING:
                ready[block] = now_ms

    def evict(self, block: Hashable, tier: str | None = None) -> bool:
        """Drop ``block`` (only if it is in ``tier``, when given). Pinned blocks stay."""
        t = self._tier_of.get(block)
        if t is None or block in self._pinned:
            return False
        if tier is not None and self._tier(tier) != t:
            return False
        self._remove(block)
        return True

    def pin(self, block: Hashable) -> bool:
        """Keep ``block`` where it is: demote and evict decisions skip it."""
        if block not in self._tier_of:
            return False
        self._pinned.add(block)
        return True

    def unpin(self, block: Hashable) -> bool:
        if block in self._pinned:
            self._pinned.discard(block)
            return True
        return False

    # -- requests -------------------------------------------------------------------
    def cached_prefix(self, blocks: Sequence[Hashable]) -> tuple[int, list[int]]:
        """``(first_miss, tiers)``: the number of leading blocks cached and usable (not
        being computed), and the tier index of each of them."""
        tier_of, ready = self._tier_of, self._ready_ms
        tiers: list[int] = []
        for block in blocks:
            t = tier_of.get(block)
            if t is None or ready.get(block, 0.0) == COMPUTING:
                break
            tiers.append(t)
        return len(tiers), tiers

    def prefix_ready_ms(self, blocks: Iterable[Hashable], now_ms: float) -> float:
        """When every one of ``blocks`` (a request's cached prefix) is in HBM. Blocks
        still below HBM are streamed through for this request (a demand read booked
        now, no placement change)."""
        ready_at = now_ms
        tier_of, ready = self._tier_of, self._ready_ms
        for block in blocks:
            t = tier_of.get(block)
            if t is None:
                raise SimulationError(f"block {block!r} is not cached")
            done = self._book(block, t, 0, now_ms, _STREAM) if t else ready.get(block, 0.0)
            if done > ready_at:
                ready_at = done
        return ready_at

    def host_copy_done_ms(self, num_blocks: int, start_ms: float) -> float:
        """When ``num_blocks`` blocks already in host memory, copied to the GPU
        together from ``start_ms``, have landed: one transfer booked on the host-to-GPU
        link, the read channel of the tier named ``dram`` (which models PCIe). How a
        synchronous retrieve stages storage reads (LMCache: every chunk read into host
        memory, then one batched copy to the GPU). Without a ``dram`` tier there is
        nothing to stage through: ``start_ms``."""
        host = self.host_tier
        if num_blocks <= 0 or host is None:
            return start_ms
        size = num_blocks * self.block_bytes
        done = self._channels[host].read.book(start_ms, size)
        self._bytes_read[host][_STREAM] += size
        self._bytes_written[0][_STREAM] += size
        return done

    # -- transfers --------------------------------------------------------------------
    def admit_prefetch(self, from_tier: int | str, to_tier: int | str, now_ms: float) -> bool:
        """Whether the prefetch budget of the source's read link and the destination's
        write link has room for one block now; True takes that room (the planner's
        ``AdmitFn``: tiers by index or name)."""
        src = from_tier if isinstance(from_tier, int) else self._tier(from_tier)
        dst = to_tier if isinstance(to_tier, int) else self._tier(to_tier)
        read, write = self._channels[src].read, self._channels[dst].write
        size = self.block_bytes
        if not (read.admits_prefetch(now_ms, size) and write.admits_prefetch(now_ms, size)):
            self._num_over_budget += 1
            return False
        read.charge_prefetch(now_ms, size)
        write.charge_prefetch(now_ms, size)
        return True

    def schedule_transfer(
        self, block: Hashable, from_tier: str | None, to_tier: str, now_ms: float
    ) -> float | None:
        """Move ``block`` from ``from_tier`` (None: wherever it is) to ``to_tier`` now;
        returns when it is usable there, None when there is no room.
        Raises ``SimulationError`` when the block is not cached or not at ``from_tier``."""
        t = self._tier_of.get(block)
        if t is None:
            raise SimulationError(f"block {block!r} is not cached; place() it first")
        if from_tier is not None and self._tier(from_tier) != t:
            raise SimulationError(
                f"block {block!r} is in {self.tier_names[t]!r}, not {from_tier!r}"
            )
        dst = self._tier(to_tier)
        self.clock.advance_to(now_ms)
        if dst == t:
            return max(now_ms, self._ready_ms.get(block, 0.0))
        if self._used[dst] + self.block_bytes > self._cap[dst]:
            self._num_refused += 1
            return None
        return self._move(block, t, dst, now_ms)

    # -- the executor.protocol.Executor seam -----------------------------------------
    def apply(self, decisions: Sequence[Decision]) -> list[Outcome]:
        """The protocol's batch: in order, each decision booked at its ``ts_ms`` and
        checked for room as it comes (a batch of one each; ``apply_batch`` is the
        atomic round replay uses)."""
        return [self.apply_batch([d])[0] for d in decisions]

    def apply_one(self, decision: Decision, now_ms: float | None = None) -> Outcome:
        """One decision: a batch of one."""
        return self.apply_batch([decision], now_ms=now_ms)[0]

    def store(self, block: int, tier: str, size_bytes: int) -> Outcome:
        """The engine computed ``block`` into ``tier`` (now, on the simulated clock);
        ``size_bytes`` is ignored: every block is ``block_bytes`` here."""
        self.apply_batch([], stores=[(block, tier, self.clock.now_ms)])
        status = self.last_store_statuses[0]
        reason = "" if status == "applied" else f"{status}: {tier}"
        return Outcome("write", status, reason, block, None, tier, self.block_bytes)  # type: ignore[arg-type]

    def sync(self) -> None:
        """Nothing is kept on disk."""

    def close(self) -> None:
        """Nothing to release."""

    def _outcome(
        self, d: Decision, status: str, reason: str = "", completion_ms: float | None = None
    ) -> Outcome:
        self._num_outcomes[status] = self._num_outcomes.get(status, 0) + 1
        return Outcome(
            d.decision_id,
            status,  # type: ignore[arg-type]
            reason,
            d.block_hash,
            d.from_tier,
            d.to_tier,
            self.block_bytes if d.action in ("promote", "demote") else 0,
            completion_ms=completion_ms,
        )

    def apply_batch(
        self,
        decisions: Sequence[Decision],
        *,
        stores: Sequence[Store] = (),
        now_ms: float | None = None,
    ) -> list[Outcome]:
        """Apply one round of decisions after the engine's ``stores``, atomically with
        respect to capacity (see the module docstring). Each decision is booked at
        ``now_ms`` (default: its ``ts_ms``). Returns one outcome per decision, in order."""
        refused: set[int] = set()
        while True:
            plan, over = self._plan(decisions, stores, refused, now_ms)
            if over is None:
                break
            tier, delta = over
            # Refuse the latest accepted item moving a block into the over-full tier.
            culprit = next(
                (
                    i
                    for i in range(len(plan) - 1, -1, -1)
                    if plan[i][0] == "ok" and plan[i][2] == tier and i not in refused
                ),
                None,
            )
            if culprit is None:  # cannot happen: only inbound items grow a tier
                raise SimulationError(f"tier {self.tier_names[tier]} over capacity by {delta}")
            refused.add(culprit)
        self._num_refused += len(refused)
        outcomes: list[Outcome] = []
        self.last_store_statuses = [
            "applied" if status == "ok" else status for status, _, _ in plan[: len(stores)]
        ]
        for i, (status, reason, dst) in enumerate(plan):
            if i < len(stores):
                block, _, at_ms = stores[i]
                if status == "ok":
                    self._add(block, dst, COMPUTING)
                    self.clock.advance_to(at_ms)
                continue
            d = decisions[i - len(stores)]
            if status != "ok":
                outcomes.append(self._outcome(d, status, reason))
                continue
            outcomes.append(self._carry_out(d, dst, float(d.ts_ms) if now_ms is None else now_ms))
        return outcomes

    # -- internals ----------------------------------------------------------------------
    def _plan(
        self,
        decisions: Sequence[Decision],
        stores: Sequence[Store],
        refused: set[int],
        now_ms: float | None,
    ) -> tuple[list[tuple[str, str, int]], tuple[int, int] | None]:
        """Walk the batch on a virtual copy of the placement: each item's (status,
        reason, destination tier index or -1) and the first tier left over capacity
        (with its excess in bytes), or None when everything fits."""
        where: dict[Hashable, int | None] = {}
        pinned: dict[Hashable, bool] = {}
        seen_ids: set[str] = set()
        delta = [0] * len(self.tier_names)
        size = self.block_bytes
        plan: list[tuple[str, str, int]] = []

        def loc(block: Hashable) -> int | None:
            return where[block] if block in where else self._tier_of.get(block)

        for i, (block, tier, _) in enumerate(stores):
            dst = self._index.get(tier)
            if dst is None:
                plan.append(("failed", f"tier {tier} is not simulated here", -1))
            elif i in refused:
                plan.append(("refused_full", f"no room in {tier}", -1))
            elif loc(block) is not None:
                plan.append(("stale", "already cached", -1))
            else:
                where[block] = dst
                delta[dst] += size
                plan.append(("ok", "", dst))
        for j, d in enumerate(decisions):
            i = j + len(stores)
            block = d.block_hash
            t = loc(block)
            is_pinned = pinned.get(block, block in self._pinned)
            status, reason, dst = "ok", "", -1
            if d.decision_id in self._applied_ids or d.decision_id in seen_ids:
                status, reason = "duplicate", "duplicate decision id"
            elif (
                d.deadline_ms is not None
                and (d.ts_ms if now_ms is None else now_ms) > d.deadline_ms
            ):
                status, reason = "expired", "deadline passed"
            elif d.action == "pin":
                status, reason = ("ok", "") if t is not None else ("missing", "not cached")
                if t is not None:
                    pinned[block] = True
            elif d.action == "unpin":
                status, reason = ("ok", "") if is_pinned else ("stale", "not pinned")
                pinned[block] = False
            elif t is None:
                status, reason = "missing", "not cached"
            elif d.from_tier is not None and d.from_tier != self.tier_names[t]:
                status, reason = "stale", f"block is in {self.tier_names[t]}, not {d.from_tier}"
            elif d.action == "evict":
                if is_pinned:
                    status, reason = "refused_pinned", "pinned"
                else:
                    where[block] = None
                    delta[t] -= size
            elif d.to_tier is None or d.to_tier not in self._index:
                status, reason = "failed", f"tier {d.to_tier} is not simulated here"
            else:
                dst = self._index[d.to_tier]
                if dst == t:
                    status, reason = "stale", "already there"
                elif (dst < t) != (d.action == "promote"):
                    status = "stale"
                    reason = f"block is in {self.tier_names[t]}; {d.action} does not apply"
                elif is_pinned:
                    status, reason = "refused_pinned", "pinned"
                elif i in refused:
                    status, reason = "refused_full", f"no room in {d.to_tier}"
                else:
                    where[block] = dst
                    delta[t] -= size
                    delta[dst] += size
            if status == "ok":
                seen_ids.add(d.decision_id)
            plan.append((status, reason, dst if status == "ok" else -1))
        for t, change in enumerate(delta):
            excess = self._used[t] + change - self._cap[t]
            if change > 0 and excess > 0:
                return plan, (t, excess)
        return plan, None

    def _carry_out(self, d: Decision, dst: int, now: float) -> Outcome:
        block = d.block_hash
        self._applied_ids.add(d.decision_id)
        if d.action == "pin":
            self._pinned.add(block)
            return self._outcome(d, "applied")
        if d.action == "unpin":
            self._pinned.discard(block)
            return self._outcome(d, "applied")
        if d.action == "evict":
            self._remove(block)
            return self._outcome(d, "applied")
        self.clock.advance_to(now)
        src = self._tier_of[block]
        done = self._move(block, src, dst, now)
        return self._outcome(d, "applied", completion_ms=done)

    def _tier(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(
                f"unknown tier {name!r}; this simulation has {self.tier_names}"
            ) from None

    def _book(self, block: Hashable, src: int, dst: int, now_ms: float, kind: int) -> float:
        """Book the source's read and the destination's write; count bytes; no
        placement change. A copy still in flight (or being computed) is read once it
        lands."""
        size = self.block_bytes
        start = self._ready_ms.get(block, 0.0)
        if start < now_ms or start == COMPUTING:
            start = now_ms
        done = self._channels[src].read.book(start, size)
        written = self._channels[dst].write.book(start, size)
        if written > done:
            done = written
        self._bytes_read[src][kind] += size
        self._bytes_written[dst][kind] += size
        self._num_transfers[kind] += 1
        return done

    def _move(self, block: Hashable, src: int, dst: int, now_ms: float) -> float:
        computing = self._ready_ms.get(block, 0.0) == COMPUTING
        promote = dst < src
        done = self._book(block, src, dst, now_ms, _PROMOTE if promote else _DEMOTE)
        del self._members[src][block]
        self._used[src] -= self.block_bytes
        # A promote in flight delays a read of the block until it lands. A write-back
        # (demote) does not: the faster copy serves reads until the slower one is
        # written, so a backlog of write-backs never holds up a request.
        ready = done if promote else max(now_ms, self._ready_ms.get(block, 0.0))
        self._add(block, dst, COMPUTING if computing else ready)
        return done

    def _add(self, block: Hashable, t: int, ready_ms: float) -> None:
        self._members[t][block] = None
        self._used[t] += self.block_bytes
        self._tier_of[block] = t
        self._ready_ms[block] = ready_ms

    def _remove(self, block: Hashable) -> None:
        t = self._tier_of.pop(block)
        del self._members[t][block]
        self._used[t] -= self.block_bytes
        self._ready_ms.pop(block, None)
        self._pinned.discard(block)
