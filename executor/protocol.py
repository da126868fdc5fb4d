"""The one executor seam: what every executor offers the serving side.

Primitives:

- ``Executor`` (a ``Protocol``): ``apply(decisions) -> list[Outcome]`` (a batch, in
  order), ``locate(block) -> tier name | None``, ``capacities()`` and ``occupancy()``
  (per tier, blocks and bytes), ``health() -> dict``, ``sync()``, ``close()``, ``tier_names``
  (fastest first), and ``store(block, tier, size_bytes)`` for an executor that stands
  in for the engine (it holds the blocks the engine computes).
- ``Outcome``: what happened to one decision; ``status`` is one of ``OUTCOME_STATUSES``
  and ``reason`` says why in words.
- ``TierSpace``: blocks and bytes, for one tier's capacity or occupancy.

Implementations: ``executor.core.Executor`` (real tiers, crash-safe, journaled) and
``executor.sim.SimulatedExecutor`` (simulated time and a timing model). Adapters to
other cache layers implement the same protocol and register in the contract suite
(``tests/unit/executor/test_executor_contract.py``).

The rules every implementation keeps (the contract suite checks them):

- Decisions of one ``apply`` call take effect in the order given (an implementation
  may run moves of different blocks in parallel, never reorder one block's moves).
  The caller orders the batch so that each move finds room (demote before promote).
- A decision id is applied at most once; a repeat is answered ``duplicate``.
- An executor never chooses a victim: a move or store into a full tier is refused
  (``refused_full``) and changes nothing. The planner is the only component that
  decides what leaves a tier.
- ``occupancy()`` never exceeds ``capacities()``, in bytes, in any tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from executor.block_ids import BlockId
from executor.decision import Decision

OutcomeStatus = Literal[
    "applied",
    "duplicate",
    "missing",
    "stale",
    "refused_full",
    "refused_pinned",
    "refused_budget",
    "expired",
    "failed",
]
"""Closed vocabulary of what can happen to a decision:

- ``applied``: done.
- ``duplicate``: this decision id was handled before; nothing done again.
- ``missing``: the block is in no tier.
- ``stale``: the decision's view is out of date: the block is elsewhere than its
  ``from_tier``, already at ``to_tier``, or already (un)pinned; the move does not apply.
- ``refused_full``: the destination tier has no room (executors never evict to make it).
- ``refused_pinned``: the block is pinned; it is not moved or dropped.
- ``refused_budget``: the destination's prefetch bandwidth budget is spent.
- ``expired``: its ``deadline_ms`` had passed.
- ``failed``: an error (I/O, corrupt source, unconfigured tier); ``reason`` says which.
"""

OUTCOME_STATUSES: tuple[str, ...] = get_args(OutcomeStatus)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one decision (or one engine store, ``decision_id="write"``)."""

    decision_id: str
    status: OutcomeStatus
    reason: str = ""
    """Why it was not applied, in words (empty when applied)."""
    block_hash: int | None = None
    from_tier: str | None = None
    """Where the block was (for moves: the tier it was read from)."""
    to_tier: str | None = None
    size_bytes: int = 0
    duration_ms: float = 0.0
    """Wall time spent applying it (0 for simulated executors)."""
    completion_ms: float | None = None
    """Simulated executors: when the moved copy is usable at ``to_tier``."""

    @property
    def applied(self) -> bool:
        return self.status == "applied"


@dataclass(frozen=True, slots=True)
class TierSpace:
    """Blocks and bytes of one tier. ``num_blocks`` is None for a capacity that bounds
    bytes only (a tier of variable-size blocks)."""

    num_blocks: int | None
    size_bytes: int


@runtime_checkable
class Executor(Protocol):
    """An executor of ``Decision``s. The serving side holds one through this protocol
    (``serving.decisions.ExecutorSink``) and calls nothing else."""

    @property
    def tier_names(self) -> Sequence[str]:
        """Tier names, fastest first."""
        ...

    def apply(self, decisions: Sequence[Decision]) -> list[Outcome]:
        """Apply a batch, in order for each block; one ``Outcome`` per decision, in
        input order. Called once per planner round by the decision sink."""
        ...

    def locate(self, block: BlockId) -> str | None:
        """The tier holding ``block``, or None."""
        ...

    def store(self, block: int, tier: str, size_bytes: int) -> Outcome:
        """Hold a block the engine just computed (``refused_full`` when ``tier`` has no
        room). Called by the decision sink for the planner's ``store`` moves, only when
        this executor stands in for the engine (``kvwarm serve --executor``)."""
        ...

    def capacities(self) -> dict[str, TierSpace]:
        """Tier name -> how much it may hold."""
        ...

    def occupancy(self) -> dict[str, TierSpace]:
        """Tier name -> how much it holds now."""
        ...

    def health(self) -> dict[str, Any]:
        """A JSON-ready summary for ``/health``: at least ``status`` ("ok" or a
        problem), ``tiers`` (the names), and ``num_decisions`` by outcome status."""
        ...

    def sync(self) -> None:
        """Make everything applied so far durable (a journal fsync; a no-op where
        nothing is kept). Called by the decision sink's ``flush``, before the source's
        offsets are committed."""
        ...

    def close(self) -> None:
        """Release threads, files and handles; called once, when the service stops."""
        ...
