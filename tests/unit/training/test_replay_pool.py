"""Held-out replays side by side (``training.replay_pool``): worker processes give the
figures the serial path gives, a pool that cannot do a job leaves it to the serial
path, and the worker count follows ``KVWARM_REPLAY_WORKERS``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from predictor.registry import make_policy
from training import replay_pool
from training.dataset import build_dataset
from training.replay import distinct_blocks, split_events
from training.replay_pool import (
    MIN_PARALLEL_ACCESSES,
    STATS,
    WORKERS_ENV,
    JobRunner,
    _hit_ratio,
    planned_workers,
    replay_hit_ratios,
    usable_cpus,
)
from training.train import choose_horizon, fit_policy_on_events, quick_model_params


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
    capacities = [n // 20, n // 10]  # the same state twice: each replay on a copy
    monkeypatch.setenv(WORKERS_ENV, "1")
    serial = replay_hit_ratios(policies, holdout, capacities)
    policies[1].unpicklable = lambda: None  # a lambda does not pickle
    monkeypatch.setenv(WORKERS_ENV, "2")
    with caplog.at_level(logging.WARNING, logger="training.replay_pool"):
        figures = replay_hit_ratios(policies, holdout, capacities)
    assert figures == serial
    assert "run here instead" in caplog.text and "not sent" in caplog.text, caplog.text


def test_workers_killed_mid_run_leave_their_jobs_to_this_process(chat, monkeypatch, caplog):
    _, warm, holdout = chat
    n = distinct_blocks(holdout)
    capacities = [n // 20, n // 10]
    policies = [make_policy("lfu"), make_policy("lru2")]
    for policy in policies:
        policy.observe_many(warm)
    monkeypatch.setenv(WORKERS_ENV, "1")
    serial = replay_hit_ratios(policies, holdout, capacities)
    here = STATS.here
    with (
        caplog.at_level(logging.WARNING, logger="training.replay_pool"),
        JobRunner(2) as runner,
    ):
        assert runner.parallel
        trace = runner.share(holdout)
        jobs = [
            runner.submit(_hit_ratio, runner.own(p), trace, c) for p in policies for c in capacities
        ]
        for worker in list(replay_pool._WORKERS):
            worker.proc.kill()
        figures = [job.result() for job in jobs]
    assert figures == [v for row in serial for v in row]
    assert STATS.here > here  # what the dead workers held ran here
    assert "replay worker stopped" in caplog.text, caplog.text
    # The next call starts fresh workers in place of the dead ones.
    monkeypatch.setenv(WORKERS_ENV, "2")
    done = STATS.in_workers
    assert replay_hit_ratios(policies[:1], holdout, capacities) == serial[:1]
    assert STATS.in_workers == done + 2


def test_workers_import_this_checkout_whatever_the_working_directory(chat, monkeypatch, tmp_path):
    """``python -m`` would put the working directory first on the path: a directory
    holding another ``training`` package (another checkout) must not be what a worker
    imports. Workers start with ``-P``."""
    _, warm, holdout = chat
    decoy = tmp_path / "training"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("")
    (decoy / "replay_pool.py").write_text("raise SystemExit('the decoy checkout was imported')\n")
    policies = [make_policy("lfu")]
    policies[0].observe_many(warm)
    n = distinct_blocks(holdout)
    capacities = [n // 20, n // 10]
    monkeypatch.setenv(WORKERS_ENV, "1")
    serial = replay_hit_ratios(policies, holdout, capacities)
    replay_pool._close_pool(kill=True)  # fresh workers next, started from tmp_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(WORKERS_ENV, "2")
    done = STATS.in_workers
    assert replay_hit_ratios(policies, holdout, capacities) == serial
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


def test_workers_end_with_the_process_that_started_them(tmp_path):
    """A SIGKILLed trainer (no exit handler runs) leaves no worker replaying on."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, time\n"
        "from training import replay_pool\n"
        "with replay_pool.JobRunner(2) as runner:\n"
        "    print(*(w.proc.pid for w in replay_pool._WORKERS), flush=True)\n"
        "    runner.submit(time.sleep, 60)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, WORKERS_ENV: "2"}
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(0.5)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_the_horizon_choice_fits_on_workers_as_it_does_here(monkeypatch):
    """The quick fits of ``choose_horizon`` as jobs: the same trees, figures and choice."""
    rows = generate(params_for("agent", num_requests=500, seed=2))
    events = [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]
    dataset = build_dataset(events, horizons_ms=(2_000, 60_000))
    cut = events[int(len(events) * 0.6)].ts_ms
    train = dataset.take(np.flatnonzero(dataset.ts_ms <= cut), end_ts_ms=cut)
    valid = dataset.take(np.flatnonzero(dataset.ts_ms > cut))
    warm, holdout = split_events(events, 0.75)
    choices = {}
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        done = STATS.in_workers
        choices[workers] = choose_horizon(
            "lightgbm", train, valid, warm, holdout, model_params=quick_model_params("lightgbm")
        )
        ran_there = STATS.in_workers - done
        assert ran_there == (0 if workers == "1" else 2 + 2 * 3)  # 2 fits, 6 replays
    here, there = choices["1"], choices["2"]
    assert (there.horizon_ms, there.note, there.hit_ratios) == (
        here.horizon_ms,
        here.note,
        here.hit_ratios,
    )
    probe = train.X[:500]
    assert np.array_equal(there.policy.predict_features(probe), here.policy.predict_features(probe))


def test_a_job_that_raises_in_a_worker_raises_in_the_caller(caplog):
    with caplog.at_level(logging.WARNING, logger="training.replay_pool"), JobRunner(2) as runner:
        assert runner.parallel
        job = runner.submit(int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            job.result()
        assert runner.submit(int, "42").result() == 42
    assert "ValueError" in caplog.text, caplog.text  # what the worker said
