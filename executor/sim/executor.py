"""``SimulatedExecutor``: the block-level executor replay drives, on simulated time.

It keeps where every block is (one tier per block: moves are exclusive, like the real
executor's), when its copy there becomes usable, per-tier capacity and LRU order,
and books every transfer on the timing model of ``executor.sim.timing``. No
payloads, no sleeping, O(1) work per block (O(log parallelism) per transfer). Not
thread-safe: one replay drives one instance.

Replay-facing calls (``now_ms`` is simulated time in ms, float):

- ``place(block, tier, now_ms=..., size_bytes=None) -> bool``: put a block in a tier
  at no transfer cost (initial state, or KV the engine just computed).
- ``evict(block, tier=None) -> bool``: drop it (a pinned block stays).
- ``schedule_transfer(block, from_tier, to_tier, now_ms, kind="prefetch") -> float | None``:
  move it; returns when it is usable at ``to_tier``, or None when refused: no room
  (``on_full="refuse"``, or everything there pinned) or, for ``kind="prefetch"``, the
  prefetch budget of a channel on the way is spent.
- ``load_for_request(blocks, now_ms, num_tokens=None) -> RequestLoad``: bring a
  request's prefix-ordered blocks into HBM (demand transfers from wherever they
  are), recompute the rest, and say when the request's KV is complete.
- ``apply_one(decision, now_ms=None) -> Outcome``: the same ``Decision`` the real
  executor takes (idempotent by decision id, tolerant of stale views).
- The ``executor.protocol.Executor`` seam: ``apply(decisions)`` (each at its
  ``ts_ms``), ``locate``, ``capacities``, ``occupancy``, ``health``, ``store``, ``close``.
  Behind that seam, build it with ``on_full="refuse"``: the planner alone picks victims.
- ``stats() -> SimStats``: bytes moved per tier and kind, hits, misses, prefill.

Modelling choices (each a constructor argument where it is a choice):

- Prefix semantics: a request can use cached blocks only up to its first missing
  block (block i's hash depends on blocks 0..i, and engines stop at the first miss);
  every block after it is recomputed even if a copy sits in some tier.
- ``ready_ms`` = max(time the cached prefix is in HBM, time the compute is free when
  ``serialize_prefill``) + prefill time of the missing tokens. The prefill of the
  missing tokens waits for the cached prefix (its attention reads that KV).
  ``serialize_prefill=True`` queues prefills on the node's one compute resource, so
  queueing delay is part of ``ready_ms``; set it False if replay models queueing.
- Making room (``on_full``): ``"demote"`` moves the least recently used unpinned
  blocks of a full tier one tier down (booked as ``kind="demote"`` traffic, recursively;
  out of the last tier they are dropped); ``"evict"`` drops them; ``"refuse"`` refuses
  the move. Space is freed at booking time, not when the demotion completes.
- A block whose transfer is in flight is already counted at its destination; reading
  it waits until it arrives (a demand for a block being prefetched waits for the
  prefetch, which is how partial prefetch benefit shows up).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from executor.decision import Decision
from executor.names import TIER_RANK, check_tier_name
from executor.protocol import Outcome, OutcomeStatus, TierSpace
from executor.sim.clock import SimClock
from executor.sim.profile import Profile, load_profile

Kind = Literal["demand", "prefetch", "demote"]
KINDS: tuple[str, ...] = ("demand", "prefetch", "demote")
_DEMAND, _PREFETCH, _DEMOTE = 0, 1, 2
OnFull = Literal["demote", "evict", "refuse"]


class SimulationError(ValueError):
    """A call does not match the simulated state (e.g. moving a block that is not
    cached). ``apply`` never raises it: it reports a skipped outcome instead."""


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """What ``load_for_request`` found and when the request's KV is complete in HBM."""

    ready_ms: float
    """All of the request's KV in HBM: cached prefix loaded and the rest prefilled."""
    load_ready_ms: float
    """The cached prefix is in HBM (equals now_ms when nothing had to move)."""
    prefill_start_ms: float
    prefill_ms: float
    num_hit_blocks: tuple[int, ...]
    """Blocks served from cache, per tier in ``tier_names`` order."""
    num_missing_blocks: int
    """Blocks recomputed: not cached, or after the first miss."""
    num_prefill_tokens: int


@dataclass(frozen=True)
class SimStats:
    bytes_read: dict[str, dict[str, int]]
    """tier -> kind -> bytes read out of that tier."""
    bytes_written: dict[str, dict[str, int]]
    """tier -> kind -> bytes written into that tier."""
    num_transfers: dict[str, int]
    """kind -> transfers booked."""
    num_hit_blocks: dict[str, int]
    """tier -> blocks served from there by load_for_request."""
    num_dropped: dict[str, int]
    """tier -> blocks dropped out of the hierarchy to make room."""
    num_refused: int
    """Moves refused for lack of room."""
    num_over_budget: int
    """Prefetches refused by a tier's prefetch budget."""
    num_requests: int
    num_missing_blocks: int
    num_prefill_tokens: int
    prefill_ms: float


class SimulatedExecutor:
    def __init__(
        self,
        profile: Profile | None = None,
        *,
        tiers: Sequence[str] | None = None,
        capacity_bytes: Mapping[str, int] | None = None,
        capacity_blocks: Mapping[str, int] | None = None,
        block_size_tokens: int | None = None,
        on_full: OnFull = "demote",
        serialize_prefill: bool = True,
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
        if on_full not in ("demote", "evict", "refuse"):
            raise ValueError(f"on_full must be demote, evict or refuse, got {on_full!r}")
        self.tier_names: tuple[str, ...] = names
        self._index = {name: i for i, name in enumerate(names)}
        self.block_size_tokens = (
            self.profile.model.block_size_tokens if block_size_tokens is None else block_size_tokens
        )
        self.block_bytes = self.profile.model.block_bytes(self.block_size_tokens)
        self.on_full: OnFull = on_full
        self.serialize_prefill = serialize_prefill
        self.clock = clock if clock is not None else SimClock()
        self._prefill_ms_per_token = 1000.0 / self.profile.model.prefill_tokens_per_s
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
        self._lru: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in names]
        self._tier_of: dict[Hashable, int] = {}
        self._ready_ms: dict[Hashable, float] = {}
        self._sizes: dict[Hashable, int] = {}
        self._pinned: set[Hashable] = set()
        self._busy: set[Hashable] = set()  # blocks being moved or placed right now
        self._applied_ids: set[str] = set()
        self._num_outcomes: dict[str, int] = {}
        self._compute_free_ms = 0.0
        self.reset_stats()

    # -- state ----------------------------------------------------------------------
    def reset_stats(self) -> None:
        n = len(self.tier_names)
        self._bytes_read = [[0, 0, 0] for _ in range(n)]
        self._bytes_written = [[0, 0, 0] for _ in range(n)]
        self._num_transfers = [0, 0, 0]
        self._num_hits = [0] * n
        self._num_dropped = [0] * n
        self._num_refused = 0
        self._num_over_budget = 0
        self._num_requests = 0
        self._num_missing = 0
        self._num_prefill_tokens = 0
        self._prefill_ms_total = 0.0

    def where(self, block: Hashable) -> str | None:
        """The tier holding ``block``, or None."""
        t = self._tier_of.get(block)
        return None if t is None else self.tier_names[t]

    def ready_at_ms(self, block: Hashable) -> float | None:
        """When the block's copy is usable where it is (None when not cached)."""
        if block not in self._tier_of:
            return None
        return self._ready_ms.get(block, 0.0)

    def used_bytes(self, tier: str) -> int:
        return self._used[self._tier(tier)]

    def capacity_bytes(self, tier: str) -> int:
        return self._cap[self._tier(tier)]

    def free_bytes(self, tier: str) -> int:
        t = self._tier(tier)
        return self._cap[t] - self._used[t]

    def num_blocks(self, tier: str) -> int:
        return len(self._lru[self._tier(tier)])

    def blocks_in(self, tier: str) -> list[Hashable]:
        """Blocks of a tier, least recently used first."""
        return list(self._lru[self._tier(tier)])

    def is_pinned(self, block: Hashable) -> bool:
        return block in self._pinned

    def transfer_time_ms(self, size_bytes: int, from_tier: str, to_tier: str) -> float:
        """The model's time for one transfer on idle channels (no queueing)."""
        src = self._channels[self._tier(from_tier)].read
        dst = self._channels[self._tier(to_tier)].write
        return max(src.idle_time_ms(size_bytes), dst.idle_time_ms(size_bytes))

    def prefill_time_ms(self, num_tokens: int) -> float:
        return num_tokens * self._prefill_ms_per_token

    def stats(self) -> SimStats:
        names = self.tier_names

        def per_tier(rows: list[list[int]]) -> dict[str, dict[str, int]]:
            return {names[t]: dict(zip(KINDS, rows[t], strict=True)) for t in range(len(names))}

        return SimStats(
            bytes_read=per_tier(self._bytes_read),
            bytes_written=per_tier(self._bytes_written),
            num_transfers=dict(zip(KINDS, self._num_transfers, strict=True)),
            num_hit_blocks=dict(zip(names, self._num_hits, strict=True)),
            num_dropped=dict(zip(names, self._num_dropped, strict=True)),
            num_refused=self._num_refused,
            num_over_budget=self._num_over_budget,
            num_requests=self._num_requests,
            num_missing_blocks=self._num_missing,
            num_prefill_tokens=self._num_prefill_tokens,
            prefill_ms=self._prefill_ms_total,
        )

    # -- placement ------------------------------------------------------------------
    def place(
        self,
        block: Hashable,
        tier: str,
        *,
        now_ms: float | None = None,
        size_bytes: int | None = None,
    ) -> bool:
        """Put ``block`` in ``tier`` without booking a transfer (initial contents, or
        freshly computed KV). A copy elsewhere is dropped. Returns False when there is
        no room (nothing changes then)."""
        now = self.clock.now_ms if now_ms is None else now_ms
        t = self._tier(tier)
        size = self.block_bytes if size_bytes is None else size_bytes
        return self._place(block, t, size, now)

    def evict(self, block: Hashable, tier: str | None = None) -> bool:
        """Drop ``block`` (only if it is in ``tier``, when given). Pinned blocks stay."""
        t = self._tier_of.get(block)
        if t is None or block in self._pinned:
            return False
        if tier is not None and self._tier(tier) != t:
            return False
        self._remove(block, t)
        return True

    def pin(self, block: Hashable) -> bool:
        """Keep ``block`` where it is: making room never moves it. False if not cached."""
        if block not in self._tier_of:
            return False
        self._pinned.add(block)
        return True

    def unpin(self, block: Hashable) -> bool:
        if block in self._pinned:
            self._pinned.discard(block)
            return True
        return False

    # -- transfers --------------------------------------------------------------------
    def schedule_transfer(
        self,
        block: Hashable,
        from_tier: str | None,
        to_tier: str,
        now_ms: float,
        kind: Kind = "prefetch",
    ) -> float | None:
        """Move ``block`` from ``from_tier`` (None: wherever it is) to ``to_tier``,
        sharing each channel with the transfers already booked. Returns the time the
        block is usable at ``to_tier``; None when refused (no room there, or a
        prefetch over budget).
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
        try:
            k = KINDS.index(kind)
        except ValueError:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}") from None
        return self._move(block, t, dst, now_ms, k)

    def load_for_request(
        self, blocks: Iterable[Hashable], now_ms: float, *, num_tokens: int | None = None
    ) -> RequestLoad:
        """Make a request's KV resident in HBM and say when it is.

        ``blocks`` in prefix order. Cached blocks up to the first missing one are
        brought to HBM by demand transfers; the rest are recomputed (``num_tokens``,
        the prompt length, sets how many tokens that is; default: whole blocks) and
        then stored in HBM, making room per ``on_full``."""
        self.clock.advance_to(now_ms)
        tier_of = self._tier_of
        ready_map = self._ready_ms
        hbm_lru = self._lru[0]
        hits = [0] * len(self.tier_names)
        missing: list[Hashable] = []
        load_ready = now_ms
        for block in blocks:
            t = tier_of.get(block) if not missing else None
            if t is None:
                missing.append(block)
                continue
            if t == 0:
                ready = ready_map.get(block, 0.0)
                hbm_lru.move_to_end(block)
            else:
                moved = self._move(block, t, 0, now_ms, _DEMAND)
                # No room in HBM even after making room: stream it through for this
                # request without keeping it.
                if moved is None:
                    moved = self._book(block, t, 0, now_ms, _DEMAND)
                    assert moved is not None  # demand is never refused by a budget
                ready = moved
            hits[t] += 1
            if ready > load_ready:
                load_ready = ready
        num_hit = sum(hits)
        if num_tokens is None:
            prefill_tokens = len(missing) * self.block_size_tokens
        else:
            prefill_tokens = max(0, num_tokens - num_hit * self.block_size_tokens)
        prefill_ms = prefill_tokens * self._prefill_ms_per_token
        start = load_ready
        if prefill_tokens and self.serialize_prefill:
            if self._compute_free_ms > start:
                start = self._compute_free_ms
            self._compute_free_ms = start + prefill_ms
        ready_ms = start + prefill_ms
        for block in missing:
            self._place(block, 0, self.block_bytes, ready_ms)
        self._num_requests += 1
        for t, count in enumerate(hits):
            self._num_hits[t] += count
        self._num_missing += len(missing)
        self._num_prefill_tokens += prefill_tokens
        self._prefill_ms_total += prefill_ms
        return RequestLoad(
            ready_ms=ready_ms,
            load_ready_ms=load_ready,
            prefill_start_ms=start,
            prefill_ms=prefill_ms,
            num_hit_blocks=tuple(hits),
            num_missing_blocks=len(missing),
            num_prefill_tokens=prefill_tokens,
        )

    def apply_one(self, decision: Decision, now_ms: float | None = None) -> Outcome:
        """Carry out a ``Decision`` at ``now_ms`` (default: its ``ts_ms``). Promotes are
        booked as prefetch traffic, demotes as demote traffic. Never raises for stale
        decisions: they come back with a status and the reason."""
        now = float(decision.ts_ms) if now_ms is None else now_ms
        did = decision.decision_id
        block = decision.block_hash
        t = self._tier_of.get(block)
        where = None if t is None else self.tier_names[t]

        def out(status: OutcomeStatus, reason: str = "", done: float | None = None) -> Outcome:
            if status == "applied":
                self._applied_ids.add(did)
            self._num_outcomes[status] = self._num_outcomes.get(status, 0) + 1
            return Outcome(did, status, reason, block, where, decision.to_tier, 0, 0.0, done)

        if did in self._applied_ids:
            return out("duplicate", "duplicate decision id")
        if decision.deadline_ms is not None and now > decision.deadline_ms:
            return out("expired", "deadline passed")
        if decision.action in ("pin", "unpin"):
            if decision.action == "pin":
                return out("applied") if self.pin(block) else out("missing", "not cached")
            return out("applied") if self.unpin(block) else out("stale", "not pinned")
        if t is None:
            return out("missing", "not cached")
        if decision.from_tier is not None and decision.from_tier != self.tier_names[t]:
            return out("stale", f"block is in {self.tier_names[t]}, not {decision.from_tier}")
        if decision.action == "evict":
            if block in self._pinned:
                return out("refused_pinned", "pinned")
            self._remove(block, t)
            return out("applied")
        assert decision.to_tier is not None
        if decision.to_tier not in self._index:
            return out("failed", f"tier {decision.to_tier} is not simulated here")
        dst = self._index[decision.to_tier]
        if dst == t:
            return out("stale", f"already in {decision.to_tier}")
        if (dst < t) != (decision.action == "promote"):
            return out(
                "stale", f"block is in {self.tier_names[t]}; {decision.action} does not apply"
            )
        if block in self._pinned:
            return out("refused_pinned", "pinned")
        self.clock.advance_to(now)
        over_budget = self._num_over_budget
        done = self._move(
            block, t, dst, now, _PREFETCH if decision.action == "promote" else _DEMOTE
        )
        if done is None:
            if self._num_over_budget > over_budget:
                return out("refused_budget", f"prefetch budget into {decision.to_tier} spent")
            return out("refused_full", f"no room in {decision.to_tier}")
        return out("applied", "", done)

    # -- the executor.protocol.Executor seam ----------------------------------------------
    def apply(self, decisions: Sequence[Decision]) -> list[Outcome]:
        """``apply_one`` each decision at its ``ts_ms``, in order."""
        return [self.apply_one(d) for d in decisions]

    def locate(self, block: Hashable) -> str | None:
        """The tier holding ``block``, or None (``where``)."""
        return self.where(block)

    def capacities(self) -> dict[str, TierSpace]:
        return {
            name: TierSpace(self._cap[t] // self.block_bytes, self._cap[t])
            for t, name in enumerate(self.tier_names)
        }

    def occupancy(self) -> dict[str, TierSpace]:
        return {
            name: TierSpace(len(self._lru[t]), self._used[t])
            for t, name in enumerate(self.tier_names)
        }

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "tiers": list(self.tier_names),
            "num_decisions": dict(self._num_outcomes),
            "simulated_now_ms": self.clock.now_ms,
        }

    def store(self, block: Hashable, tier: str, size_bytes: int) -> Outcome:
        """``place`` a block the engine just computed, at the clock's now."""
        if self.place(block, tier, size_bytes=size_bytes):
            return Outcome("store", "applied", "", None, None, tier, size_bytes)
        return Outcome("store", "refused_full", f"no room in {tier}", None, None, tier)

    def close(self) -> None:
        """Nothing to release."""

    # -- internals ----------------------------------------------------------------------
    def _tier(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(
                f"unknown tier {name!r}; this simulation has {self.tier_names}"
            ) from None

    def _book(self, block: Hashable, src: int, dst: int, now_ms: float, kind: int) -> float | None:
        """Book channels and count bytes; no placement change. None: a prefetch the
        budget refuses."""
        size = self._sizes.get(block, self.block_bytes)
        start = self._ready_ms.get(block, 0.0)
        if start < now_ms:
            start = now_ms
        read, write = self._channels[src].read, self._channels[dst].write
        if kind == _PREFETCH:
            if not (read.admits_prefetch(start, size) and write.admits_prefetch(start, size)):
                self._num_over_budget += 1
                return None
            read.charge_prefetch(start, size)
            write.charge_prefetch(start, size)
        done = read.book(start, size)
        written = write.book(start, size)
        if written > done:
            done = written
        self._bytes_read[src][kind] += size
        self._bytes_written[dst][kind] += size
        self._num_transfers[kind] += 1
        return done

    def _move(self, block: Hashable, src: int, dst: int, now_ms: float, kind: int) -> float | None:
        size = self._sizes.get(block, self.block_bytes)
        if kind == _PREFETCH:
            start = max(now_ms, self._ready_ms.get(block, 0.0))
            read, write = self._channels[src].read, self._channels[dst].write
            if not (read.admits_prefetch(start, size) and write.admits_prefetch(start, size)):
                self._num_over_budget += 1
                return None
        # While room is made (which can cascade down the tiers), this block must not
        # itself be chosen as a victim.
        self._busy.add(block)
        try:
            room = self._make_room(dst, size, now_ms)
        finally:
            self._busy.discard(block)
        if not room:
            self._num_refused += 1
            return None
        done = self._book(block, src, dst, now_ms, kind)
        assert done is not None
        del self._lru[src][block]
        self._used[src] -= size
        self._lru[dst][block] = None
        self._used[dst] += size
        self._tier_of[block] = dst
        self._ready_ms[block] = done
        return done

    def _place(self, block: Hashable, t: int, size: int, ready_ms: float) -> bool:
        old = self._tier_of.get(block)
        if old == t:
            self._lru[t].move_to_end(block)
            return True
        self._busy.add(block)
        try:
            room = self._make_room(t, size, ready_ms)
        finally:
            self._busy.discard(block)
        if not room:
            self._num_refused += 1
            return False
        pinned = block in self._pinned
        if old is not None:
            self._remove(block, old)
            if pinned:
                self._pinned.add(block)
        if size != self.block_bytes:
            self._sizes[block] = size
        self._lru[t][block] = None
        self._used[t] += size
        self._tier_of[block] = t
        self._ready_ms[block] = ready_ms
        return True

    def _remove(self, block: Hashable, t: int) -> None:
        size = self._sizes.pop(block, self.block_bytes)
        del self._lru[t][block]
        self._used[t] -= size
        del self._tier_of[block]
        self._ready_ms.pop(block, None)
        self._pinned.discard(block)

    def _make_room(self, t: int, size: int, now_ms: float) -> bool:
        cap = self._cap[t]
        if self._used[t] + size <= cap:
            return True
        if size > cap or self.on_full == "refuse":
            return False
        lru = self._lru[t]
        pinned = self._pinned
        busy = self._busy
        last = len(self.tier_names) - 1
        while self._used[t] + size > cap:
            victim = None
            for candidate in lru:
                if candidate not in pinned and candidate not in busy:
                    victim = candidate
                    break
            if victim is None:
                return False
            if self.on_full == "demote" and t < last:
                if self._move(victim, t, t + 1, now_ms, _DEMOTE) is None:
                    self._num_dropped[t] += 1
                    self._remove(victim, t)
            else:
                self._num_dropped[t] += 1
                self._remove(victim, t)
        return True
