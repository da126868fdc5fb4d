"""kvwarm's bundled tiered cache executor: it holds KV blocks in tiers (HBM, DRAM,
local NVMe, remote NVMe-oF or object store), moves them when told, never loses one.

Primitives:

- ``Decision`` (``executor.decision``): what the planner sends; ``to_dict``/``from_dict``.
- ``Tier`` (``executor.tier``): ``contains``, ``read``, ``write``, ``discard``,
  ``used_bytes``, ``capacity_bytes``; one constructor shape ``Tier(name, Params)``.
  Implementations in ``executor.tiers`` (memory, directory, remote, gpu) and
  ``executor.sim.tier`` (simulated), built by kind with ``executor.tiers.make_tier``.
- ``executor.protocol.Executor``: the one seam the serving side uses (``apply`` a
  batch -> ``Outcome``s with a closed status vocabulary, ``locate``, ``capacities``,
  ``occupancy``, ``health``, ``store``, ``close``). Executors never evict on their own:
  a move into a full tier is refused (``refused_full``); the planner picks victims.
- ``Executor`` (``executor.core``): the real one; applies decisions crash-safely and
  idempotently, reports an ``Outcome`` for each, recovers on start.
- ``SimulatedExecutor`` (``executor.sim``): the same protocol on simulated time with a
  timing model from a profile file.

The package imports nothing else of kvwarm's, and no heavy dependency: torch is
imported only by ``executor.tiers.gpu`` on a CUDA machine.
"""

from __future__ import annotations

from executor.block_ids import BlockId, InvalidBlockIdError, block_key, key_to_block_id
from executor.core import Executor, ExecutorParams, ExecutorRecovery, ExecutorStats
from executor.decision import ACTIONS, Action, Decision, DecisionValidationError
from executor.names import TIER_NAMES, TIER_RANK, UnknownTierError
from executor.protocol import OUTCOME_STATUSES, Outcome, OutcomeStatus, TierSpace
from executor.tier import (
    BlockNotFoundError,
    Buffer,
    CorruptBlockError,
    RecoveryReport,
    Tier,
    TierError,
    TierFullError,
    TierParams,
)

__all__ = [
    "ACTIONS",
    "OUTCOME_STATUSES",
    "OutcomeStatus",
    "TierSpace",
    "TIER_NAMES",
    "TIER_RANK",
    "Action",
    "BlockId",
    "BlockNotFoundError",
    "Buffer",
    "CorruptBlockError",
    "Decision",
    "DecisionValidationError",
    "Executor",
    "ExecutorParams",
    "ExecutorRecovery",
    "ExecutorStats",
    "InvalidBlockIdError",
    "Outcome",
    "RecoveryReport",
    "Tier",
    "TierError",
    "TierFullError",
    "TierParams",
    "UnknownTierError",
    "block_key",
    "key_to_block_id",
]
