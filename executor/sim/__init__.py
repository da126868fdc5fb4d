"""The simulated side of the executor, used by replay: a timing model, a simulated
clock, simulated tiers with the real ``Tier`` interface, and ``SimulatedExecutor``,
the block-level API replay calls (O(1) per block access, no payloads, no sleeping).

Parameters come from a profile file (``executor/profiles/default.toml``), where every
number carries its unit and its source. See ``executor.sim.executor`` for the model.
"""

from __future__ import annotations

from executor.sim.clock import SimClock
from executor.sim.executor import RequestLoad, SimStats, SimulatedExecutor
from executor.sim.profile import ModelSpec, Profile, ProfileError, TierTiming, load_profile
from executor.sim.timing import Channel, TierChannels

__all__ = [
    "Channel",
    "ModelSpec",
    "Profile",
    "ProfileError",
    "RequestLoad",
    "SimClock",
    "SimStats",
    "SimulatedExecutor",
    "TierChannels",
    "TierTiming",
    "load_profile",
]
