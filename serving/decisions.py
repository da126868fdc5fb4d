"""Planner moves -> ``executor.decision.Decision``s -> sinks.

Primitives:

- ``DecisionMaker``: a ``Sidecar`` hook (``(event, moves, now_ms)``). It puts a
  round's moves, one per block (``net_moves``), in an order an executor that refuses
  full tiers can apply (``order_for_room``), turns each ``Move`` into a ``Decision`` and hands the batch to a
  sink. Decision ids are derived
  from (origin, block, action, from tier, to tier), where the origin is the request id
  for a request's moves and ``<last request id>+prefetch`` for the prefetch round that
  follows it, so an event delivered twice (after a crash, before its offset was
  committed) yields the same ids and the executor applies them once.
- Sinks (``DecisionSink``: ``emit(decisions)``, ``flush()``, ``close()``):
  ``JsonlDecisionSink`` (a file, one JSON object a line), ``KafkaDecisionSink`` (from
  ``serving.kafka_io``, built by ``open_sink``), ``ExecutorSink`` (applies each batch to
  an ``executor.protocol.Executor`` and counts outcomes by status), ``FanOutSink``
  (several at once).
  ``flush`` is where delivery is confirmed; the loop calls it before committing the
  source's offsets.

Move kinds and what they become:

=========  ============================================================
demand     promote from_tier -> fastest tier (the request reads it soon)
prefetch   promote (speculative)
demote     demote one tier down
evict      evict from the last tier
bypass     the admission veto: a just-computed block is demoted (or evicted)
           at once instead of being kept in the fastest tier
store      no decision: the engine computes the block and stores it itself;
           an executor sink that stands in for the engine places it
=========  ============================================================
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from executor.decision import Decision
from executor.kvhints import ack_status_of
from executor.kvhints import decision_format as decision_format_named
from executor.names import TIER_NAMES, TIER_RANK
from executor.protocol import Executor, Outcome
from executor.sim.executor import SimulatedExecutor
from features.events import BlocksAccessed
from serving.placement import NOWHERE, Placement
from serving.planner import Move, MoveKind
from serving.settings import Endpoint

log = logging.getLogger(__name__)

ModelInfo = Callable[[], tuple[str, str]]
"""() -> (policy name, model version) of the policy scoring right now."""

# Move kind -> decision action ("" = no decision). bypass/demote to NOWHERE is evict.
_ACTION: dict[MoveKind, str] = {
    "demand": "promote",
    "prefetch": "promote",
    "demote": "demote",
    "bypass": "demote",
    "evict": "evict",
    "store": "",
}


APPLY_HEADROOM_BLOCKS = 1
"""Room, in blocks, an executor's tiers need beyond the planner's capacities. With it,
the moves of any planner round have an order in which each lands in a tier with room
(``order_for_room``); without it, a promote out of a full tier into a full tier whose
victim cascades back into the first has none (each move waits for another)."""


def net_moves(moves: list[Move]) -> list[Move]:
    """One move per block: from where it was before the round to where the round left
    it (a request's block promoted to the fastest tier and demoted again at once
    becomes one promote to where it stays; a block that ends where it started makes
    no move). In the order of each block's first move."""
    if _one_move_a_block(moves):  # the common case
        return list(moves)
    chains: dict[int, list[Move]] = {}
    for m in moves:
        chains.setdefault(m.block, []).append(m)
    out: list[Move] = []
    for block, chain in chains.items():
        if len(chain) == 1:
            out.append(chain[0])
            continue
        src, dst = chain[0].from_tier, chain[-1].to_tier
        if src == dst:
            continue
        kind: MoveKind
        if src == NOWHERE:
            kind = "store"
        elif dst == NOWHERE:
            kind = "evict"
        elif dst < src:
            kind = "prefetch" if any(m.kind == "prefetch" for m in chain) else "demand"
        else:
            kind = "demote"
        out.append(Move(block, src, dst, chain[-1].score, kind))
    return out


_BLOCK_OF = itemgetter(0)

_Shape = tuple[str, str | None, str | None, str, bool, tuple[str, str]]
"""``DecisionMaker._shape``'s answer for one (move kind, from tier, to tier)."""


def _one_move_a_block(moves: list[Move]) -> bool:
    return len(set(map(_BLOCK_OF, moves))) == len(moves)


def order_for_room(
    moves: list[Move], counts_after: Sequence[int], limits: Sequence[int]
) -> list[Move]:
    """``moves`` (one planner round, which left tier ``t`` holding ``counts_after[t]``
    blocks) reordered so that, applied one by one, no tier ever holds more than
    ``limits[t]``: a move waits until its destination has room, a block's moves keep
    their order, and otherwise the planner's order stands (O(moves)).

    For ``net_moves`` (one move per block) and ``limits`` = the planner's capacities +
    ``APPLY_HEADROOM_BLOCKS`` such an order always exists: a tier full at its limit
    that is still to receive a block must, to end within its capacity, still send more
    blocks than it receives, and each of those can go as soon as its own destination
    has room; among full tiers, sends exceed receipts, so some send leaves them. (With
    several moves per block, a tier's sends can wait on blocks that have yet to enter
    it, and that argument fails.) Should no order exist, the moves left go last in the
    planner's order, and the executor refuses those that do not fit."""
    # Counts carry one more slot, for NOWHERE (-1): a move from or to nowhere counts
    # there, unlimited, so the loops below need no test for it.
    count = [*counts_after, 0]
    for _, src, dst, _, _ in moves:  # back to the counts the round started from
        count[dst] -= 1
        count[src] += 1
    unlimited = [*limits, count[-1] + len(moves) + 1]
    ready: deque[Move]
    then: dict[int, Iterator[Move]] = {}
    """Per block that moves more than once: its moves after the first, in order, the
    next one ready once the one before is applied; empty where every block moves once
    (``net_moves``, what the sidecar sends), and the loop then follows no chains."""
    if _one_move_a_block(moves):
        # The common case, none that waits: the planner's order.
        if _fits_in_order(moves, list(count), unlimited):
            return list(moves)
        ready = deque(moves)
    else:
        chains: dict[int, list[Move]] = {}
        for m in moves:
            chains.setdefault(m.block, []).append(m)
        ready = deque(chain[0] for chain in chains.values())
        then = {block: iter(chain[1:]) for block, chain in chains.items() if len(chain) > 1}
    waiting: list[deque[Move]] = [deque() for _ in limits]
    out: list[Move] = []
    append, popleft, requeue = out.append, ready.popleft, ready.append
    while ready:
        m = popleft()
        dst = m[2]
        if dst != NOWHERE and count[dst] >= limits[dst]:
            waiting[dst].append(m)
            continue
        append(m)
        count[dst] += 1
        src = m[1]
        count[src] -= 1
        if src != NOWHERE and waiting[src]:
            requeue(waiting[src].popleft())
        if then and m[0] in then:
            after = next(then[m[0]], None)
            if after is not None:
                requeue(after)
    if len(out) < len(moves):
        placed = {id(m) for m in out}
        out += [m for m in moves if id(m) not in placed]
    return out


def _fits_in_order(moves: list[Move], count: list[int], limits: Sequence[int]) -> bool:
    """Whether ``moves`` applied in their order from ``count`` (blocks per tier, then
    the NOWHERE slot; changed in place) keep every tier within ``limits`` (one more,
    unreachable, for NOWHERE): then ``order_for_room`` keeps it."""
    for _, src, dst, _, _ in moves:
        if count[dst] >= limits[dst]:
            return False
        count[dst] += 1
        count[src] -= 1
    return True


def decision_id(
    origin: str, block: int, action: str, from_tier: str | None, to_tier: str | None
) -> str:
    """A stable id for one decision: the same inputs give the same id in any process.
    (``DecisionMaker.make`` computes the same inline; a test keeps them equal.)"""
    key = f"{origin}\x1f{block}\x1f{action}\x1f{from_tier}\x1f{to_tier}".encode()
    return hashlib.blake2b(key, digest_size=12).hexdigest()


@runtime_checkable
class DecisionSink(Protocol):
    """Where decisions go. ``emit`` may buffer; ``flush`` returns once everything
    emitted so far is delivered (or raises); ``close`` flushes and releases."""

    def emit(self, decisions: Sequence[Decision]) -> Any: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class DecisionMaker:
    """Sidecar hook: moves -> decisions -> ``sink``. Counts by action and tier.

    ``model_info`` names the policy and version that scored (asked once per call, so a
    hot swap shows in the next decisions). ``on_store`` is told about ``store`` moves
    (blocks the engine computes into ``to_tier``); an executor standing in for the
    engine uses it: the decisions before a store are emitted first, so they make its
    room (``split_at_stores=False`` sends one batch per round instead: a sink that
    applies a round atomically, with its stores, needs no split). ``placement`` (the sidecar's) turns on ``net_moves`` and ``order_for_room``
    with limits of its capacities + ``APPLY_HEADROOM_BLOCKS``; without it every move
    is sent, in the planner's order.
    """

    def __init__(
        self,
        tier_names: Sequence[str],
        sink: DecisionSink,
        model_info: ModelInfo,
        *,
        deadline_ms: int = 5_000,
        on_store: Callable[[int, str, int], None] | None = None,
        placement: Placement | None = None,
        split_at_stores: bool = True,
    ) -> None:
        self.tier_names = list(tier_names)
        ranks = [TIER_RANK.get(name, -1) for name in self.tier_names]
        if min(ranks, default=0) < 0 or ranks != sorted(set(ranks)):
            # ``make`` builds decisions unchecked (``Decision.planned``): that is sound
            # only when tier index order is rank order, as the planner assumes.
            raise ValueError(
                f"tiers {self.tier_names} must be distinct, known ({', '.join(TIER_NAMES)}) "
                "and fastest first"
            )
        self.split_at_stores = split_at_stores
        self.sink = sink
        self.model_info = model_info
        self.deadline_ms = deadline_ms
        self.on_store = on_store
        self.placement = placement
        self.num_decisions = 0
        self.by_action_tier: Counter[tuple[str, str]] = Counter()
        """(action, tier) -> decisions; tier is to_tier, or from_tier for evict."""
        self._last_origin = "start"
        self._shapes: dict[tuple[MoveKind, int, int], _Shape] = {}

    def __call__(self, event: BlocksAccessed | None, moves: list[Move], now_ms: int) -> None:
        if event is not None:
            origin = self._last_origin = event.request_id
        else:  # the prefetch round right after a request, or an idle-time round
            origin = f"{self._last_origin}+prefetch@{now_ms}"
        p = self.placement
        if p is not None and moves:
            counts = [p.count(t) for t in range(p.num_tiers)]
            limits = [c + APPLY_HEADROOM_BLOCKS for c in p.capacities]
            moves = order_for_room(net_moves(moves), counts, limits)
        # One batch per round; with an engine stand-in, one per stretch between stores.
        decisions = self.make(origin, moves, now_ms, emit_before_store=self.split_at_stores)
        if decisions:
            self.sink.emit(decisions)

    def make(
        self, origin: str, moves: list[Move], now_ms: int, *, emit_before_store: bool = False
    ) -> list[Decision]:
        """Decisions for ``moves`` in their order; ``store`` moves go to ``on_store``
        (after the decisions before them are emitted, with ``emit_before_store``) and
        make no decision. Returns the decisions not yet emitted."""
        policy, version = self.model_info()
        deadline = now_ms + self.deadline_ms
        out: list[Decision] = []
        seen: set[str] = set()
        made: dict[tuple[str, str], int] = {}
        planned, isfinite, blake2b = Decision.planned, math.isfinite, hashlib.blake2b
        shapes = self._shapes
        prefix = f"{origin}\x1f"
        for block, src, dst, score, kind in moves:
            shape = shapes.get((kind, src, dst))
            if shape is None:
                shape = shapes[kind, src, dst] = self._shape(kind, src, dst)
            action, from_tier, to_tier, suffix, sound, where = shape
            if not action:
                if self.on_store is not None and to_tier is not None:
                    if emit_before_store and out:
                        self.sink.emit(out)
                        out = []
                    self.on_store(block, to_tier, now_ms)
                continue
            # decision_id, inline (one call less per decision).
            did = blake2b(f"{prefix}{block}{suffix}".encode(), digest_size=12).hexdigest()
            if did in seen:  # the same move twice in one round: keep ids unique
                did = decision_id(f"{origin}#{len(seen)}", block, action, from_tier, to_tier)
            seen.add(did)
            score = float(score)
            # What the planner makes is valid by construction (see ``Decision.planned``);
            # anything else goes through the checking constructor, which says what.
            build = planned if sound and isfinite(score) else Decision
            out.append(
                build(
                    did,
                    now_ms,
                    block,
                    action,  # type: ignore[arg-type]
                    from_tier,
                    to_tier,
                    score,
                    policy,
                    version,
                    deadline,
                )
            )
            made[where] = made.get(where, 0) + 1
        self.by_action_tier.update(made)
        self.num_decisions += sum(made.values())
        return out

    def _shape(self, kind: MoveKind, src: int, dst: int) -> _Shape:
        """What a move of ``kind`` from tier ``src`` to ``dst`` becomes, whatever its
        block: (action, or "" for none; from and to tier names; the decision id's text
        after the block; whether the planner's invariants hold for it, so that
        ``Decision.planned`` may build it; the (action, tier) it counts under)."""
        names = self.tier_names
        action = _ACTION[kind]
        to_tier = names[dst] if dst != NOWHERE else None
        from_tier = names[src] if src != NOWHERE else None
        if action and to_tier is None:
            action = "evict"
        if action == "promote":
            sound = src != NOWHERE and dst < src
        elif action == "demote":
            sound = src != NOWHERE and dst > src
        else:  # evict: to nowhere
            sound = True
        suffix = f"\x1f{action}\x1f{from_tier}\x1f{to_tier}"
        return action, from_tier, to_tier, suffix, sound, (action, to_tier or from_tier or "")


# -- sinks ---------------------------------------------------------------------------------


class JsonlDecisionSink:
    """Decisions appended to a file, one JSON object per line (``decision_format``
    ``native``: a decision a line; ``kvhints``: a hint envelope a line). ``flush`` writes
    the buffer to the OS (and fsyncs when ``fsync``), so a commit after it survives a
    process crash (and, with ``fsync``, a machine crash). A file gives no acks."""

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: bool = False, decision_format: str = "native"
    ) -> None:
        self.format = decision_format_named(decision_format)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._encoder = msgspec.json.Encoder()
        self.fsync = fsync
        self.num_emitted = 0

    def emit(self, decisions: Sequence[Decision]) -> int:
        if self.format.name == "native":
            # Decision is a slots dataclass: msgspec encodes it field by field, in order.
            self._file.write(self._encoder.encode_lines(decisions))
        else:
            self._file.write(b"".join(value + b"\n" for _, value in self.format.records(decisions)))
        self.num_emitted += len(decisions)
        return len(decisions)

    def flush(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


class ExecutorSink:
    """Applies each emitted batch to an executor in this process
    (``executor.protocol.Executor``: the real one or the simulated one, alike) and
    counts outcomes by (action, status). The batch is applied as given: the
    ``DecisionMaker`` ordered it so each move finds room.

    ``place_store(block, tier, now_ms)`` (a ``DecisionMaker`` ``on_store`` hook) stands
    in for the engine storing a block it computed: ``executor.store`` of
    ``block_size_bytes``.
    """

    def __init__(self, executor: Executor, *, block_size_bytes: int = 1) -> None:
        self.executor = executor
        self.block_size_bytes = block_size_bytes
        if getattr(executor, "sync_each_apply", False):
            # ``flush`` syncs before anything is acknowledged: the bundled executor's
            # fsync after every apply would be one per batch instead of one per flush.
            executor.sync_each_apply = False  # type: ignore[attr-defined]
        self.outcomes: Counter[tuple[str, str]] = Counter()
        """(action, status) -> count; action "store" counts engine stores. Statuses are
        ``executor.protocol.OUTCOME_STATUSES``: a bounded label set."""
        self.acks: Counter[str] = Counter()
        """Outcomes in the hint vocabulary (accepted, missing, rejected ...)."""

    def place_store(self, block: int, tier: str, now_ms: int) -> None:
        self._count("store", self.executor.store(block, tier, self.block_size_bytes))

    def emit(self, decisions: Sequence[Decision]) -> int:
        for d, outcome in zip(decisions, self.executor.apply(decisions), strict=True):
            self._count(d.action, outcome)
        return len(decisions)

    def _count(self, action: str, outcome: Outcome) -> None:
        self.outcomes[(action, outcome.status)] += 1
        self.acks[ack_status_of(outcome.status, outcome.reason)] += 1
        if outcome.status == "failed":
            log.warning(
                "executor: %s of block %s failed: %s", action, outcome.block_hash, outcome.reason
            )

    def flush(self) -> None:
        """``emit`` applied synchronously; the executor makes it durable now (the real
        one: one journal fsync, group commit) before the source's offsets commit."""
        self.executor.sync()

    def close(self) -> None:
        self.executor.close()


class SimulatedExecutorSink(ExecutorSink):
    """``ExecutorSink`` for the simulation (``executor.sim.SimulatedExecutor``), as
    replay drives it: the engine's stores of a round are held and applied together
    with the round's decisions, atomically with respect to capacity
    (``SimulatedExecutor.apply_batch``), and ``emit_at`` books a round at a given
    simulated time (replay's no-prewarm baseline passes the time the engine schedules
    the request)."""

    def __init__(self, executor: SimulatedExecutor) -> None:
        super().__init__(executor, block_size_bytes=executor.block_bytes)
        self.sim = executor
        self._stores: list[tuple[int, str, int]] = []

    def place_store(self, block: int, tier: str, now_ms: int) -> None:
        self._stores.append((block, tier, now_ms))

    def emit(self, decisions: Sequence[Decision]) -> int:
        return self.emit_at(decisions)

    def emit_at(self, decisions: Sequence[Decision], now_ms: float | None = None) -> int:
        """Apply a round (held stores first, then ``decisions``), each booked at
        ``now_ms`` (default: its ``ts_ms``)."""
        stores, self._stores = self._stores, []
        outcomes = self.sim.apply_batch(decisions, stores=stores, now_ms=now_ms)
        for status in self.sim.last_store_statuses:
            self.outcomes[("store", status)] += 1
        for d, outcome in zip(decisions, outcomes, strict=True):
            self._count(d.action, outcome)
        return len(decisions)

    def flush(self) -> None:
        """Stores not yet applied go now."""
        if self._stores:
            self.emit_at([])


class CacheLayerSink:
    """Applies each batch to an executor over a real cache layer (``Executor``
    protocol: ``apply(decisions) -> outcomes``; e.g. ``executor.adapters.lmcache``),
    which the engine fills itself (no ``place_store``). Counts outcomes by (action,
    status) and in the ack vocabulary (``acks``)."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.acks: Counter[str] = Counter()

    def emit(self, decisions: Sequence[Decision]) -> int:
        for d, outcome in zip(decisions, self.executor.apply(decisions), strict=True):
            self.outcomes[(d.action, outcome.status)] += 1
            self.acks[ack_status_of(outcome.status, outcome.reason)] += 1
        return len(decisions)

    def flush(self) -> None:
        """Applied synchronously in ``emit``."""

    def close(self) -> None:
        self.executor.close()


class FanOutSink:
    """Emits to every sink in order; flush and close reach all of them even when one
    raises (the first error is re-raised after)."""

    def __init__(self, sinks: Sequence[DecisionSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, decisions: Sequence[Decision]) -> int:
        for sink in self.sinks:
            sink.emit(decisions)
        return len(decisions)

    def _each(self, what: str, call: Callable[[DecisionSink], None]) -> None:
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                call(sink)
            except Exception as exc:
                log.error("decision sink %s.%s failed: %s", type(sink).__name__, what, exc)
                error = error or exc
        if error is not None:
            raise error

    def flush(self) -> None:
        self._each("flush", lambda sink: sink.flush())

    def close(self) -> None:
        self._each("close", lambda sink: sink.close())


class NullSink:
    """Discards decisions (no executor and no decisions target: metrics only)."""

    def emit(self, decisions: Sequence[Decision]) -> int:
        return len(decisions)

    def flush(self) -> None:
        """Nothing to deliver."""

    def close(self) -> None:
        """Nothing to release."""


def open_sink(
    endpoint: Endpoint,
    *,
    decision_format: str = "native",
    ack_topic: str | None = None,
    **kafka_options: Any,
) -> DecisionSink:
    """A sink for one parsed ``--decisions`` target, writing ``decision_format``
    (``native`` | ``kvhints``). Kafka sinks read acks from ``ack_topic`` when given.
    Kafka is imported only here."""
    if endpoint.scheme == "file":
        return JsonlDecisionSink(endpoint.target, decision_format=decision_format)
    if endpoint.scheme == "kafka":
        from serving.kafka_io import KafkaDecisionSink, ensure_topics

        ensure_topics(endpoint.target, {endpoint.topic: 1, **({ack_topic: 1} if ack_topic else {})})
        return KafkaDecisionSink(
            endpoint.target,
            endpoint.topic,
            decision_format=decision_format,
            ack_topic=ack_topic,
            **kafka_options,
        )
    raise ValueError(f"no decision sink for {endpoint.scheme!r}; use kafka:// or file:")
