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
"""

from __future__ import annotations

from collections.abc import Iterable

from serving.placement import NOWHERE
from serving.planner import Move


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
        self.used_weight = prior_outcomes  # optimistic prior: every prior outcome used
        self.total_weight = prior_outcomes
        self.pending: dict[int, int] = {}
        """Prefetched block -> the tier it was prefetched into, until resolved."""
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

    def allow_round(self) -> bool:
        """Whether this prefetch round runs (counted either way)."""
        self.num_rounds += 1
        if self.open or self.num_rounds % self.probe_every == 0:
            return True
        self.num_skipped += 1
        return False

    def _resolve(self, used: bool) -> None:
        self.used_weight = self.used_weight * self._decay + (1.0 if used else 0.0)
        self.total_weight = self.total_weight * self._decay + 1.0
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
            if pending.pop(block, None) is not None:
                self._resolve(True)

    def on_moves(self, moves: Iterable[Move]) -> None:
        """Moves emitted: prefetches start waiting; a pending block moved out of its tier
        first was wasted."""
        pending = self.pending
        for m in moves:
            if m.kind == "prefetch" and m.to_tier != NOWHERE:
                pending[m.block] = m.to_tier
                if len(pending) > self.max_pending:
                    del pending[next(iter(pending))]  # the oldest, unresolved
            elif m.block in pending and m.from_tier == pending[m.block]:
                del pending[m.block]
                self._resolve(False)

    def status(self) -> dict[str, float | int | bool]:
        return {
            "precision": round(self.precision, 4),
            "open": self.open,
            "used": self.num_used,
            "wasted": self.num_wasted,
            "rounds": self.num_rounds,
            "skipped_rounds": self.num_skipped,
        }
