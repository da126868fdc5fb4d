"""Models are validated before they serve and guarded while they do (issue 18)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from predictor.lightgbm_policy import LightGBMPolicy
from predictor.registry import make_policy
from serving.loop import Sidecar
from serving.model_lifecycle import ModelManager, ScoringFallback
from serving.placement import Placement
from serving.planner import Planner


def _fitted(seed: int = 0) -> LightGBMPolicy:
    policy = make_policy(
        "lightgbm", {"num_boost_round": 3, "seed": seed, "min_data_in_leaf": 5, "num_leaves": 4}
    )
    rng = np.random.default_rng(seed)
    x = rng.random((400, len(policy.feature_names)), dtype=np.float32)
    y = x[:, 0] > 0.5
    return policy.fit(x[:300], y[:300], x[300:], y[300:])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _fitted().save(tmp_path_factory.mktemp("m") / "lightgbm")


def _sidecar(manager: ModelManager) -> Sidecar:
    sidecar = Sidecar(manager.load_initial(), Planner(), Placement(["hbm", "dram"], [8, 64]))
    manager.attach(sidecar)
    return sidecar


def _events(n: int, start: int = 0):
    from features.events import BlocksAccessed

    return [
        BlocksAccessed(
            ts_ms=i, request_id=str(i), block_hashes=(i % 97, 1000 + i), block_size_tokens=16
        )
        for i in range(start, start + n)
    ]


def test_a_model_whose_probe_hangs_is_refused_and_lru_serves(saved, monkeypatch):
    def hang(self, features):
        time.sleep(3)
        return np.zeros(features.shape[0])

    monkeypatch.setattr(LightGBMPolicy, "_predict", hang)
    manager = ModelManager(str(saved), probe_timeout_s=0.2)
    assert manager.load_initial().name == "lru"
    assert manager.status.degraded == "refused"
    assert "did not finish in 0.2 s" in manager.status.reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1.5, -0.1])
def test_a_model_with_unusable_probe_scores_is_refused(saved, monkeypatch, bad):
    monkeypatch.setattr(
        LightGBMPolicy, "_predict", lambda self, f: np.full(f.shape[0], bad, dtype=np.float64)
    )
    manager = ModelManager(str(saved))
    assert manager.load_initial().name == "lru"
    assert manager.status.degraded == "refused" and "probe scores" in manager.status.reason


def test_a_hot_swap_that_fails_its_probe_keeps_the_serving_model(saved, tmp_path, monkeypatch):
    path = tmp_path / "model"
    shutil.copytree(saved, path)
    manager = ModelManager(str(path))
    sidecar = _sidecar(manager)
    good = manager.status.version
    _fitted(seed=3).save(path)
    monkeypatch.setattr(LightGBMPolicy, "_predict", lambda self, f: np.full(f.shape[0], np.nan))
    assert manager.check_for_update() is False
    assert manager.status.version == good and manager.status.status == "ok"
    assert "nan" in manager.status.last_error
    assert sidecar.policy.name == "lightgbm"


def test_nan_scores_at_run_time_switch_to_lru_and_degrade(saved, monkeypatch):
    manager = ModelManager(str(saved), warmup_requests=50)
    sidecar = _sidecar(manager)
    events = _events(300)
    for event in events[:100]:
        sidecar.handle(event)
    assert manager.status.status == "ok"
    monkeypatch.setattr(LightGBMPolicy, "_predict", lambda self, f: np.full(f.shape[0], np.nan))
    for event in events[100:]:
        sidecar.handle(event)  # never raises, never sees a nan
    assert sidecar.stats.events == 300
    assert manager.status.degraded == "scoring_failed" and manager.status.policy == "lru"
    assert isinstance(sidecar.policy, ScoringFallback) and sidecar.policy.active.name == "lru"
    assert sidecar.policy.num_failures == 1


def test_a_score_that_raises_at_run_time_switches_to_lru(saved, monkeypatch):
    manager = ModelManager(str(saved))
    sidecar = _sidecar(manager)

    def boom(self, features):
        raise OverflowError("int too large")

    monkeypatch.setattr(LightGBMPolicy, "_predict", boom)
    for event in _events(200):
        sidecar.handle(event)
    assert manager.status.degraded == "scoring_failed" and "OverflowError" in manager.status.reason


def test_the_watchdog_reports_a_stuck_score_call_and_clears_when_it_returns(saved, monkeypatch):
    manager = ModelManager(str(saved), score_timeout_s=0.3)
    sidecar = _sidecar(manager)
    release = threading.Event()
    monkeypatch.setattr(
        LightGBMPolicy, "_predict", lambda self, f: (release.wait(10), np.zeros(f.shape[0]))[1]
    )
    manager.start_watchdog(interval_s=0.05)
    worker = threading.Thread(target=lambda: [sidecar.handle(e) for e in _events(50)])
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while manager.status.degraded != "scoring_stuck" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.status.degraded == "scoring_stuck"
        assert "more than 0.3 s" in manager.status.reason
    finally:
        release.set()
        worker.join(10)
    deadline = time.monotonic() + 5
    while manager.status.degraded is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.status.status == "ok"
    manager.stop()


def test_lstm_with_nan_weights_or_zero_std_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    policy = make_policy("lstm", {"max_epochs": 1})
    rng = np.random.default_rng(0)
    x = rng.random((200, len(policy.feature_names)), dtype=np.float32)
    y = x[:, 0] > 0.5
    policy.fit(x[:150], y[:150], x[150:], y[150:])
    for name in ("nan", "std0"):
        directory = policy.save(tmp_path / name)
        state = torch.load(directory / "weights.pt", weights_only=True)
        if name == "nan":
            weight = next(v for k, v in state.items() if "weight" in k)
            weight.view(-1)[0] = float("nan")
        else:
            state["context_std"].zero_()
        torch.save(state, directory / "weights.pt")
        manager = ModelManager(str(directory))
        assert manager.load_initial().name == "lru"
        reason = manager.status.reason
        assert manager.status.degraded == "load_failed", reason
        assert ("nan or inf" in reason) if name == "nan" else ("std <= 0" in reason)
