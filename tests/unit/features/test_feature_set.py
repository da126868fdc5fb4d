"""The feature list: one named, versioned list that the state fills column by column."""

from __future__ import annotations

import re

import numpy as np

from features.events import BlocksAccessed
from features.feature_set import (
    FEATURE_DOCS,
    FEATURE_NAMES,
    FEATURE_VERSION,
    feature_names,
    request_level,
)
from features.state import FeatureParams, FeatureState


def test_names_are_unique_and_each_is_documented() -> None:
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    patterns = [
        re.compile(
            "^" + re.escape(doc).replace(r"\{i\}", r"\d+").replace(r"\{hl\}", r"[\d.]+") + "$"
        )
        for doc in FEATURE_DOCS
    ]
    undocumented = [n for n in FEATURE_NAMES if not any(p.match(n) for p in patterns)]
    assert not undocumented


def test_version_is_recorded_and_names_follow_params() -> None:
    assert isinstance(FEATURE_VERSION, int) and FEATURE_VERSION >= 1
    params = FeatureParams(num_gaps=3, half_lives_s=(5.0, 60.0), rate_half_lives_s=(30.0,))
    names = params.feature_names
    assert names == feature_names(3, (5.0, 60.0), (30.0,))
    assert [n for n in names if n.startswith("gap_")] == ["gap_1_ms", "gap_2_ms", "gap_3_ms"]
    assert "decayed_count_hl_5s" in names and "request_rate_per_s_hl_30s" in names
    state = FeatureState(params)
    state.observe(BlocksAccessed(0, "r", (1, 2), 16))
    assert state.features_for(np.array([1, 9], dtype=np.uint64), 5).shape == (2, len(names))
    assert FeatureState().feature_names == FEATURE_NAMES


def test_request_level_columns_are_the_same_for_every_row() -> None:
    state = FeatureState()
    state.observe(BlocksAccessed(0, "a", (1, 2, 3), 16))
    state.observe(BlocksAccessed(900, "b", (1, 4), 16))
    rows = state.features_for(np.array([1, 3, 77], dtype=np.uint64), 2000)
    cols = [FEATURE_NAMES.index(n) for n in request_level(FEATURE_NAMES)]
    assert len(cols) == 3
    assert (rows[:, cols] == rows[0, cols]).all() and (rows[0, cols] > 0).all()
