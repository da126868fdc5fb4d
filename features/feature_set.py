"""The one named, versioned list of per-block features.

Training (``training.dataset``) and serving (``features.state.FeatureState``) both
produce rows in exactly this column order; a model records ``FEATURE_VERSION`` and
refuses rows of another version. Change the list, the order or the meaning of any
column => bump ``FEATURE_VERSION``.

Conventions:

- Times are milliseconds, counts are plain counts, all stored as float32.
- ``MISSING`` (-1) marks a value that does not exist (no previous gap, no parent,
  unknown block). Every real value of a time, count or length is >= 0, so tree
  models split it off and neural models can learn it as a flag.
- No feature only ever grows with trace time for every block alike (such a feature
  identifies the time period and breaks time-split training); per-block counts are
  fine, global ones are decayed rates or ratios.
- ``known`` is 1 for a tracked block and 0 for an unknown one; an unknown block's row
  is ``known=0`` with every block feature ``MISSING`` and the request-level
  features filled in.
- The number of gap columns and the decayed-counter half-lives come from
  ``FeatureParams``; ``feature_names(params)`` names them. ``FEATURE_NAMES`` is the
  list for the default parameters.
"""

from __future__ import annotations

FEATURE_VERSION = 3
"""Bump whenever ``feature_names`` changes (names, order, meaning).

2: dropped the prefix root's fan-out and access count. When every request shares one
root (the Mooncake trace: block 0) they are global counters that only grow, so they
identify the time period, and a model trained on the first 60% of the trace fails on
the rest: LightGBM AUC of reuse within 300 s on the time-split test part 0.59 with
them, 0.71 without (their ratio, tried in between, still 0.65). The fan-out of a
block's own subtree is ``num_children``.
3: added ``turn_gap_ms``, the conversation's pace (how long its user took between the
previous turn and the latest one).
"""

MISSING = -1.0
"""Value of a feature that does not exist for this block (no gap, no parent, unknown)."""

DEFAULT_NUM_GAPS = 8
DEFAULT_HALF_LIVES_S: tuple[float, ...] = (10.0, 60.0, 600.0, 3600.0)
DEFAULT_RATE_HALF_LIVES_S: tuple[float, ...] = (10.0, 60.0)
ROOT_POPULARITY_HALF_LIFE_S = 60.0
"""Half-life of the prefix root's decayed counter (must be one of the half-lives)."""

# What each column means (the ``{i}``/``{hl}`` families are expanded by feature_names).
FEATURE_DOCS: dict[str, str] = {
    "known": "1 if the block is tracked, 0 if never seen (or dropped by the cap)",
    "gap_{i}_ms": "i-th most recent inter-access gap (1 = latest), MISSING if fewer accesses",
    "decayed_count_hl_{hl}s": "exponentially decayed access count with this half-life, at now",
    "access_count": "requests that read the block since it was first tracked",
    "age_ms": "now - first access",
    "time_since_last_access_ms": "now - last access",
    "requests_since_last_access": "requests observed (any block) since the block's last access",
    "depth": "position in the chain of the last request that read it (0 = prefix root)",
    "last_request_num_blocks": "chain length of the last request that read it",
    "blocks_to_tail": "last_request_num_blocks - 1 - depth (0 = the tail of that request)",
    "ever_tail": "1 if the block was ever the last block of a request",
    "last_request_input_tokens": "prompt tokens of the last request that read it (MISSING if unknown)",
    "last_request_output_tokens": "output tokens of the last request that read it (MISSING if unknown)",
    "last_request_hit_fraction": "leading known blocks / chain length of that request at its arrival",
    "turn_index": "turn of the last request that read it: session count, else chain continuations",
    "turn_gap_ms": "time from the previous turn of its conversation to the last request that read "
    "it: the conversation's pace (MISSING on a first turn)",
    "num_children": "distinct child blocks created after it",
    "time_since_child_access_ms": "now - last time a request read past this block (MISSING if never)",
    "time_since_extended_ms": "now - last time a request through it appended new blocks (MISSING if never)",
    "parent_time_since_last_access_ms": "now - the parent's last access (MISSING at depth 0 or untracked)",
    "parent_access_count": "the parent's access count (MISSING at depth 0 or untracked)",
    "root_decayed_count_hl_60s": "the prefix root's decayed access count (60 s half-life), at now "
    "(a global value when every request shares one root, as in the Mooncake trace)",
    "root_time_since_extended_ms": "now - last time the root's chain gained new blocks",
    "tier_rank": "fastest tier holding the block per residency events (0 = HBM), 4 = none known",
    "request_rate_per_s_hl_{hl}s": "request arrival rate (decayed count with this half-life), at now",
    "block_access_rate_per_s_hl_60s": "block access arrival rate (60 s half-life), at now",
}

NO_TIER_RANK = 4
"""``tier_rank`` of a block no residency event placed in any tier."""


def _hl_name(half_life_s: float) -> str:
    return f"{half_life_s:g}"


def feature_names(
    num_gaps: int = DEFAULT_NUM_GAPS,
    half_lives_s: tuple[float, ...] = DEFAULT_HALF_LIVES_S,
    rate_half_lives_s: tuple[float, ...] = DEFAULT_RATE_HALF_LIVES_S,
) -> tuple[str, ...]:
    """Column names, in order, for these feature parameters."""
    return (
        "known",
        *(f"gap_{i}_ms" for i in range(1, num_gaps + 1)),
        *(f"decayed_count_hl_{_hl_name(h)}s" for h in half_lives_s),
        "access_count",
        "age_ms",
        "time_since_last_access_ms",
        "requests_since_last_access",
        "depth",
        "last_request_num_blocks",
        "blocks_to_tail",
        "ever_tail",
        "last_request_input_tokens",
        "last_request_output_tokens",
        "last_request_hit_fraction",
        "turn_index",
        "turn_gap_ms",
        "num_children",
        "time_since_child_access_ms",
        "time_since_extended_ms",
        "parent_time_since_last_access_ms",
        "parent_access_count",
        f"root_decayed_count_hl_{_hl_name(ROOT_POPULARITY_HALF_LIFE_S)}s",
        "root_time_since_extended_ms",
        "tier_rank",
        *(f"request_rate_per_s_hl_{_hl_name(h)}s" for h in rate_half_lives_s),
        "block_access_rate_per_s_hl_60s",
    )


FEATURE_NAMES: tuple[str, ...] = feature_names()
"""Column names for the default ``FeatureParams``."""


def request_level(names: tuple[str, ...]) -> tuple[str, ...]:
    """The columns that hold one value for every row at an instant (load, not the
    block). Over a short trace they can stand in for "which period is this", which
    does not carry over to a later time split: trainers may want to leave them out."""
    return tuple(n for n in names if n.startswith(("request_rate_", "block_access_rate_")))
