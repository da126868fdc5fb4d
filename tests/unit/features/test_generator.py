from __future__ import annotations

import io
import json
import math

import pytest

from features.generator import PROFILES, generate, params_for, write_trace


def _bytes(**kw) -> str:
    out = io.StringIO()
    write_trace(params_for(kw.pop("profile", "mixed"), **kw), out)
    return out.getvalue()


def test_same_seed_same_bytes_and_other_seed_differs():
    a = _bytes(num_requests=500, seed=3)
    assert a == _bytes(num_requests=500, seed=3)
    assert a != _bytes(num_requests=500, seed=4)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_rows_are_valid_mooncake_and_prefix_consistent(profile):
    rows = list(generate(params_for(profile, num_requests=800, seed=1)))
    assert len(rows) == 800
    predecessor: dict[int, int] = {}
    position: dict[int, int] = {}
    next_new = 0
    last_ts = 0
    for row in rows:
        assert row["timestamp"] >= last_ts
        last_ts = row["timestamp"]
        ids = row["hash_ids"]
        assert len(ids) == math.ceil(row["input_length"] / 512)
        assert row["output_length"] >= 1
        parent = -1
        for depth, block in enumerate(ids):
            if block not in predecessor:
                assert block == next_new, "ids must first appear in order 0, 1, 2, ..."
                next_new += 1
                predecessor[block], position[block] = parent, depth
            # An id always follows the same predecessor at the same depth.
            assert predecessor[block] == parent
            assert position[block] == depth
            parent = block


def test_chat_turns_extend_the_previous_chain():
    params = params_for("chat", num_requests=2000, seed=2, mix={"chat": 1.0})
    rows = list(generate(params))
    by_session: dict[str, list[list[int]]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row["hash_ids"])
    multi = [turns for turns in by_session.values() if len(turns) >= 2]
    assert len(multi) > 50
    for turns in multi:
        for prev, cur in zip(turns, turns[1:], strict=False):
            # The next turn re-reads every full block of the previous prompt (only the
            # previous prompt's partial last block may differ).
            assert cur[: len(prev) - 1] == prev[:-1]
            assert len(cur) >= len(prev)
    assert len(rows) == 2000


def test_planted_profile_returns_after_the_fixed_gap():
    rows = list(generate(params_for("planted", num_requests=1500, seed=5)))
    times: dict[str, list[int]] = {}
    for row in rows:
        times.setdefault(row["session_id"], []).append(row["timestamp"])
    gaps = {b - a for ts in times.values() for a, b in zip(ts, ts[1:], strict=False)}
    assert gaps and all(abs(g - 45_000) <= 1 for g in gaps)


def test_unknown_profile_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: mixed"):
        params_for("nope")


def test_session_ids_only_when_asked():
    plain = json.loads(_bytes(num_requests=5, seed=0).splitlines()[0])
    assert set(plain) == {"timestamp", "input_length", "output_length", "hash_ids"}
    out = io.StringIO()
    write_trace(params_for("mixed", num_requests=5, seed=0), out, session_ids=True)
    assert "session_id" in json.loads(out.getvalue().splitlines()[0])
