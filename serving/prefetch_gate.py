"""``PrefetchGate``: speculative prefetch only while it pays.

A speculative prefetch takes link bandwidth that demand loads may need; a prefetched
block that no request reads before it leaves its tier is pure cost. The gate measures,
on the live stream, the share of prefetched blocks a request reads while they are
still in the tier they were prefetched into (``precision``), smoothed over about the
last ``window`` resolved prefetches, and lets prefetch rounds run only while it is at
least ``min_precision``. Below it, one round in ``probe_every`` still runs, so the
estimate keeps up when the workload changes. It starts open (an optimistic prior worth
a few outcomes), as prefetch ran before the gate existed.

Resolution of a prefetched block: *used* when a request reads it while it sits in
the tier it was prefetched into; *wasted* when a move takes it out of that tier first.
At most ``max_pending`` prefetched blocks await resolution (the oldest are dropped
unresolved), so memory is bounded.

Per target tier: the precision is also kept for each tier prefetched into, and
``allow_round(tier)`` gates that tier's rounds on its own precision. A block prefetched
into a large, slow-churning tier (DRAM) stays long enough to be read far more often
than one prefetched into a small, fast-churning one (HBM); one pooled figure closed
both at once (shared trace, 4,000 requests, HBM 1%: 1,469 of 1,657 rounds skipped, so
NVMe-to-DRAM prefetch that pays was skipped with HBM prefetch that did not).
``allow_round()`` without a tier gates on the pooled precision.

A score floor per target tier (``round_floor``, what the sidecar asks): a prefetch's
outcome is kept with the score its candidate had, and a tier's rounds take only the
candidates scored where its recent prefetches were read often enough. Its last
``window`` outcomes, ranked by score, are cut into groups of ``floor_group``; the floor is
the lowest score of the last group, from the top, down to which every group was read at
least ``min_precision`` of the time (plus ``FLOOR_MARGIN_SE`` standard errors). One
round in ``probe_every`` probes one group lower, so the floor follows the workload; where
even the top group falls short, only those probes run, with every candidate. Outcomes
are kept per score scale (``set_scale``: the policy serving when the block was
prefetched), as a guard switching candidates switches scores too; until a scale has a
group of outcomes, its rounds are all or nothing on the tier's pooled precision, as
above. Why: on the shared trace (full replay, LightGBM behind the guard, prefetches into
HBM) the precision was 0.16 over all of them at HBM 5% and 0.31 over the better half by
score, which held 98% of those read; at 1%, 0.13 over all, 0.27 over the best fifth and
0.35 over the best tenth; an all-or-nothing gate ran one round in ten with every
candidate, the wasted ones included.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

from serving.placement import NOWHERE
from serving.planner import Move

FLOOR_MARGIN_SE = 0.5
"""A group of outcomes sets the floor when its read share is at least the gate's
precision plus this many standard errors. Measured on the shared trace (full replay,
LightGBM behind the guard, HBM prefetch precision at HBM 1 / 5%, the blocks prefetched
and TTFT p50 against no prewarm): 0 gives 0.20 / 0.25 (6,645 / 939 blocks; -6.1 /
-5.3%), 0.5 gives 0.28 / 0.26 (3,127 / 979; -5.9 / -5.5%), 1.0 gives 0.23 / 0.27
(6,099 / 964; -6.1 / -5.5%); groups of 100 instead of 50 at 0: 0.15 / 0.20. The gate
all or nothing: 0.12 / 0.14 (15,968 / 1,748; -6.1 / -5.3%). So the floor about doubles
the precision, which moves by a few hundredths from one setting to the next."""


class PrefetchGate:
    def __init__(
        self,
        min_precision: float = 0.25,
        *,
        window: int = 500,
        probe_every: int = 10,
        max_pending: int = 100_000,
        prior_outcomes: float = 20.0,
    ) -> None:
        if not 0.0 <= min_precision <= 1.0:
            raise ValueError(f"min_precision must be in [0, 1], got {min_precision}")
        self.min_precision = min_precision
        self.window = window
        self.probe_every = probe_every
        self.max_pending = max_pending
        self._decay = 1.0 - 1.0 / window
        self.prior_outcomes = prior_outcomes
        self.used_weight = prior_outcomes  # optimistic prior: every prior outcome used
        self.total_weight = prior_outcomes
        self.tier_weights: dict[int, list[float]] = {}
        """Target tier -> [used weight, total weight] of its prefetches (same prior)."""
        self.tier_rounds: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        """Prefetched block -> the tier it was prefetched into, until resolved."""
        self.pending_scores: dict[int, tuple[float, str]] = {}
        """Prefetched block -> (its score, the score scale), for the floor."""
        self.outcomes: dict[int, deque[tuple[float, int, str]]] = {}
        """Target tier -> its last ``window`` resolved prefetches: (score, read, scale)."""
        self.scale = ""
        """The score scale of prefetches made now (``set_scale``)."""
        self.floor_group = 50
        """Outcomes per group of the floor (``floors``); fewer of the current scale: no
        floor."""
        self.floor_margin_se = FLOOR_MARGIN_SE
        self.num_used = 0
        self.num_wasted = 0
        self.num_rounds = 0
        self.num_skipped = 0

    @property
    def precision(self) -> float:
        return self.used_weight / self.total_weight if self.total_weight else 1.0

    @property
    def open(self) -> bool:
        return self.precision >= self.min_precision

    def precision_of(self, tier: int) -> float:
        """The precision of prefetches into ``tier`` (the prior before any resolved)."""
        used, total = self.tier_weights.get(tier, (self.prior_outcomes, self.prior_outcomes))
        return used / total if total else 1.0

    def allow_round(self, tier: int | None = None) -> bool:
        """Whether this prefetch round (into ``tier``; None: any tier, on the pooled
        precision) runs, counted either way."""
        if tier is None:
            self.num_rounds += 1
            rounds, is_open = self.num_rounds, self.open
        else:
            rounds = self.tier_rounds[tier] = self.tier_rounds.get(tier, 0) + 1
            is_open = self.precision_of(tier) >= self.min_precision
            if tier == 0:
                self.num_rounds += 1
        if is_open or rounds % self.probe_every == 0:
            return True
        self.num_skipped += 1
        return False

    def set_scale(self, scale: str) -> None:
        """The policy whose scores prefetches carry from now on (its name; a guard's
        chosen candidate): floors are set on outcomes of the same scale only."""
        self.scale = scale

    def round_floor(self, tier: int) -> float | None:
        """The lowest score a candidate prefetched into ``tier`` this round may have
        (-inf: every candidate), or None: the round is skipped. The round is counted.
        With ``floor_group`` outcomes of the current scale or more, the floor
        (``floors``), one group lower in a probe round; with fewer, every candidate
        while the tier's precision is at least ``min_precision`` and in a probe round,
        none otherwise."""
        rounds = self.tier_rounds[tier] = self.tier_rounds.get(tier, 0) + 1
        if tier == 0:
            self.num_rounds += 1
        probe = rounds % self.probe_every == 0
        floors = self.floors(tier)
        if floors is None:
            floor = -math.inf if probe or self.precision_of(tier) >= self.min_precision else None
        else:
            floor = floors[1] if probe else floors[0]
        if floor is None:
            self.num_skipped += 1
        return floor

    def floors(self, tier: int) -> tuple[float | None, float] | None:
        """(floor, probe floor) of ``tier`` from its recent outcomes of the current
        scale, ranked by score and cut into groups of ``floor_group``: the floor is the
        lowest score of the last group, from the top, down to which every group was
        read at least ``min_precision`` of the time (-inf when all were; None when the
        top group was not); the probe floor is the lowest score of the group below it
        (-inf when there is none, or when even the top group fell short: then every
        candidate is measured again). None with fewer than ``floor_group`` outcomes.
        Each group stands for its own scores: a prefetch below the floor is made in
        probe rounds only, so pooling the groups would weigh the well-read top too much."""
        scale, size = self.scale, self.floor_group
        read_by_score = sorted(
            ((score, read) for score, read, sc in self.outcomes.get(tier, ()) if sc == scale),
            key=lambda o: -o[0],
        )
        if len(read_by_score) < size:
            return None
        # A group passes at min_precision plus ``floor_margin_se`` standard errors: the
        # floor extends down group by group while they pass, so a group passing on luck
        # alone would pull it too low.
        p = self.min_precision
        needed = (p + self.floor_margin_se * math.sqrt(p * (1.0 - p) / size)) * size
        passing = 0
        for start in range(0, len(read_by_score) - size + 1, size):
            group = read_by_score[start : start + size]
            if sum(read for _, read in group) < needed:
                break
            passing += 1
        full = len(read_by_score) // size
        if passing == 0:
            return None, -math.inf
        if passing == full:
            return -math.inf, -math.inf
        return read_by_score[passing * size - 1][0], read_by_score[(passing + 1) * size - 1][0]

    def floor_of(self, tier: int) -> float | None:
        """The floor alone (``floors``): -inf, a score, or None (no floor: too few
        outcomes of the current scale, or none of its scores read often enough)."""
        floors = self.floors(tier)
        return None if floors is None else floors[0]

    def _resolve(self, used: bool, tier: int = 0, block: int | None = None) -> None:
        self.used_weight = self.used_weight * self._decay + (1.0 if used else 0.0)
        self.total_weight = self.total_weight * self._decay + 1.0
        w = self.tier_weights.setdefault(tier, [self.prior_outcomes, self.prior_outcomes])
        w[0] = w[0] * self._decay + (1.0 if used else 0.0)
        w[1] = w[1] * self._decay + 1.0
        scored = self.pending_scores.pop(block, None) if block is not None else None
        if scored is not None:
            outcomes = self.outcomes.get(tier)
            if outcomes is None:
                outcomes = self.outcomes[tier] = deque(maxlen=self.window)
            outcomes.append((scored[0], int(used), scored[1]))
        if used:
            self.num_used += 1
        else:
            self.num_wasted += 1

    def on_request(self, blocks: Iterable[int]) -> None:
        """A request reads ``blocks``: the prefetched ones among them were used."""
        pending = self.pending
        if not pending:
            return
        for block in blocks:
            tier = pending.pop(block, None)
            if tier is not None:
                self._resolve(True, tier, block)

    def on_moves(self, moves: Iterable[Move]) -> None:
        """Moves emitted: prefetches start waiting; a pending block moved out of its tier
        first was wasted."""
        pending = self.pending
        for m in moves:
            if m.kind == "prefetch" and m.to_tier != NOWHERE:
                pending[m.block] = m.to_tier
                self.pending_scores[m.block] = (float(m.score), self.scale)
                if len(pending) > self.max_pending:
                    oldest = next(iter(pending))  # unresolved
                    del pending[oldest]
                    self.pending_scores.pop(oldest, None)
            elif m.block in pending and m.from_tier == pending[m.block]:
                del pending[m.block]
                self._resolve(False, m.from_tier, m.block)

    def status(self) -> dict[str, Any]:
        return {
            "precision": round(self.precision, 4),
            "open": self.open,
            "used": self.num_used,
            "wasted": self.num_wasted,
            "rounds": self.num_rounds,
            "skipped_rounds": self.num_skipped,
            "precision_by_tier": {
                str(t): round(self.precision_of(t), 4) for t in sorted(self.tier_weights)
            },
            "score_floor_by_tier": {
                str(t): _json_floor(self.floors(t)) for t in sorted(self.outcomes)
            },
        }


def _json_floor(floors: tuple[float | None, float] | None) -> float | str:
    """A tier's floor as ``/healthz`` shows it: the score, ``"all"`` (every candidate
    goes), ``"none"`` (no score is read often enough) or ``"learning"`` (too few
    outcomes of the current scale)."""
    if floors is None:
        return "learning"
    floor = floors[0]
    if floor is None:
        return "none"
    return "all" if floor == -math.inf else round(floor, 6)
