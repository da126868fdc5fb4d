"""Without session ids, the turn index is estimated from chain continuation (a request
whose known prefix ends near the tail of the request that last read it continues that
conversation). On generated traces, where the true session of every request is known,
the estimate must match the session's own turn count on almost every request."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.feature_set import FEATURE_NAMES
from features.generator import generate, params_for
from features.state import FeatureState


@pytest.mark.parametrize(("profile", "at_least"), [("chat", 0.97), ("mixed", 0.92)])
def test_estimated_turn_matches_the_true_session_turn(profile: str, at_least: float) -> None:
    rows = list(generate(params_for(profile, num_requests=2500, seed=3)))
    seen: collections.Counter[str] = collections.Counter()
    true_turn = []
    for row in rows:
        seen[row["session_id"]] += 1
        true_turn.append(seen[row["session_id"]])
    state = FeatureState()
    turn_col = FEATURE_NAMES.index("turn_index")
    estimated = []
    for i, row in enumerate(rows):
        event = dataclasses.replace(decode_mooncake(row, str(i)), session_id=None)
        state.observe(event)
        tail = state.last_request_slots[-1:]
        estimated.append(state.features_for_slots(tail, event.ts_ms)[0, turn_col])
    agreement = float((np.array(estimated) == np.array(true_turn)).mean())
    assert agreement >= at_least, f"estimated turn agrees on {agreement:.3f} of requests"
    assert max(true_turn) >= 4  # the trace does have long conversations
