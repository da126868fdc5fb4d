"""The sidecar loop, clock-agnostic: the same code serves live and replays traces.

Per event, in order:

1. ``policy.observe(event)``: the online feature state learns the access (or, for
   engine residency events, where a block now sits).
2. For a request arrival (``BlocksAccessed``): ``planner.on_request`` pins and
   promotes the request's blocks and makes room, scoring candidates with the policy.
3. Every ``prefetch_interval_ms`` of event time: ``planner.prefetch`` over the
   candidate set (blocks of recent requests that sit below the fastest tier).
4. Moves go to the ``on_moves`` hooks (executor, decision sink, replay accounting).

Candidate generation is bounded: only blocks of the last ``recent_requests`` requests
are prefetch candidates (a ring of chains), and eviction scores a fixed-size sample
of residents; nothing scales with the number of blocks ever seen.

``run(source, ...)`` drives the loop from an ``EventSource`` with at-least-once
semantics: the source's ``commit()`` is called only after the moves of every event
polled so far have been handed to the hooks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import numpy as np

from features.events import AllBlocksCleared, BlockRemoved, BlocksAccessed, BlockStored, Event
from predictor.base import Policy
from serving import defaults
from serving.gc_pacer import GcPacer
from serving.placement import Placement
from serving.planner import AdmitFn, Move, Planner
from serving.prefetch_gate import PrefetchGate
from serving.sources import EventSource

log = logging.getLogger(__name__)

PREDICTED_CANDIDATES = 1_024
"""Most blocks a prefetch round takes from ``Policy.prefetch_candidates``."""

MovesHook = Callable[[BlocksAccessed | None, list[Move], int], None]
"""Called with (the triggering request or None for a prefetch round, moves, now_ms)."""


class StreamHaltError(Exception):
    """Raised by a hook when the stream itself cannot be served (a wrong clock, say),
    not one bad event: ``run`` stops and re-raises instead of dead-lettering the event,
    and commits nothing of the batch in hand."""


LOOP_PHASES = ("poll", "handle", "deliver", "commit")
"""Where ``Sidecar.run``'s time goes, per batch: ``poll`` (the source's poll, waiting for
events included), ``handle`` (the events; with a wall clock, also the prefetch rounds
run while the source is idle), ``deliver`` (the sinks' flush: decisions
delivered), ``commit`` (the source's offsets). The share of wall time outside ``poll``
is how busy the loop is. At a low offered rate a batch holds few events, so its
deliver and commit (a broker round trip each through Kafka) weigh on each event
(``kvwarm bench serve`` prints the split per open-loop run).
"""


@dataclass
class LoopStats:
    events: int = 0
    requests: int = 0
    block_accesses: int = 0
    moves_by_kind: dict[str, int] = field(default_factory=dict)
    score_calls: int = 0
    score_seconds: float = 0.0
    batches: int = 0
    """Polls that returned events (each is handled, delivered and committed as one)."""
    seconds_by_phase: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(LOOP_PHASES, 0.0)
    )
    """Wall time of ``run`` by phase (``LOOP_PHASES``), batches and empty polls alike."""


class Sidecar:
    def __init__(
        self,
        policy: Policy,
        planner: Planner,
        placement: Placement,
        *,
        prefetch_interval_ms: int = defaults.PREFETCH_INTERVAL_MS,
        recent_requests: int = defaults.RECENT_REQUESTS,
        prefetch: bool = True,
        prefetch_levels: int = defaults.PREFETCH_LEVELS,
        allow_future: bool = False,
        prefetch_min_precision: float | None = defaults.PREFETCH_MIN_PRECISION,
        prefetch_split: bool = False,
    ) -> None:
        """``allow_future``: only a replay passes True; it lets a policy that declares
        ``needs_future`` (the oracle) run. ``prefetch_min_precision``: speculative
        prefetch rounds run while their measured precision is at least this
        (``serving.prefetch_gate``); None: always. ``prefetch_split`` (serving): a
        prefetch round's steps (name the candidates, score them, fill each target tier)
        run one per event, so no event carries a whole round; False (replay, the
        default) runs a round inline with the event that starts it."""
        if policy.needs_future and not allow_future:
            raise ValueError(
                f"policy {policy.name!r} needs future knowledge; it can only run in a replay"
            )
        self.policy = policy
        self.planner = planner
        self.placement = placement
        self.prefetch_enabled = prefetch and placement.num_tiers > 1
        self.prefetch_interval_ms = prefetch_interval_ms
        self.prefetch_levels = prefetch_levels
        self.prefetch_admit: AdmitFn | None = None
        """Bandwidth budget check for speculative moves (set by the executor side)."""
        self.recent: deque[tuple[int, ...]] = deque(maxlen=recent_requests)
        self.hooks: list[MovesHook] = []
        # A policy that knows the future (the oracle, replay only) is not gated: the
        # gate guards against mispredictions, and the oracle is the reference.
        self.prefetch_gate: PrefetchGate | None = (
            PrefetchGate(prefetch_min_precision)
            if prefetch_min_precision is not None
            and self.prefetch_enabled
            and not policy.needs_future
            else None
        )
        self.prefetch_split = prefetch_split
        self.stats = LoopStats()
        self._last_prefetch_ms: int | None = None
        self._round: Generator[list[Move], int | None, list[Move]] | None = None
        """The prefetch round under way (``prefetch_split``): its next step runs at the
        next event (or idle tick)."""
        self._lock = threading.Lock()  # policy hot-swap vs the loop

    # -- the per-event step ---------------------------------------------------------

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.policy.score(block_hashes, now_ms)
        self.stats.score_calls += 1
        self.stats.score_seconds += time.perf_counter() - t0
        return out

    def handle(self, event: Event, now_ms: int | None = None) -> list[Move]:
        """Process one event; returns the moves it caused (already given to hooks)."""
        now = event.ts_ms if now_ms is None else now_ms
        with self._lock:
            self.policy.observe(event)
            self.stats.events += 1
            moves: list[Move] = []
            if isinstance(event, BlocksAccessed):
                self.stats.requests += 1
                self.stats.block_accesses += len(event.block_hashes)
                blocks = list(dict.fromkeys(event.block_hashes))
                if self.prefetch_gate is not None:
                    self.prefetch_gate.on_request(blocks)
                moves = self.planner.on_request(
                    self.placement, blocks, self.score, now, self.policy.ranks_by_recency
                )
                self.recent.append(event.block_hashes)
                self._emit(event, moves, now)
            else:
                self._mirror_residency(event)
            self.maybe_prefetch(now)
        return moves

    def maybe_prefetch(self, now_ms: int) -> list[Move]:
        """Start a prefetch round when ``prefetch_interval_ms`` has passed since the last
        one, or (``prefetch_split``) run the next step of the round under way. Returns
        the moves made now (already given to the hooks)."""
        if not self.prefetch_enabled:
            return []
        if self._round is not None:
            return self._step_round(now_ms)
        if (
            self._last_prefetch_ms is not None
            and now_ms - self._last_prefetch_ms < self.prefetch_interval_ms
        ):
            return []
        self._last_prefetch_ms = now_ms
        gate = self.prefetch_gate
        levels = min(self.prefetch_levels, self.placement.num_tiers - 1)
        # Each target tier is gated on the precision of its own prefetches.
        targets = [t for t in range(levels) if gate is None or gate.allow_round(t)]
        if not targets:
            return []
        steps = self._prefetch_round(now_ms, targets)
        if self.prefetch_split:
            self._round = steps
            return self._step_round(now_ms, first=True)
        moves: list[Move] = []  # every step now, back to back, one emit
        try:
            while True:
                moves += next(steps)
        except StopIteration as done:
            moves += done.value
        if moves:
            self._emit(None, moves, now_ms)
        return moves

    def _step_round(self, now_ms: int, *, first: bool = False) -> list[Move]:
        """One step of the round under way, at ``now_ms``; its moves are emitted."""
        assert self._round is not None
        try:
            moves = next(self._round) if first else self._round.send(now_ms)
        except StopIteration as done:
            self._round = None
            moves = done.value
        if moves:
            self._emit(None, moves, now_ms)
        return moves

    def drop_round(self) -> None:
        """Abandon the prefetch round under way (its state belongs to other data: a
        shard switch, say); nothing it decided is undone."""
        self._round = None

    def _prefetch_round(
        self, now_ms: int, targets: list[int]
    ) -> Generator[list[Move], int | None, list[Move]]:
        """The steps of one prefetch round (name the candidates, score them, fill each
        target tier): each but the last yields the moves it made and is sent the time
        of the next one (nothing sent: the time stays, as when the steps run back to
        back, inline); the last returns its moves."""
        # Blocks of recent requests, then what the policy expects back soon beyond them.
        predicted = self.policy.prefetch_candidates(now_ms, PREDICTED_CANDIDATES).tolist()
        recent = dict.fromkeys(
            itertools.chain(itertools.chain.from_iterable(self.recent), predicted)
        )
        candidates = self.placement.placed_below(recent, 0)
        if not candidates:
            return []
        sent = yield []
        now_ms = now_ms if sent is None else sent
        # Score the candidates once per round; every target tier reuses the scores.
        known = dict(
            zip(
                candidates,
                self.score(np.asarray(candidates, dtype=np.uint64), now_ms).tolist(),
                strict=True,
            )
        )

        def score_round(blocks: np.ndarray, at_ms: int) -> np.ndarray:
            keys = blocks.tolist()
            out = np.fromiter(
                (known.get(b, np.nan) for b in keys), dtype=np.float64, count=len(keys)
            )
            missing = np.isnan(out)
            if missing.any():
                out[missing] = self.score(blocks[missing], at_ms)
            return out.astype(np.float32)

        # The fastest tier, small and quick to churn, takes only what the policy
        # predicts when it predicts anything: a recent request's block moved back up
        # there was read before it left again far less often (shared trace, 4,000
        # requests, HBM 1%: 2% of such prefetches against 14% of predicted ones).
        fastest = candidates
        if predicted:
            wanted = set(predicted)
            fastest = [b for b in candidates if b in wanted]
        # Fill each tier from the ones below it, slowest last: a block predicted to
        # return soon climbs as far as it outscores the residents it would displace.
        moves: list[Move] = []
        for target in targets:
            sent = yield moves
            now_ms = now_ms if sent is None else sent
            moves = self.planner.prefetch(
                self.placement,
                fastest if target == 0 else candidates,
                score_round,
                now_ms,
                target,
                self.prefetch_admit,
                self.policy.ranks_by_recency,
            )
        return moves

    def _emit(self, event: BlocksAccessed | None, moves: list[Move], now_ms: int) -> None:
        counts = self.stats.moves_by_kind
        for m in moves:
            counts[m.kind] = counts.get(m.kind, 0) + 1
        if self.prefetch_gate is not None:
            self.prefetch_gate.on_moves(moves)
        for hook in self.hooks:
            hook(event, moves, now_ms)

    def _mirror_residency(self, event: Event) -> None:
        """Engine residency events keep the placement mirror true to what engines hold."""
        names = self.placement.tier_names
        if isinstance(event, BlockStored):
            tier_name = event.tier.value
            if tier_name in names:
                tier = names.index(tier_name)
                for block in event.block_hashes:
                    if self.placement.tier_of(block) != tier:
                        self.placement.move(block, tier, event.ts_ms)
        elif isinstance(event, BlockRemoved):
            tier_name = event.tier.value
            for block in event.block_hashes:
                current = self.placement.tier_of(block)
                if current >= 0 and names[current] == tier_name:
                    self.placement.remove(block)
        elif isinstance(event, AllBlocksCleared):
            for tier in range(self.placement.num_tiers):
                for block in list(self.placement.members(tier)):
                    self.placement.remove(block)

    def swap_policy(self, policy: Policy) -> None:
        """Hot-swap the scorer between two events, without dropping any. The newcomer
        is warmed first (``ModelManager``: it adopts the outgoing policy's state or
        replays recent requests)."""
        with self._lock:
            self.policy = policy

    # -- driving from a source --------------------------------------------------------

    def run(
        self,
        source: EventSource,
        *,
        clock: Callable[[], int] | None = None,
        stop: threading.Event | None = None,
        batch_size: int = 1024,
        poll_timeout_ms: int = 200,
        flush: Callable[[], None] | None = None,
        max_events: int | None = None,
        route: Callable[[int], None] | None = None,
        gc_pacer: GcPacer | None = None,
    ) -> LoopStats:
        """Consume ``source`` until it is exhausted, ``stop`` is set or ``max_events``.

        ``clock`` gives now in ms (wall clock when serving); None uses event time.
        ``flush`` is called before each commit so sinks have delivered the moves.
        ``route(i)`` is called before the ``i``-th event of each polled batch (state kept
        per partition switches its shard in there: ``serving.shards``).
        ``gc_pacer`` (started by the caller) runs full garbage collections between
        batches, at idle moments first (``serving.gc_pacer``).
        """
        stop = stop or threading.Event()
        handled = 0
        phase = self.stats.seconds_by_phase
        clock_s = time.perf_counter
        while not stop.is_set():
            t0 = clock_s()
            events = source.poll(batch_size, poll_timeout_ms)
            t1 = clock_s()
            phase["poll"] += t1 - t0
            for i, event in enumerate(events):
                if stop.is_set():
                    # Shutdown between two events: nothing of this batch is committed,
                    # so the source redelivers it (at least once), and a long batch
                    # never delays a SIGTERM by more than one event.
                    return self.stats
                if route is not None:
                    route(i)
                try:
                    self.handle(event, clock() if clock else None)
                except StreamHaltError:
                    raise  # the stream itself cannot be served: nothing is committed
                except Exception as exc:  # one bad event never stops the stream
                    log.exception("event could not be handled; dead-lettered")
                    source.dead_letter(event, "handler_error", f"{type(exc).__name__}: {exc}")
            handled += len(events)
            t2 = clock_s()
            phase["handle"] += t2 - t1
            if events:
                self.stats.batches += 1
                if flush is not None:
                    flush()
                t3 = clock_s()
                phase["deliver"] += t3 - t2
                source.commit()
                phase["commit"] += clock_s() - t3
            elif clock is not None:
                self.maybe_prefetch(clock())
                phase["handle"] += clock_s() - t2
            if gc_pacer is not None:
                gc_pacer.tick(idle=not events)
            if source.exhausted or (max_events is not None and handled >= max_events):
                break
        return self.stats
