"""Held-out replays side by side (``training.replay_pool``): worker processes give the
figures the serial path gives, a pool that cannot do a job leaves it to the serial
path, and the worker count follows ``KVWARM_REPLAY_WORKERS``."""

from __future__ import annotations

import copy
import logging
import os

import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from predictor.baselines import LRUPolicy
from predictor.registry import make_policy
from training.replay import distinct_blocks, split_events
from training.replay_pool import (
    MIN_PARALLEL_ACCESSES,
    STATS,
    WORKERS_ENV,
    planned_workers,
    replay_hit_ratios,
    usable_cpus,
)
from training.train import fit_policy_on_events


@pytest.fixture(scope="module")
def chat():
    rows = generate(params_for("chat", num_requests=900, seed=3))
    events = [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]
    warm, holdout = split_events(events, 0.6)
    # Quick fit, chain model and blend choice as the replay's training does.
    learned = fit_policy_on_events("lightgbm", warm, horizon_ms=60_000, quick=True)
    return learned, warm, holdout


def _warmed(learned, warm):
    policies = [learned.fresh_copy(), make_policy("lru"), make_policy("lfu")]
    for policy in policies:
        policy.observe_many(warm)
    return policies


def test_workers_give_the_serial_figures_and_leave_the_policies_as_they_were(chat, monkeypatch):
    learned, warm, holdout = chat
    policies = _warmed(learned, warm)
    n = distinct_blocks(holdout)
    capacities = [max(1, n // 100), n // 20, n // 10]
    assert learned.chain is not None  # the chain model travels too
    probe = np.array(sorted({b for e in warm[-50:] for b in e.block_hashes}), dtype=np.uint64)
    now = holdout[-1].ts_ms
    before = [p.score(probe, now).tolist() for p in policies]
    monkeypatch.setenv(WORKERS_ENV, "1")
    serial = replay_hit_ratios(policies, holdout, capacities)
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert planned_workers(9, 10) == 2
    done = STATS.in_workers
    parallel = replay_hit_ratios(policies, holdout, capacities)
    assert STATS.in_workers == done + 9  # every job ran in a worker
    print(f"\nserial {serial}\nworkers {parallel}")
    assert parallel == serial  # exactly: the same states, the same seeded planners
    assert len({tuple(row) for row in serial}) == 3  # three policies, three figures
    assert [p.score(probe, now).tolist() for p in policies] == before


def test_a_policy_that_cannot_travel_is_replayed_here(chat, monkeypatch, caplog):
    learned, warm, holdout = chat
    policies = _warmed(learned, warm)
    n = distinct_blocks(holdout)
    monkeypatch.setenv(WORKERS_ENV, "1")
    serial = replay_hit_ratios(policies, holdout, [n // 20])
    policies[1].unpicklable = lambda: None  # a lambda does not pickle
    monkeypatch.setenv(WORKERS_ENV, "2")
    with caplog.at_level(logging.WARNING, logger="training.replay_pool"):
        figures = replay_hit_ratios(policies, holdout, [n // 20])
    assert figures == serial
    assert "serially" in caplog.text, caplog.text


class _DiesInAWorker(LRUPolicy):
    """Unpickling it ends the process: a worker killed mid-job."""

    def __reduce__(self):
        return (os._exit, (3,))

    def __deepcopy__(self, memo):
        clone = LRUPolicy.__new__(type(self))
        clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        return clone


def test_a_worker_that_dies_leaves_its_jobs_to_this_process(chat, monkeypatch, caplog):
    _, warm, holdout = chat
    n = distinct_blocks(holdout)
    capacities = [n // 20, n // 10]
    policies = [make_policy("lfu"), _DiesInAWorker()]
    for policy in policies:
        policy.observe_many(warm)
    monkeypatch.setenv(WORKERS_ENV, "1")
    serial = replay_hit_ratios(policies, holdout, capacities)
    monkeypatch.setenv(WORKERS_ENV, "2")
    here = STATS.here
    with caplog.at_level(logging.WARNING, logger="training.replay_pool"):
        figures = replay_hit_ratios(policies, holdout, capacities)
    assert figures == serial
    assert STATS.here >= here + 2  # at least the dying policy's two jobs
    assert "replay worker stopped" in caplog.text, caplog.text
    # The next call starts fresh workers in place of the dead ones.
    done = STATS.in_workers
    assert replay_hit_ratios(policies[:1], holdout, capacities) == serial[:1]
    assert STATS.in_workers == done + 2


def test_the_worker_count_follows_the_setting_and_the_size(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert planned_workers(12, MIN_PARALLEL_ACCESSES - 1) == 0  # too short to pay
    expected = min(12, usable_cpus())
    assert planned_workers(12, MIN_PARALLEL_ACCESSES) == (expected if expected >= 2 else 0)
    assert planned_workers(1, 10**9) == 0  # one job: here
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert planned_workers(12, 10**9) == 0
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert planned_workers(12, 10) == 3
    assert planned_workers(2, 10) == 2
    for bad in ("two", "0"):
        monkeypatch.setenv(WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=WORKERS_ENV):
            planned_workers(12, 10)
