"""Tier names the executor knows, fastest first.

The values match ``features.events.Tier`` (``"hbm"``, ``"dram"``, ``"nvme"``,
``"remote"``); ``executor`` sits at the bottom of the stack and imports nothing of
ours, so the names are repeated here as plain strings.
"""

from __future__ import annotations

TIER_NAMES: tuple[str, ...] = ("hbm", "dram", "nvme", "remote")
"""Every tier name, fastest first. A lower index means a faster tier."""

TIER_RANK: dict[str, int] = {name: rank for rank, name in enumerate(TIER_NAMES)}


class UnknownTierError(ValueError):
    """A tier name is not one of ``TIER_NAMES``."""

    def __init__(self, name: object) -> None:
        super().__init__(f"unknown tier {name!r}; use one of {', '.join(TIER_NAMES)}")


def check_tier_name(name: object) -> str:
    """Return ``name`` if it is a known tier name, else raise ``UnknownTierError``."""
    if not isinstance(name, str) or name not in TIER_RANK:
        raise UnknownTierError(name)
    return name
