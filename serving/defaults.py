"""Defaults that replay and serving must agree on: what is evaluated is what is served.

``serving.planner.PlannerParams`` and ``serving.loop.Sidecar`` take their defaults from
here; ``serving.settings.SidecarSettings`` (serving) and ``training.tiered.TieredSetup``
(replay) build on those, and change a value only by naming it. Change a default here and
both change together.
"""

from __future__ import annotations

from typing import Final

# -- the planner (serving.planner.PlannerParams) ----------------------------------------------
EVICTION_SAMPLE: Final = 64
"""Residents sampled per eviction round."""
PREFETCH_BUDGET_BLOCKS: Final = 64
"""Most speculative promotions per prefetch round."""
MIN_RESIDENCY_MS: Final = 2_000
"""Hysteresis: a block moved less than this long ago is not displaced by a speculative
promotion (it only matters where prefetch runs: tiered replay and serving)."""

# -- the loop (serving.loop.Sidecar) ------------------------------------------------------------
PREFETCH_INTERVAL_MS: Final = 1_000
"""Event time between speculative prefetch rounds."""
RECENT_REQUESTS: Final = 128
"""Prefetch candidates are the blocks of this many most recent requests."""
PREFETCH_LEVELS: Final = 2
"""Prefetch rounds target the fastest this-many tiers (each from the tiers below it)."""

PREFETCH_MIN_PRECISION: Final = 0.25
"""Speculative prefetch rounds run while at least this share of prefetched blocks is
read before leaving its tier (``serving.prefetch_gate``); below it, one round in ten
probes. Wasted prefetches take link bandwidth from demand loads: on the seed's
long-context setting, ungated prefetch at precision 0.13-0.15 made TTFT p50 5-13%
worse than prewarming alone."""

# -- the online guard (predictor.guard) ----------------------------------------------------
GUARD_MEMORY_TIERS: Final = ("hbm", "dram")
"""Besides the fastest tier, the guard estimates at the size of the leading tiers named
here together (``GuardParams.outer_capacity_blocks``) and judges on both, weighed by the
load time a hit saves (``predictor.guard.outer_weight_for``): in the tiered profile a
block read from host DRAM costs ~0.33 ms against ~25 ms from NVMe, so TTFT follows what
the served ranking keeps in HBM and DRAM together far more than what it keeps in HBM
(weight 0.987 on the outer scale). Measured with the plain mean (before the weights),
``kvwarm bench quality --tiered``, guarded LightGBM's TTFT p50 against no
prewarm at HBM 1/5/10% judged on HBM alone / on HBM + DRAM alone / on both: shared trace
(4,000 requests) -3.7/-1.7/-3.5%, -4.7/-3.4/-3.5%, -4.7/-3.4/-3.5% (judged on HBM alone
the guard served LFU in about half of the prefetch rounds at 1%); sharedprefix -1.4/-1.0/-0.7%,
-0.9/-0.1/-0.3% (every candidate ties at that size and the guard stays on LRU),
-1.4/-1.0/-0.7%."""
