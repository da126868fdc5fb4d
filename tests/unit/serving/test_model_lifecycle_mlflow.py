"""The sidecar against a real MLflow registry (a temporary SQLite tracking store): a
corrupt registered version degrades to LRU; registering a good version and moving the
alias swaps it in while the loop runs, without a restart and without dropping events."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from features.decoders import read_trace
from predictor.registry import make_policy
from serving.serve_cli import Service
from serving.settings import load_settings
from serving.sources import FileSource

pytestmark = pytest.mark.slow

MODEL_NAME = "kvwarm-serve-test"
NUM_EVENTS = 800


def fitted_lightgbm(seed: int = 0):
    policy = make_policy("lightgbm", {"num_boost_round": 5, "seed": seed})
    rng = np.random.default_rng(seed)
    x = rng.random((400, len(policy.feature_names)), dtype=np.float32)
    y = x[:, 0] > 0.5
    return policy.fit(x[:300], y[:300], x[300:], y[300:])


def _register(store_uri: str, seed: int) -> str:
    from training import tracking

    policy = fitted_lightgbm(seed)
    example = np.random.default_rng(seed).random((8, len(policy.feature_names)), dtype=np.float32)
    with tracking.tracked_run("kvwarm-serve-test", uri=store_uri) as run:
        logged = run.log_policy(
            policy,
            example,
            list(policy.feature_names),
            registered_name=MODEL_NAME,
            alias="champion",
        )
    assert logged.version is not None
    return logged.version


def _health(service: Service) -> dict:
    assert service.http is not None
    with urllib.request.urlopen(service.http.url + "/healthz", timeout=10) as response:
        return json.loads(response.read())


def test_alias_move_recovers_from_a_corrupt_version_without_restart(tmp_path, small_trace):
    store = tmp_path / "mlruns"
    store_uri = f"sqlite:///{store / 'mlflow.db'}"
    _register(store_uri, seed=1)
    corrupted = list((store / "mlartifacts").rglob("model.txt"))
    assert corrupted, "the logged model's files should be in the local artifact store"
    for path in corrupted:
        path.write_text("not a LightGBM model")

    settings = load_settings(
        None,
        source=f"file:{small_trace}",
        model=f"models:/{MODEL_NAME}@champion",
        model_fallback="lru",
        mlflow_tracking_uri=store_uri,
        model_poll_interval_s=0.5,
        batch_size=50,
        tier_capacities_blocks=(256, 2048, 65536),
        decisions=(f"file:{tmp_path / 'decisions.jsonl'}",),
        clock="event",
        http_port=0,
    )
    gate = threading.Event()  # set once the good version serves

    class GatedSource(FileSource):
        """Holds events back after the first 300 until the swap, so the swap happens
        while the loop runs (outside the sidecar's lock, as a slow Kafka would)."""

        def poll(self, max_events: int, timeout_ms: int = 0):
            if self.num_events >= 300:
                gate.wait(timeout=120)
            return super().poll(max_events, timeout_ms)

    service = Service(settings, source=GatedSource(small_trace)).start()
    policies_seen: list[str] = []
    service.sidecar.hooks.append(
        lambda e, m, now: policies_seen.append(service.sidecar.policy.name)
    )
    try:
        health = _health(service)
        assert health["status"] == "degraded" and health["policy"] == "lru"
        assert "model.txt" in health["reason"]

        # The loop runs (and is held at 300 events) while the good version is registered.
        runner = threading.Thread(target=service.run, kwargs={"max_events": NUM_EVENTS})
        runner.start()
        version = _register(store_uri, seed=2)  # a good version; the alias moves to it
        deadline = time.monotonic() + 60
        while _health(service)["status"] != "ok":
            assert time.monotonic() < deadline, _health(service)
            time.sleep(0.1)
        health = _health(service)
        gate.set()
        runner.join(timeout=300)
    finally:
        gate.set()
        service.close()
    assert health["policy"] == "lightgbm" and health["reason"] == ""
    assert version == "2"
    assert service.models.num_swaps == 1
    # Served with LRU, then with the new model, every event handled once.
    # A learned model is served behind the online guard (on by default).
    assert policies_seen[0] == "lru" and policies_seen[-1] == "guarded"
    # run(max_events=N) stops after the batch that reaches N.
    assert NUM_EVENTS <= service.sidecar.stats.events <= len(list(read_trace(small_trace)))
    rows = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in rows} == {"lru", "lightgbm"}
