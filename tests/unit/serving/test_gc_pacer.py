"""The paced collector: no full collection inside a batch, garbage still freed."""

from __future__ import annotations

import gc
import weakref

import pytest

from serving.gc_pacer import NEVER, GcPacer


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class _Node:
    """A cycle: freed only by the cyclic collector, never by reference counts."""

    def __init__(self) -> None:
        self.me = self


def _refreezing(clock: _Clock) -> GcPacer:
    """A pacer whose refreeze comes due within a test (100 s of fake clock)."""
    return GcPacer(idle_interval_s=1.0, max_interval_s=10.0, refreeze_interval_s=100.0, clock=clock)


@pytest.fixture
def clean_collector():
    gc.unfreeze()
    before = gc.get_threshold()
    yield before
    gc.unfreeze()
    gc.set_threshold(*before)


def _full_collections_during(fn) -> int:
    seen: list[int] = []

    def cb(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(cb)
    try:
        fn()
    finally:
        gc.callbacks.remove(cb)
    return len(seen)


def test_no_full_collection_runs_by_itself_while_paced_and_the_collector_comes_back(
    clean_collector,
):
    pacer = GcPacer(clock=_Clock())
    pacer.start()
    assert gc.get_threshold()[2] == NEVER
    assert gc.get_freeze_count() > 0  # what was alive at start
    kept: list[list[int]] = []
    # Enough surviving containers that CPython's own schedule collects in full, many times.
    assert _full_collections_during(lambda: kept.extend([i] for i in range(300_000))) == 0
    pacer.stop()
    assert gc.get_threshold() == clean_collector
    assert gc.get_freeze_count() == 0
    assert _full_collections_during(lambda: kept.extend([i] for i in range(300_000))) > 0


def test_collections_come_when_idle_or_at_the_latest_after_max_interval(clean_collector):
    clock = _Clock()
    pacer = GcPacer(idle_interval_s=2.0, max_interval_s=60.0, clock=clock)
    pacer.start()
    try:
        assert pacer.num_collections == 1  # the one at start
        clock.now += 1.0
        assert not pacer.tick(idle=True)  # idle, but too soon
        clock.now += 1.5
        assert not pacer.tick(idle=False)  # busy: waits for idle or max_interval
        assert pacer.tick(idle=True)
        clock.now += 59.0
        assert not pacer.tick(idle=False)
        clock.now += 1.0
        assert pacer.tick(idle=False)  # under unbroken load, at max_interval anyway
        assert pacer.num_collections == 3
        status = pacer.status()
        assert status["paced"] and status["collections"] == 3
        assert status["max_pause_ms"] >= status["last_pause_ms"] >= 0.0
    finally:
        pacer.stop()
    assert not pacer.tick(idle=True)  # stopped: nothing more
    assert not pacer.status()["paced"]


def test_a_cycle_that_dies_young_is_freed_at_the_next_tick(clean_collector):
    clock = _Clock()
    pacer = GcPacer(idle_interval_s=1.0, clock=clock)
    pacer.start()
    try:
        node = _Node()
        ref = weakref.ref(node)
        del node
        clock.now += 1.0
        assert pacer.tick(idle=True)
        assert ref() is None
    finally:
        pacer.stop()


def test_a_frozen_cycle_that_dies_later_is_freed_at_the_refreeze(clean_collector):
    clock = _Clock()
    pacer = _refreezing(clock)
    node = _Node()
    ref = weakref.ref(node)
    pacer.start()  # node is alive: frozen
    try:
        del node
        clock.now += 50.0
        assert pacer.tick(idle=True)
        assert ref() is not None  # frozen objects are not walked ...
        clock.now += 50.0
        assert pacer.tick(idle=False)  # refreeze due, but busy: a plain collection
        assert ref() is not None
        assert pacer.num_refreezes == 0
        clock.now += 1.0
        assert pacer.tick(idle=True)  # ... until the refreeze releases them
        assert ref() is None
        assert pacer.num_refreezes == 1
    finally:
        pacer.stop()


def test_under_unbroken_load_the_refreeze_still_comes(clean_collector):
    clock = _Clock()
    pacer = _refreezing(clock)
    pacer.start()
    try:
        for _ in range(19):
            clock.now += 10.0
            pacer.tick(idle=False)
        assert pacer.num_refreezes == 0
        clock.now += 10.0
        pacer.tick(idle=False)  # twice the interval: no longer waits for an idle moment
        assert pacer.num_refreezes == 1
    finally:
        pacer.stop()


def test_pacers_nest_and_the_last_to_stop_restores(clean_collector):
    a, b = GcPacer(clock=_Clock()), GcPacer(clock=_Clock())
    a.start()
    b.start()
    a.stop()
    a.stop()  # twice: no effect
    assert gc.get_threshold()[2] == NEVER
    b.stop()
    assert gc.get_threshold() == clean_collector
    assert gc.get_freeze_count() == 0


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="idle_interval_s"):
        GcPacer(idle_interval_s=5.0, max_interval_s=1.0)
