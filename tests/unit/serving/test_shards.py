"""State per partition, checkpointed and restored (issue 18: state that survives).

A "clean run" handles every event of a two-partition stream once. A "killed run" is
stopped at random points, rebuilt from nothing but the changelog, and resumes each
partition at its snapshot's position, as a restarted sidecar does. The decision ids
must be the same set, for every policy the sidecar serves.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from features.decoders import read_trace
from features.events import BlocksAccessed, Event
from predictor.base import Policy
from predictor.guard import guarded
from predictor.registry import make_policy
from serving.checkpoint import (
    CheckpointMismatchError,
    NotCheckpointableError,
    capture,
    check_checkpointable,
    fresh_policy,
    restore,
)
from serving.decisions import DecisionMaker
from serving.loop import Sidecar
from serving.model_lifecycle import ScoringFallback
from serving.placement import Placement
from serving.planner import Planner, PlannerParams
from serving.shards import ShardedState
from serving.state_store import MemoryChangelog, StateStore, decode_state, encode_state

TIERS = ["hbm", "dram", "nvme"]
CAPS = [48, 192, 768]


class ListSink:
    def __init__(self) -> None:
        self.ids: list[str] = []

    def emit(self, decisions) -> None:
        self.ids += [d.decision_id for d in decisions]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _lightgbm() -> Policy:
    policy = make_policy(
        "lightgbm", {"num_boost_round": 4, "seed": 0, "min_data_in_leaf": 5, "num_leaves": 4}
    )
    rng = np.random.default_rng(0)
    x = rng.random((400, len(policy.feature_names)), dtype=np.float32)
    y = x[:, 0] > 0.5
    return policy.fit(x[:300], y[:300], x[300:], y[300:])


def _served_lightgbm() -> Policy:
    """As ``serve`` serves a learned model: the scoring fallback inside the online guard."""
    return guarded(ScoringFallback(_lightgbm(), lambda guard, why: make_policy("lru")), CAPS[0])


POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": lambda: make_policy("lru"),
    "lfu": lambda: make_policy("lfu"),
    "prefix_lru": lambda: make_policy("prefix_lru"),
    "lightgbm_guarded": _served_lightgbm,
}


class World:
    """One sidecar process: loop, decision maker, shards over a changelog."""

    def __init__(self, policy: Policy, store: StateStore, *, background: bool = False) -> None:
        placement = Placement(TIERS, CAPS)
        self.sidecar = Sidecar(policy, Planner(), placement, prefetch_interval_ms=500)
        self.sink = ListSink()
        self.decisions = DecisionMaker(
            TIERS, self.sink, lambda: (policy.name, "1"), placement=placement
        )
        self.sidecar.hooks.append(self.decisions)
        self.shards = ShardedState(
            self.sidecar,
            self.decisions,
            store,
            planner_params=PlannerParams(),
            fingerprint={"tiers": TIERS, "caps": CAPS},
            interval_s=0,
            background=background,
        )

    def handle(self, key: str, event: Event) -> None:
        self.shards.activate(key)
        self.sidecar.handle(event)


def _stream(trace: Path, n: int) -> list[tuple[str, Event]]:
    """The trace's first ``n`` events split over two partitions by prefix root (the
    way the bridge keys them)."""
    out = []
    for event in read_trace(trace):
        if len(out) >= n:
            break
        if isinstance(event, BlocksAccessed) and event.block_hashes:
            out.append((f"g/t/{event.block_hashes[0] % 2}", event))
    return out


def _clean_run(factory: Callable[[], Policy], stream) -> list[str]:
    world = World(factory(), StateStore(MemoryChangelog()))
    for key, event in stream:
        world.handle(key, event)
    return world.sink.ids


def _killed_run(
    factory: Callable[[], Policy], stream, kills: Sequence[int], batch: int = 25
) -> tuple[list[str], int]:
    """Checkpoint every ``batch`` events handled (as a commit does); die after the
    ``kills[n]``-th event handled (before its batch is checkpointed) and restart from
    the changelog alone. Returns every id emitted and how many events were handled
    again."""
    store = StateStore(MemoryChangelog())
    by_key: dict[str, list[int]] = {}
    for i, (key, _) in enumerate(stream):
        by_key.setdefault(key, []).append(i)
    index_in_partition = {i: n for idxs in by_key.values() for n, i in enumerate(idxs)}
    ids: list[str] = []
    world = World(factory(), store)
    world.shards.on_assigned(sorted(by_key))
    pending = list(range(len(stream)))  # what the source will deliver, in order
    position: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    handled = handled_again = 0
    kills = sorted(kills)
    while pending:
        i = pending.pop(0)
        key, event = stream[i]
        world.handle(key, event)
        handled += 1
        handled_again += i in seen
        seen.add(i)
        position[key] = (index_in_partition[i] + 1, 0)
        if kills and handled == kills[0]:
            kills.pop(0)
            ids += world.sink.ids
            world = World(factory(), StateStore(store.changelog))  # a new process
            seek = world.shards.on_assigned(sorted(by_key))
            start = {k: seek[k][0] if k in seek else 0 for k in by_key}
            pending = sorted(j for k, idxs in by_key.items() for j in idxs[start[k] :])
            position = {}
        elif handled % batch == 0:
            world.shards.checkpoint(position)
    ids += world.sink.ids
    return ids, handled_again


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_restarts_from_the_changelog_emit_the_clean_runs_decision_ids(small_trace, name):
    stream = _stream(small_trace, 600)
    clean = _clean_run(POLICIES[name], stream)
    assert len(set(clean)) > 100, "the stream must cause decisions to compare"
    kills = random.Random(7).sample(range(30, 700), 10)
    ids, handled_again = _killed_run(POLICIES[name], stream, kills)
    print(f"{name}: {len(set(clean))} decision ids; 10 kills, {handled_again} events handled again")
    # The kills lost un-checkpointed work, and only that: each restart resumed from a
    # snapshot (at most one batch of 25 events back), not from the start.
    assert 0 < handled_again < 10 * 25
    assert set(ids) == set(clean)


def test_a_partition_gives_the_same_decisions_whichever_sidecar_holds_it(small_trace):
    """Assignment independence: both partitions in one sidecar, or one each."""
    stream = _stream(small_trace, 400)
    together = set(_clean_run(POLICIES["lightgbm_guarded"], stream))
    apart: set[str] = set()
    for key in ("g/t/0", "g/t/1"):
        apart |= set(_clean_run(POLICIES["lightgbm_guarded"], [s for s in stream if s[0] == key]))
    assert together == apart


def test_a_snapshot_round_trips_through_bytes_and_restores_the_same_state(small_trace):
    policy = _served_lightgbm()
    events = [e for _, e in _stream(small_trace, 200)]
    for event in events:
        policy.observe(event)
    tree = decode_state(encode_state(capture(policy)))
    copy = fresh_policy(policy)
    restore(copy, tree)
    hashes = np.array(sorted({b for e in events for b in e.block_hashes})[:300], dtype=np.uint64)
    now = events[-1].ts_ms + 1000
    np.testing.assert_array_equal(policy.score(hashes, now), copy.score(hashes, now))
    assert copy.chosen == policy.chosen


def test_a_snapshot_of_another_structure_is_refused_not_half_restored():
    lru = make_policy("lru")
    with pytest.raises(CheckpointMismatchError, match="LRUPolicy"):
        restore(make_policy("lfu"), capture(lru))


def test_a_policy_without_declared_state_cannot_be_served_with_state():
    class Opaque(Policy):
        name = "opaque"

        def observe(self, event):
            pass

        def score(self, block_hashes, now_ms):
            return np.zeros(len(block_hashes), dtype=np.float32)

    with pytest.raises(NotCheckpointableError, match="Opaque"):
        check_checkpointable(Opaque())


def test_a_snapshot_taken_with_other_tiers_starts_the_shard_empty(small_trace):
    store = StateStore(MemoryChangelog())
    world = World(make_policy("lru"), store)
    for key, event in _stream(small_trace, 50):
        world.handle(key, event)
    world.shards.checkpoint({"g/t/0": (10, 0), "g/t/1": (10, 0)})
    other = World(make_policy("lru"), StateStore(store.changelog))
    other.shards.fingerprint = {"tiers": TIERS, "caps": [1, 2, 3]}
    assert other.shards.on_assigned(["g/t/0", "g/t/1"]) == {}
    assert other.shards.stats.restore_mismatches == 2


def test_background_snapshots_hold_the_state_of_their_commit_not_later(small_trace):
    """Later snapshots are copied in the loop and written by a thread: what is written
    is the state at the checkpoint, even though the loop goes on changing it; the
    first snapshot of a shard is written before checkpoint() returns."""
    import threading

    class GatedStore(StateStore):
        """Writes from the writer thread wait for ``gate``: the loop changes the state
        first, so a snapshot that shared the loop's arrays would show it."""

        gate = threading.Event()

        def save(self, key, tree):
            if threading.current_thread() is not threading.main_thread():
                assert self.gate.wait(30)
            return super().save(key, tree)

    stream = _stream(small_trace, 300)
    store = GatedStore(MemoryChangelog())
    world = World(make_policy("lru"), store, background=True)
    for key, event in stream[:100]:
        world.handle(key, event)
    world.shards.checkpoint({"g/t/0": (1, 0), "g/t/1": (1, 0)})
    assert world.shards._writer is None  # first snapshots: written in the loop
    assert store.load("g/t/0") is not None
    for key, event in stream[100:200]:
        world.handle(key, event)
    world.shards.checkpoint({"g/t/0": (2, 0), "g/t/1": (2, 0)})
    expected = decode_state(
        encode_state(world.shards.snapshot(world.shards.shards["g/t/0"], (2, 0)))
    )
    for key, event in stream[200:]:  # the loop goes on while the writer waits
        world.handle(key, event)
    assert not world.shards.drain(timeout_s=0.05)  # still held at the gate
    store.gate.set()
    assert world.shards.drain(timeout_s=30)
    world.shards.close()
    tree = store.load("g/t/0")
    assert tree["position"] == [2, 0]
    np.testing.assert_array_equal(
        tree["policy"]["_table"]["v"]["last_access"],
        expected["policy"]["_table"]["v"]["last_access"],
    )
    assert encode_state(tree) == encode_state(expected)
