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

Batched eviction (``evict_ahead_visits``, ``evict_ahead_share``): one scoring call
costs far more than its rows (feature gathering, the model call, the chain blend: on
the shared trace ~1.5 ms a round, most of a learned replay's time), so a scored round
also frees the room the next ~8 requests will take (at most 1/32 of the tier), and
those requests store into it without a round. The next round then samples
``eviction_sample`` residents per request it stands for and scores the blocks those
requests stored beside them (deferred admission: a one-off block stored into the free
room is still the first to go), so victims are chosen as selectively as one round per
request would have. Shared trace, LightGBM, single tier (``kvwarm bench replay``
prints the rate): 1.7x the block accesses/s at 5%, hit ratio within -0.0008 .. +0.0022
of one round per request at 1/5/10%.

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
        8,
        ge=0,
        le=1024,
        description="Batched eviction: a scored eviction round also frees the room about "
        "this many more requests will take (the tier's mean intake per request), so they "
        "find room without a scoring call; the next round samples ``eviction_sample`` "
        "residents per request it stands for and reconsiders the blocks they stored. 0: "
        "one round per request that overflows the tier.",
    )
    evict_ahead_share: float = Field(
        1 / 32,
        ge=0.0,
        le=0.25,
        description="At most this share of the tier's capacity is freed ahead (the tier's "
        "mean occupancy is at most half of it below capacity).",
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
        # Batched eviction (``evict_ahead_visits``), per tier: visits (requests or
        # demotion batches that added blocks) since its last scored round, the blocks
        # they stored (the next round's admission candidates), how much that round freed
        # beyond its overflow, and the mean intake per visit.
        self._pending: dict[int, int] = {}
        self._kept: dict[int, list[int]] = {}
        self._freed_ahead: dict[int, int] = {}
        self._intake: dict[int, float] = {}

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
        added = len(moves) > 0
        self._make_room(placement, 0, pinned, stored, score, now_ms, moves, by_recency, added)
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
        lower = [
            b for b, t in zip(candidates, placement.tiers_of(candidates), strict=True) if t > target
        ]
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

    def _ahead(self, placement: Placement, tier: int, over: int) -> tuple[int, int]:
        """(blocks to free beyond the overflow, residents to sample) for a scored round
        of ``tier``: ``eviction_sample`` per visit (a request, or a demotion batch from
        above) since the tier's last round, as many as per-visit rounds would have
        scored, so the victims are as selectively chosen."""
        p = self.params
        if p.evict_ahead_visits == 0 or p.evict_ahead_share == 0:
            return 0, p.eviction_sample
        visits = self._pending.get(tier, 0) + 1
        self._pending[tier] = 0  # counting starts at the first round (not while filling)
        # The tier's intake per visit: what the last round freed ahead, plus this
        # overflow, over the visits since (a decayed mean).
        intake = (self._freed_ahead.get(tier, 0) + over) / visits
        mean = self._intake.get(tier, intake) * 0.9 + 0.1 * intake
        self._intake[tier] = mean
        ahead = min(
            int(placement.capacities[tier] * p.evict_ahead_share),
            int(p.evict_ahead_visits * mean),
        )
        if 2 * (over + ahead) >= placement.count(tier):
            ahead = 0  # a spill of over half the tier: every resident is a candidate
            self._kept.pop(tier, None)
        self._freed_ahead[tier] = ahead
        return ahead, p.eviction_sample * visits

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
        added: bool = True,
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
        while tier < placement.num_tiers:
            over = placement.overflow(tier)
            if over <= 0:
                if added and not by_recency and tier in self._pending:
                    self._pending[tier] += 1
                    if self.params.admission:
                        self._kept.setdefault(tier, []).extend(stored)
                return
            ahead, sample_size = 0, self.params.eviction_sample
            if not by_recency:
                ahead, sample_size = self._ahead(placement, tier, over)
            if by_recency:
                candidates = placement.oldest(tier, over, exclude=pinned)
                if len(candidates) < over:
                    candidates += placement.oldest(
                        tier, over - len(candidates), exclude=set(candidates)
                    )
            elif 2 * (over + ahead) < placement.count(tier):
                over += ahead  # ahead > 0 only here (``_ahead``)
                sample = placement.sample(tier, sample_size + over, self.rng, exclude=pinned)
                if self.params.admission:
                    kept = [
                        b
                        for b in self._kept.pop(tier, ())
                        if b not in pinned and placement.tier_of(b) == tier
                    ]
                    candidates = sample + kept + stored
                else:
                    candidates = list(sample)
                # Distinct, in first-seen order: a stored block may also have been sampled.
                candidates = list(dict.fromkeys(candidates))
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
                out, out_scores = candidates, scores.tolist()
            else:
                victims = np.argsort(scores, kind="stable")[:over]
                out = [candidates[i] for i in victims.tolist()]
                out_scores = scores[victims].tolist()
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
            added = True
