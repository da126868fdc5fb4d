"""The planner: scores + placements + tier capacities + budgets -> moves.

One planner for every policy: LRU, LFU, LightGBM, LSTM and the oracle differ only in
the scores they return (higher = needed sooner). The planner never looks inside a
policy.

When it acts:

- ``on_request(placement, blocks, score, now_ms)``: a request arrived that will read
  ``blocks`` (prefix order). Its blocks are pinned: those in a lower tier are promoted
  to the fastest tier now, ahead of prefill (the prewarming window between arrival and
  scheduling); those found nowhere will be computed and stored in the fastest tier.
  Then each over-full tier makes room.
- ``prefetch(placement, candidates, score, now_ms)``: speculative promotion of blocks
  no request has asked for yet, when they outscore the fastest tier's weakest
  residents; bounded by a per-round budget (bandwidth) and hysteresis.

Making room (``_make_room``): sample ``eviction_sample`` residents of the tier (not
pinned), score them together with the blocks just stored, and move the lowest-scored
down one tier (or out, from the last tier). A just-stored block that loses is the
admission veto: it is not kept in that tier (``bypass``). Demoted blocks may overflow
the next tier, which makes room the same way. Sampled eviction is what LRB and Redis
use; it keeps the cost per request independent of the cache size.

Batched eviction (``evict_ahead_visits`` > 0, ``DEFAULT_EVICT_AHEAD_VISITS`` by default,
in the sidecar and in every replay alike; 0: one scored round per request): a round's
sample of residents costs far more than a request's own blocks (each sampled block
belongs to another chain, so the chain blend scores as many chains as rows; on the
shared trace ~1.5 ms a round, most of a learned replay's time), so a scored round can
also queue the next-lowest candidates, about the next ``evict_ahead_visits`` requests'
intake (at most ``evict_ahead_share`` of the tier), and those requests take their
victims off the queue without a round; the tier stays at capacity. A queued block that
was read, moved or left the tier since is skipped (its score is stale); a queue that
runs short or is older than ``4 x evict_ahead_visits`` requests gives way to a new
round. The round samples ``eviction_sample`` residents per request it stands for, so
victims are chosen about as selectively as one round per request would choose them. The
blocks a request stores between rounds face the admission veto at once
(``_veto_against_queue``): scored alone (a call of the request's own blocks, one chain;
blocks demoted from the tier above keep the scores they were demoted with, no call),
against the victims taken off the queue; the lowest of both go, and a spared victim goes
back on the queue.

Measured (LightGBM behind the guard, 8 visits, 1/32; ``kvwarm bench quality
--evict-ahead-visits 8``, seed 0, no peers): the suite's 24 single-tier rows within
-0.0037 .. +0.0015 of one round per request (mean -0.0001; the shared workload at 10%
0.1217 against 0.1254), every peer win kept. (Before the veto ran on the queue path it
waited for the next round, and a one-off block held a queued victim's room until then:
the shared workload at 10% fell to 0.119. Making the blocks stored between rounds the
next victims instead, a probation queue, was measured too: 0.136 / 0.164 at 5% / 10% on
the shared trace, far worse: one round per request admits about a quarter of the blocks
it stores, and those are the ones that count.) Speed: ``kvwarm bench replay`` prints the
learned replay both ways (``lightgbm``, batched, and ``lightgbm b0``).

Exact recency (``by_recency``, when the served policy ranks blocks by recency alone:
LRU, or the guard while it serves LRU): the victims are the tier's least recently
touched residents (``Placement.order``), exactly, instead of the lowest of a sample.
Sampled LRU keeps blocks that exact LRU would drop (a sample of 64 finds the oldest
~1.5%, not the oldest); on the workload suite it trailed exact LRU by up to 0.004 of
hit ratio, so a guard falling back to LRU fell back to something worse than LRU.
Same cost per request: O(overflow) from the front of the order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from serving import defaults
from serving.placement import NOWHERE, Placement

ScoreFn = Callable[[np.ndarray, int], np.ndarray]
"""(block hashes as uint64, now_ms) -> float scores, higher = keep / needed sooner."""

AdmitFn = Callable[[int, int, int], bool]
"""(from tier, to tier, now_ms) -> whether the link's prefetch bandwidth budget has room
for one more block now; a True answer takes that room (the executor's token bucket)."""

DEFAULT_EVICT_AHEAD_VISITS = 8
"""Batched eviction by default, in the sidecar and in every replay (``kvwarm replay``,
``train``'s validation gate, ``kvwarm bench quality``), so what is measured is what is
served. A round queues the victims of about 8 more requests, which then score only the
blocks they store, for the admission veto against those victims. Measured: a learned
sidecar from a file (``kvwarm bench serve``'s workload, 5,000 mixed requests) 1.28-1.33x
the block accesses/s of one round per request, its scoring time 2.4-2.9 s against
4.0-5.1 s; ``kvwarm bench replay`` prints both (``lightgbm`` and ``lightgbm b0``).
``evict_ahead_visits=0`` (``KVWARM_PLANNER__EVICT_AHEAD_VISITS=0``, ``kvwarm replay
--evict-ahead-visits 0``) restores one round per request."""


class PlannerParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    eviction_sample: int = Field(
        defaults.EVICTION_SAMPLE, ge=1, le=4096, description="Residents sampled per eviction round."
    )
    admission: bool = Field(
        True,
        description="Veto keeping a just-computed block in a tier when it scores below every sampled resident.",
    )
    prefetch_budget_blocks: int = Field(
        defaults.PREFETCH_BUDGET_BLOCKS,
        ge=0,
        description="Most speculative promotions per prefetch round (the bandwidth budget).",
    )
    min_residency_ms: int = Field(
        defaults.MIN_RESIDENCY_MS,
        ge=0,
        description="Hysteresis: a block moved less than this long ago is not displaced by a speculative promotion.",
    )
    prefetch_margin: float = Field(
        0.0, ge=0.0, description="A candidate must outscore the resident it displaces by this much."
    )
    exact_recency: bool = Field(
        True,
        description="Evict the least recently touched residents exactly when the served "
        "policy ranks by recency (LRU); False: sample as for any policy.",
    )
    evict_ahead_visits: int = Field(
        DEFAULT_EVICT_AHEAD_VISITS,
        ge=0,
        le=1024,
        description="Batched eviction: a scored round also queues the next-lowest "
        "candidates as the victims of about this many more requests (the tier's mean "
        "intake per request), which take them without a round; the round samples "
        "``eviction_sample`` residents per request it stands for, and the blocks stored in "
        "between face the admission veto against the queued victims at once, scored alone "
        "(see the module docstring). 0: one scoring round per request that overflows the "
        "tier.",
    )
    evict_ahead_share: float = Field(
        1 / 32,
        ge=0.0,
        le=0.5,
        description="At most this share of the tier's capacity is queued ahead.",
    )
    seed: int = Field(0, description="Seed of the eviction sampler (replays repeat exactly).")


MoveKind = Literal["demand", "store", "prefetch", "demote", "evict", "bypass"]
"""Why a block moves: ``demand`` (a request reads it: up to the fastest tier),
``store`` (computed by the engine into a tier), ``prefetch`` (speculative promotion),
``demote`` (one tier down to make room), ``evict`` (out of the last tier), ``bypass``
(a just-computed block the admission veto sends down at once)."""

MOVE_KINDS: tuple[str, ...] = get_args(MoveKind)


class Move(NamedTuple):
    """One placement change. ``from_tier``/``to_tier`` are tier indexes; NOWHERE (-1)
    as ``from_tier`` means computed (not cached), as ``to_tier`` means dropped. A named
    tuple, not a dataclass: a large request makes one per block, and a tuple is built
    several times faster than a frozen dataclass."""

    block: int
    from_tier: int
    to_tier: int
    score: float
    kind: MoveKind


class Planner:
    def __init__(self, params: PlannerParams | None = None) -> None:
        self.params = params or PlannerParams()
        self.rng = np.random.Generator(np.random.PCG64(self.params.seed))
        # Batched eviction (``evict_ahead_visits``), per tier: the victims queued by
        # its last scored round (lowest score last) and their scores, when that round
        # ran and at which request, and the mean intake per request (blocks over
        # capacity). Requests read only the fastest tier in place: the blocks they read
        # since its last round are no longer victims there (their scores are stale); a
        # block read from a lower tier leaves it, which the queue sees.
        self._queue: dict[int, list[int]] = {}
        self._queue_scores: dict[int, list[float]] = {}
        self._round_ms: dict[int, int] = {}
        self._read_since_round: dict[int, None] = {}  # a dict: checkpointable
        self._intake: dict[int, float] = {}
        self._round_request: dict[int, int] = {}
        self._requests = 0

    def on_request(
        self,
        placement: Placement,
        blocks: list[int],
        score: ScoreFn,
        now_ms: int,
        by_recency: bool = False,
    ) -> list[Move]:
        """``by_recency``: the scores rank blocks by recency alone (see the module
        docstring); the planner then evicts by ``Placement.order``. Every block of the
        request ends up most recently touched, in prefix order, as LRU counts them."""
        moves: list[Move] = []
        stored: list[int] = []
        pinned = set(blocks)
        touch = placement.order(0).move_to_end
        run: list[int] = []  # consecutive new blocks, added in bulk (same member order)
        for block, tier in zip(blocks, placement.tiers_of(blocks), strict=True):
            if tier == NOWHERE:
                run.append(block)
                moves.append(Move(block, NOWHERE, 0, 0.0, "store"))
                continue
            if run:
                placement.add_many(run, 0, now_ms)
                stored += run
                run = []
            if tier != 0:
                placement.move(block, 0, now_ms)
                moves.append(Move(block, tier, 0, 0.0, "demand"))
            else:
                touch(block)
        if run:
            placement.add_many(run, 0, now_ms)
            stored += run
        self._requests += 1
        if self._queue.get(0):
            self._read_since_round.update(dict.fromkeys(pinned))
        self._make_room(placement, 0, pinned, stored, score, now_ms, moves, by_recency)
        return moves

    def prefetch(
        self,
        placement: Placement,
        candidates: list[int],
        score: ScoreFn,
        now_ms: int,
        target: int = 0,
        admit: AdmitFn | None = None,
        by_recency: bool = False,
    ) -> list[Move]:
        """Promote the best ``candidates`` sitting below ``target`` into ``target`` while
        they outscore its weakest sampled residents, at most ``prefetch_budget_blocks``
        per round and only as far as ``admit`` (the links' bandwidth budgets) allows."""
        budget = self.params.prefetch_budget_blocks
        if budget <= 0 or not candidates:
            return []
        lower = placement.placed_below(candidates, target)
        if not lower:
            return []
        lower_scores = score(np.asarray(lower, dtype=np.uint64), now_ms)
        order = np.argsort(-lower_scores, kind="stable")[:budget]
        moves: list[Move] = []
        free = placement.capacities[target] - placement.count(target)
        # Residents that may be displaced: not recently moved (hysteresis).
        hold = self.params.min_residency_ms
        residents = placement.sample(target, self.params.eviction_sample + len(order), self.rng)
        if hold:
            residents = [b for b in residents if now_ms - placement.moved_at_ms.get(b, 0) >= hold]
        res_scores = (
            score(np.asarray(residents, dtype=np.uint64), now_ms) if residents else np.zeros(0)
        )
        res_order = list(np.argsort(res_scores, kind="stable"))
        for i in order.tolist():
            block, s = lower[i], float(lower_scores[i])
            if free <= 0:
                if not res_order:
                    break
                j = res_order[0]
                if s <= float(res_scores[j]) + self.params.prefetch_margin:
                    break  # candidates are in descending order: no later one wins either
            src = placement.tier_of(block)
            if admit is not None and not admit(src, target, now_ms):
                continue  # that link's budget is spent; a block from another tier may fit
            if free <= 0:
                res_order.pop(0)
                victim = residents[j]
                self._demote(placement, victim, target, float(res_scores[j]), now_ms, moves)
                free += 1
            placement.move(block, target, now_ms)
            moves.append(Move(block, src, target, s, "prefetch"))
            free -= 1
        # Demotions may have overflowed the tier below.
        if target + 1 < placement.num_tiers:
            self._make_room(placement, target + 1, set(), [], score, now_ms, moves, by_recency)
        return moves

    def _batched(self, placement: Placement, tier: int, over: int) -> tuple[int, int]:
        """(victims to queue beyond the overflow, residents to sample) for a scored
        round of ``tier``: the queue holds about ``evict_ahead_visits`` requests' intake
        (at most ``evict_ahead_share`` of the tier), and the sample is
        ``eviction_sample`` per request the round stands for, as many as per-request
        rounds would have scored, so the victims are as selectively chosen."""
        p = self.params
        if p.evict_ahead_visits == 0 or p.evict_ahead_share == 0:
            return 0, p.eviction_sample
        mean = self._intake.get(tier, float(over))
        ahead = min(
            int(placement.capacities[tier] * p.evict_ahead_share),
            int(p.evict_ahead_visits * mean),
        )
        if ahead < 2 * mean or 2 * (over + ahead) >= placement.count(tier):
            # A queue that would not last two requests (a tier small next to them), or
            # a spill of over half the tier: one round for this request alone.
            return 0, p.eviction_sample
        visits = 1 + ahead / max(mean, 1.0)
        return ahead, int(p.eviction_sample * visits)

    def _take_queued(
        self, placement: Placement, tier: int, over: int, pinned: set[int]
    ) -> tuple[list[int], list[float]] | None:
        """``over`` victims off the front of ``tier``'s queue, skipping blocks that left
        the tier, moved, or were read since the round that queued them; None (and the
        queue dropped) when it holds too few or is older than ``4 x
        evict_ahead_visits`` requests: a scored round is due."""
        p = self.params
        if p.evict_ahead_visits == 0:
            return None
        mean = self._intake.get(tier, float(over))
        self._intake[tier] = mean + 0.1 * (over - mean)
        queue = self._queue.get(tier)
        if not queue:
            return None
        scores = self._queue_scores[tier]
        if self._requests - self._round_request[tier] > 4 * p.evict_ahead_visits:
            queue.clear()
            scores.clear()
            return None
        read = self._read_since_round if tier == 0 else {}
        since = self._round_ms[tier]
        tier_of, moved = placement.tier_of, placement.moved_at_ms
        out: list[int] = []
        out_scores: list[float] = []
        while queue and len(out) < over:
            block, s = queue.pop(), scores.pop()
            if (
                tier_of(block) == tier
                and block not in pinned
                and block not in read
                and moved.get(block, 0) <= since
            ):
                out.append(block)
                out_scores.append(s)
        if len(out) < over:
            queue.clear()
            scores.clear()
            return None
        return out, out_scores

    def _demote(
        self, placement: Placement, block: int, tier: int, s: float, now_ms: int, moves: list[Move]
    ) -> None:
        below = tier + 1
        if below < placement.num_tiers:
            placement.move(block, below, now_ms)
            moves.append(Move(block, tier, below, s, "demote"))
        else:
            placement.remove(block)
            moves.append(Move(block, tier, NOWHERE, s, "evict"))

    def _make_room(
        self,
        placement: Placement,
        tier: int,
        pinned: set[int],
        stored: list[int],
        score: ScoreFn,
        now_ms: int,
        moves: list[Move],
        by_recency: bool = False,
    ) -> None:
        """Bring ``tier`` (and, through the blocks it demotes, every tier below) back to
        capacity. Invariant on return: ``count(t) <= capacities[t]`` for every tier from
        ``tier`` down, whatever the request size.

        Candidates are distinct residents of the tier: a uniform sample that skips the
        request's own (``pinned``) blocks, plus the blocks just stored (``stored``, the
        admission veto). When they number fewer than the overflow (a request larger than
        the tier), the rest of the tier's residents, pinned ones included, join in member
        order: the request itself spills, lowest scores first, ties in candidate order,
        so the outcome is deterministic for a seed. Cost: one scoring call and one sort
        of O(sample + overflow) candidates per tier, i.e. O(n log n) for a request of n
        blocks (no per-candidate rescans).

        ``by_recency`` (and ``exact_recency``): the candidates are the ``over`` least
        recently touched residents outside ``pinned``, then, when those are too few,
        the oldest pinned ones (a request larger than the tier keeps its last blocks,
        as LRU does); all of them go."""
        by_recency = by_recency and self.params.exact_recency
        stored_scores: list[float] | None = None  # known for blocks demoted from above
        while tier < placement.num_tiers:
            over = placement.overflow(tier)
            if over <= 0:
                return
            queued = None if by_recency else self._take_queued(placement, tier, over, pinned)
            if queued is not None:
                # Victims a recent round queued: no round. The blocks this request stored
                # face the admission veto against them at once.
                out, out_scores = queued
                if self.params.admission and stored:
                    out, out_scores = self._veto_against_queue(
                        tier, out, out_scores, stored, stored_scores, score, now_ms
                    )
                else:
                    stored = []
            else:
                out, out_scores = self._round(
                    placement, tier, over, pinned, stored, score, now_ms, by_recency
                )
            placement.remove_many(out, tier)
            below = tier + 1
            kind: MoveKind
            if below < placement.num_tiers:
                placement.add_many(out, below, now_ms)
                kind, to_tier = "demote", below
            else:
                kind, to_tier = "evict", NOWHERE
            # A just-stored block that loses is the admission veto: "bypass".
            stored_set = set(stored)
            moves += [
                Move(b, tier, to_tier, s, "bypass" if b in stored_set else kind)
                for b, s in zip(out, out_scores, strict=True)
            ]
            tier, pinned, stored = below, set(), (out if to_tier != NOWHERE else [])
            stored_scores = out_scores

    def _veto_against_queue(
        self,
        tier: int,
        out: list[int],
        out_scores: list[float],
        stored: list[int],
        stored_scores: list[float] | None,
        score: ScoreFn,
        now_ms: int,
    ) -> tuple[list[int], list[float]]:
        """The admission veto on the queue path: the blocks just stored into ``tier``
        (scored now, or with the scores they were demoted with from the tier above)
        against the victims ``out`` taken off its queue. The ``len(out)`` lowest of both
        go, ties to the queued ones, as a round ranks them; a queued victim spared goes
        back on the queue, still lowest first. One scoring call of the stored blocks
        alone, not a round's sample."""
        if stored_scores is None:
            stored_scores = score(np.asarray(stored, dtype=np.uint64), now_ms).tolist()
        blocks = out + stored
        scores = out_scores + stored_scores
        ranked = np.argsort(np.asarray(scores), kind="stable").tolist()  # as _round ranks
        go = ranked[: len(out)]
        spared = [i for i in ranked[len(out) :] if i < len(out)]
        queue, queue_scores = self._queue[tier], self._queue_scores[tier]
        for i in reversed(spared):  # the queue pops its end: the lowest go back last
            queue.append(blocks[i])
            queue_scores.append(scores[i])
        return [blocks[i] for i in go], [scores[i] for i in go]

    def _round(
        self,
        placement: Placement,
        tier: int,
        over: int,
        pinned: set[int],
        stored: list[int],
        score: ScoreFn,
        now_ms: int,
        by_recency: bool,
    ) -> tuple[list[int], list[float]]:
        """One eviction round of ``tier`` (see ``_make_room``): its ``over`` victims and
        their scores; a batched round also queues the next-lowest candidates."""
        ahead, sample_size = 0, self.params.eviction_sample
        if by_recency:
            candidates = placement.oldest(tier, over, exclude=pinned)
            if len(candidates) < over:
                candidates += placement.oldest(
                    tier, over - len(candidates), exclude=set(candidates)
                )
        else:
            ahead, sample_size = self._batched(placement, tier, over)
            if 2 * over < placement.count(tier):
                sample = placement.sample(
                    tier, sample_size + over + ahead, self.rng, exclude=pinned
                )
                # Distinct, in first-seen order: a stored block may also have been sampled.
                candidates = list(
                    dict.fromkeys(sample + stored if self.params.admission else sample)
                )
            else:
                # A spill of over half the tier (an oversized request, its cascade):
                # sampling would mostly repeat members; every resident is a candidate,
                # in member order, the request's own last (they spill only if needed).
                candidates = [b for b in placement.members(tier) if b not in pinned]
                if self.params.admission or len(candidates) < over:
                    candidates += [b for b in placement.members(tier) if b in pinned]
        if len(candidates) < over:
            # More pinned blocks than room: the request itself must spill.
            chosen = set(candidates)
            need = over - len(candidates)
            for b in placement.members(tier):
                if b not in chosen:
                    candidates.append(b)
                    need -= 1
                    if need == 0:
                        break
        scores = score(np.asarray(candidates, dtype=np.uint64), now_ms)
        if by_recency:  # all of them, oldest first (the order the tier below keeps)
            return candidates, scores.tolist()
        ranked = np.argsort(scores, kind="stable")
        victims = ranked[:over]
        if ahead > 0:
            # The next-lowest, the request's own blocks excepted, lowest last (popped
            # first) for the requests to come.
            nxt = [i for i in ranked[over : over + ahead].tolist() if candidates[i] not in pinned]
            nxt.reverse()
            self._queue[tier] = [candidates[i] for i in nxt]
            self._queue_scores[tier] = scores[nxt].tolist()
            self._round_ms[tier] = now_ms
            self._round_request[tier] = self._requests
            if tier == 0:
                self._read_since_round = {}
        return [candidates[i] for i in victims.tolist()], scores[victims].tolist()
