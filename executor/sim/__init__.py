"""The one simulation, used by ``kvwarm replay`` and by ``serve --executor sim:``
alike: a timing model of the tiers' links (``timing``), the profile every number
comes from (``profile``), the simulated tiers (``SimulatedExecutor``: placement,
transfers, capacity; it applies the planner's decisions and refuses what does not
fit, never evicting on its own), the serving engine (``Engine``: continuous batching,
chunked prefill with an attention term, decode), and ``run_requests``, which drives
requests through both, open- or closed-loop. ``SimulatedTier`` (``executor.sim.tier``)
is a payload-carrying ``Tier`` for the real executor's tests.

Parameters come from a profile file (``executor/profiles/default.toml``), where every
number carries its unit and its source.
"""

from __future__ import annotations

from executor.sim.clock import SimClock
from executor.sim.engine import Engine, EngineRequest
from executor.sim.executor import SimStats, SimulatedExecutor, SimulationError
from executor.sim.profile import ModelSpec, Profile, ProfileError, TierTiming, load_profile
from executor.sim.run import RunResult, SimRequest, run_requests
from executor.sim.timing import Channel, TierChannels

__all__ = [
    "Channel",
    "Engine",
    "EngineRequest",
    "ModelSpec",
    "Profile",
    "ProfileError",
    "RunResult",
    "SimClock",
    "SimRequest",
    "SimStats",
    "SimulatedExecutor",
    "SimulationError",
    "TierChannels",
    "TierTiming",
    "load_profile",
    "run_requests",
]
