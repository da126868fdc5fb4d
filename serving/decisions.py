"""Planner moves -> ``executor.decision.Decision``s -> sinks.

Primitives:

- ``DecisionMaker``: a ``Sidecar`` hook (``(event, moves, now_ms)``). It turns each
  ``Move`` into a ``Decision`` and hands the batch to a sink. Decision ids are derived
  from (origin, block, action, from tier, to tier), where the origin is the request id
  for a request's moves and ``<last request id>+prefetch`` for the prefetch round that
  follows it, so an event delivered twice (after a crash, before its offset was
  committed) yields the same ids and the executor applies them once.
- Sinks (``DecisionSink``: ``emit(decisions)``, ``flush()``, ``close()``):
  ``JsonlDecisionSink`` (a file, one JSON object a line), ``KafkaDecisionSink`` (from
  ``serving.kafka_io``, built by ``open_sink``), ``ExecutorSink`` (applies each decision
  to an executor and counts outcomes by status), ``FanOutSink`` (several at once).
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
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from executor.decision import Decision
from features.events import BlocksAccessed
from serving.placement import NOWHERE
from serving.planner import Move
from serving.settings import Endpoint

log = logging.getLogger(__name__)

ModelInfo = Callable[[], tuple[str, str]]
"""() -> (policy name, model version) of the policy scoring right now."""

# Move kind -> decision action ("" = no decision). bypass/demote to NOWHERE is evict.
_ACTION: dict[str, str] = {
    "demand": "promote",
    "prefetch": "promote",
    "demote": "demote",
    "bypass": "demote",
    "evict": "evict",
    "store": "",
}


def decision_id(
    origin: str, block: int, action: str, from_tier: str | None, to_tier: str | None
) -> str:
    """A stable id for one decision: the same inputs give the same id in any process."""
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
    engine uses it.
    """

    def __init__(
        self,
        tier_names: Sequence[str],
        sink: DecisionSink,
        model_info: ModelInfo,
        *,
        deadline_ms: int = 5_000,
        on_store: Callable[[int, str, int], None] | None = None,
    ) -> None:
        self.tier_names = list(tier_names)
        self.sink = sink
        self.model_info = model_info
        self.deadline_ms = deadline_ms
        self.on_store = on_store
        self.num_decisions = 0
        self.by_action_tier: Counter[tuple[str, str]] = Counter()
        """(action, tier) -> decisions; tier is to_tier, or from_tier for evict."""
        self._last_origin = "start"
        self._stored = False

    def __call__(self, event: BlocksAccessed | None, moves: list[Move], now_ms: int) -> None:
        if event is not None:
            origin = self._last_origin = event.request_id
        else:  # the prefetch round right after a request, or an idle-time round
            origin = f"{self._last_origin}+prefetch@{now_ms}"
        decisions = self.make(origin, moves, now_ms)
        if decisions or self._stored:
            self.sink.emit(decisions)
            self._stored = False

    def make(self, origin: str, moves: list[Move], now_ms: int) -> list[Decision]:
        policy, version = self.model_info()
        names = self.tier_names
        deadline = now_ms + self.deadline_ms
        out: list[Decision] = []
        seen: set[str] = set()
        counts = self.by_action_tier
        for m in moves:
            action = _ACTION[m.kind]
            to_tier = names[m.to_tier] if m.to_tier != NOWHERE else None
            if not action:
                if self.on_store is not None and to_tier is not None:
                    self.on_store(m.block, to_tier, now_ms)
                    self._stored = True
                continue
            from_tier = names[m.from_tier] if m.from_tier != NOWHERE else None
            if to_tier is None:
                action = "evict"
            did = decision_id(origin, m.block, action, from_tier, to_tier)
            if did in seen:  # the same move twice in one round: keep ids unique
                did = decision_id(f"{origin}#{len(out)}", m.block, action, from_tier, to_tier)
            seen.add(did)
            out.append(
                Decision(
                    decision_id=did,
                    ts_ms=now_ms,
                    block_hash=m.block,
                    action=action,  # type: ignore[arg-type]
                    from_tier=from_tier,
                    to_tier=to_tier,
                    score=float(m.score),
                    policy=policy,
                    model_version=version,
                    deadline_ms=deadline,
                )
            )
            counts[(action, to_tier or from_tier or "")] += 1
        self.num_decisions += len(out)
        return out


# -- sinks ---------------------------------------------------------------------------------


class JsonlDecisionSink:
    """Decisions appended to a file, one JSON object per line. ``flush`` writes the
    buffer to the OS (and fsyncs when ``fsync``), so a commit after it survives a
    process crash (and, with ``fsync``, a machine crash)."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._encoder = msgspec.json.Encoder()
        self.fsync = fsync
        self.num_emitted = 0

    def emit(self, decisions: Sequence[Decision]) -> int:
        # Decision is a slots dataclass: msgspec encodes it field by field, in order.
        self._file.write(self._encoder.encode_lines(decisions))
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
    """Applies each decision to an executor in this process and counts outcomes by
    (action, status). Works with ``executor.Executor`` (``apply_one``, ``write``) and
    ``executor.sim.SimulatedExecutor`` (``apply``, ``place``).

    ``place_store(block, tier, now_ms)`` stands in for the engine storing a block it
    computed; stores are held and applied with the next ``emit``.

    Order: the planner's moves of one request overfill a tier for a moment (it adds
    the request's blocks, then makes room). Applied in that order, the executor would
    make room by itself (its own LRU choice) and the planner's demotions would then
    find their blocks elsewhere. So ``emit`` applies a move as soon as its destination
    has room, keeping each block's moves in order; what is left when nothing fits (a
    swap between two full tiers) is applied in the planner's order.
    """

    def __init__(self, executor: Any, *, block_size_bytes: int = 1) -> None:
        self.executor = executor
        self.block_size_bytes = block_size_bytes
        self._payload = bytes(block_size_bytes)
        self._stores: list[tuple[int, str, int]] = []
        self.outcomes: Counter[tuple[str, str]] = Counter()
        """(action, status) -> count; action "store" counts engine stores."""
        self.skip_reasons: Counter[str] = Counter()
        self._sim = not hasattr(executor, "apply_one")

    def place_store(self, block: int, tier: str, now_ms: int) -> None:
        self._stores.append((block, tier, now_ms))

    def _has_room(self, tier: str | None) -> bool:
        if tier is None:
            return True
        ex = self.executor
        if self._sim:
            return bool(ex.free_bytes(tier) >= ex.block_bytes)
        return bool(ex.tier(tier).free_bytes >= self.block_size_bytes)

    def _store(self, block: int, tier: str, now_ms: int) -> str:
        if self._sim:
            return "applied" if self.executor.place(block, tier, now_ms=now_ms) else "skipped"
        outcome = self.executor.write(block, self._payload, tier)
        return str(outcome.status)

    def _apply(self, d: Decision) -> None:
        outcome = self.executor.apply(d) if self._sim else self.executor.apply_one(d)
        status = str(getattr(outcome, "status", "applied"))
        self.outcomes[(d.action, status)] += 1
        if status != "applied":
            self.skip_reasons[_reason_kind(getattr(outcome, "reason", ""))] += 1

    def emit(self, decisions: Sequence[Decision]) -> int:
        # Items in planner order: stores come first for their block (NOWHERE -> tier).
        pending: list[tuple[int, str | None, Decision | tuple[int, str, int]]] = [
            (b, t, (b, t, now)) for b, t, now in self._stores
        ]
        pending += [(d.block_hash, d.to_tier, d) for d in decisions]
        self._stores = []
        while pending:
            progressed = False
            blocked: set[int] = set()
            rest: list[tuple[int, str | None, Decision | tuple[int, str, int]]] = []
            for item in pending:
                block, dst, what = item
                if block in blocked or not self._has_room(dst):
                    blocked.add(block)  # its later moves wait for this one
                    rest.append(item)
                    continue
                self._run(what)
                progressed = True
            pending = rest
            if not progressed:  # nothing fits: the rest in planner order
                for _, _, what in pending:
                    self._run(what)
                break
        return len(decisions)

    def _run(self, what: Decision | tuple[int, str, int]) -> None:
        if isinstance(what, Decision):
            self._apply(what)
        else:
            self.outcomes[("store", self._store(*what))] += 1

    def flush(self) -> None:
        """Applied synchronously in ``emit``; stores not yet applied go now, then the
        real executor's journal is synced once (group commit) before the source's
        offsets are committed."""
        if self._stores:
            self.emit([])
        if not self._sim:
            self.executor.sync()

    def close(self) -> None:
        self.flush()
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


def _reason_kind(reason: str) -> str:
    """Outcome reasons carry tier names; keep a bounded label set for metrics."""
    if reason.startswith("block is in"):
        return "stale_view"
    if reason.startswith("no room"):
        return "no_room"
    return reason or "unknown"


class FanOutSink:
    """Emits to every sink in order; flush and close reach all of them even when one
    raises (the first error is re-raised after)."""

    def __init__(self, sinks: Sequence[DecisionSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, decisions: Sequence[Decision]) -> int:
        for sink in self.sinks:
            sink.emit(decisions)
        return len(decisions)

    def _each(self, method: str) -> None:
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                getattr(sink, method)()
            except Exception as exc:
                log.error("decision sink %s.%s failed: %s", type(sink).__name__, method, exc)
                error = error or exc
        if error is not None:
            raise error

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")


class NullSink:
    """Discards decisions (no executor and no decisions target: metrics only)."""

    def emit(self, decisions: Sequence[Decision]) -> int:
        return len(decisions)

    def flush(self) -> None:
        """Nothing to deliver."""

    def close(self) -> None:
        """Nothing to release."""


def open_sink(endpoint: Endpoint, **kafka_options: Any) -> DecisionSink:
    """A sink for one parsed ``--decisions`` target. Kafka is imported only here."""
    if endpoint.scheme == "file":
        return JsonlDecisionSink(endpoint.target)
    if endpoint.scheme == "kafka":
        from serving.kafka_io import KafkaDecisionSink, ensure_topics

        ensure_topics(endpoint.target, {endpoint.topic: 1})
        return KafkaDecisionSink(endpoint.target, endpoint.topic, **kafka_options)
    raise ValueError(f"no decision sink for {endpoint.scheme!r}; use kafka:// or file:")
