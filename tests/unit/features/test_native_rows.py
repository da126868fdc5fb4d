"""The native feature-row kernel equals the numpy rows bit for bit, and the state
falls back to numpy (saying why) when the kernel cannot be built."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features import native_rows
from features.decoders import decode_mooncake
from features.events import BlocksAccessed
from features.generator import generate, params_for
from features.state import FeatureParams, FeatureState
from tests.unit.features.test_state_properties import PARAMS, _assert_same_state, streams

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A kernel built into an empty cache for this test, forgotten after it."""
    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native_rows.ENV, raising=False)
    native_rows.reset()
    yield
    native_rows.reset()


@needs_cc
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=streams(),
    params=PARAMS,
    probe=st.lists(st.integers(0, 2**64 - 1), max_size=8),
    later_ms=st.sampled_from([0, 1, 999, 3_600_000, 10**9]),
)
def test_kernel_rows_equal_numpy_rows(
    events: list[object], params: FeatureParams, probe: list[int], later_ms: int
) -> None:
    kernel = native_rows.kernel()
    assert kernel is not None, native_rows.last_failure
    state, reference = FeatureState(params), FeatureState(params)
    state.rows_kernel, reference.rows_kernel = kernel, False
    for i, event in enumerate(events):
        state.observe(event)
        reference.observe(event)
        if i % 7 == 6 or i == len(events) - 1:
            _assert_same_state(state, reference)
            hashes = np.array(sorted(state._index)[:60] + probe, dtype=np.uint64)
            slots = state.slot_of(hashes)
            for now in (state.clock_ms - 5, state.clock_ms + later_ms):
                got = state.features_for_slots(slots, now)
                np.testing.assert_array_equal(got, reference.features_for_slots(slots, now))


@needs_cc
def test_kernel_rows_equal_numpy_rows_on_a_generated_trace(fresh_kernel) -> None:
    """Every block of a chat workload at every request, as the replay asks."""
    kernel = native_rows.kernel()
    assert kernel is not None, native_rows.last_failure
    params = FeatureParams(max_tracked_blocks=3_000)
    state, reference = FeatureState(params), FeatureState(params)
    state.rows_kernel, reference.rows_kernel = kernel, False
    checked = 0
    for i, event in enumerate(_chat(600, seed=5)):
        state.observe(event)
        reference.observe(event)
        if i % 25 == 0:
            _assert_same_state(state, reference)
            slots = state.tracked_slots()
            for now in (event.ts_ms, event.ts_ms + 61_000):
                np.testing.assert_array_equal(
                    state.features_for_slots(slots, now), reference.features_for_slots(slots, now)
                )
            checked += slots.shape[0]
    assert checked > 10_000 and state.num_evicted > 0  # the cap was reached too


def test_without_a_compiler_rows_stay_on_numpy_and_say_why(
    fresh_kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-kvwarm")
    assert native_rows.kernel() is None
    assert "no-such-compiler-kvwarm" in native_rows.last_failure
    state = FeatureState()
    state.observe(_chat(5)[0])
    rows = state.features_for(state.tracked_hashes(), state.clock_ms)
    assert rows.shape[0] == state.num_tracked and np.isfinite(rows).all()


def test_told_numpy_the_kernel_is_not_built(fresh_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_rows.ENV, "numpy")
    assert native_rows.kernel() is None
    assert native_rows.last_failure == f"{native_rows.ENV}=numpy"


@needs_cc
def test_a_kernel_that_disagrees_with_numpy_is_refused(
    fresh_kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel bug (ages off by one ms, or updates that forget the request's length)
    fails the self-test; rows stay on numpy."""
    right = native_rows.SOURCE.read_text()
    bugs = {
        "age_ms": ("(float)(now - I[src[S_FIRST]])", "(float)(now + 1 - I[src[S_FIRST]])"),
        "update": ("v < 7; ++v", "v < 1; ++v"),
    }
    for what, (good, bad) in bugs.items():
        wrong = right.replace(good, bad)
        assert wrong != right
        monkeypatch.setattr(native_rows, "SOURCE", _Source(wrong))
        native_rows.reset()
        assert native_rows.kernel() is None
        assert "self-test failed" in native_rows.last_failure
        assert what in native_rows.last_failure, native_rows.last_failure


def _chat(num_requests: int, seed: int = 0) -> list[BlocksAccessed]:
    """A generated chat workload's requests, decoded as a trace's would be."""
    rows = generate(params_for("chat", num_requests=num_requests, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


@dataclasses.dataclass
class _Source:
    text: str
    name: str = "native_rows.c"

    def read_text(self) -> str:
        return self.text


@needs_cc
def test_copies_and_pickles_read_their_own_tables(fresh_kernel) -> None:
    """The native layout keeps table addresses: a copy must not read the original's."""
    import copy
    import pickle

    state = FeatureState()
    events = _chat(300, seed=2)
    for event in events[:150]:
        state.observe(event)
    hashes = state.tracked_hashes()
    state.features_for(hashes, state.clock_ms)  # the layout is made and cached
    twin, thawed = copy.deepcopy(state), pickle.loads(pickle.dumps(state))
    del state  # its tables may be freed and reused
    for event in events[150:]:
        twin.observe(event)
        thawed.observe(event)
    now = twin.clock_ms + 5_000
    for s in (twin, thawed):
        np.testing.assert_array_equal(
            s.features_for(hashes, now), s._rows_numpy(s.slot_of(hashes), now)
        )


def test_health_says_what_computes_the_rows(fresh_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    from predictor.lightgbm_policy import LightGBMPolicy

    policy = LightGBMPolicy()
    assert native_rows.status() == "undecided"
    monkeypatch.setenv(native_rows.ENV, "numpy")
    policy.state.features_for(np.array([1], dtype=np.uint64), 0)
    assert policy.online_status()["feature_rows"] == f"numpy ({native_rows.ENV}=numpy)"
    if shutil.which("cc") is not None:
        monkeypatch.delenv(native_rows.ENV)
        native_rows.reset()
        policy.state.features_for(np.array([1], dtype=np.uint64), 0)
        assert policy.online_status()["feature_rows"] == "native"


@needs_cc
def test_a_slot_past_the_tables_is_an_error_not_a_wild_read(fresh_kernel) -> None:
    state = FeatureState(FeatureParams(initial_capacity=16))
    state.observe(_chat(5)[0])
    with pytest.raises(IndexError):
        state.features_for_slots(np.array([0, 10**9], dtype=np.int64), state.clock_ms)


@needs_cc
def test_tables_the_kernel_cannot_read_as_they_are_send_rows_to_numpy(fresh_kernel) -> None:
    """A table replaced by one that is not C-contiguous (as a restore might) is read by
    numpy, with the same rows; a contiguous one goes back to the kernel."""
    events = _chat(200, seed=4)
    state, reference = FeatureState(), FeatureState()
    reference.rows_kernel = False
    for event in events[:100]:
        state.observe(event)
        reference.observe(event)
    assert state._kernel() is not None
    state._i64 = np.asfortranarray(state._i64)
    assert state._kernel() is None
    for event in events[100:150]:
        state.observe(event)
        reference.observe(event)
    hashes = reference.tracked_hashes()
    now = reference.clock_ms + 1_000
    np.testing.assert_array_equal(
        state.features_for(hashes, now), reference.features_for(hashes, now)
    )
    state._i64 = np.ascontiguousarray(state._i64)
    assert state._kernel() is not None
    for event in events[150:]:
        state.observe(event)
        reference.observe(event)
    _assert_same_state(state, reference)
