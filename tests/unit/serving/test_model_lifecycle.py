from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from features.decoders import read_trace
from predictor.registry import make_policy
from serving.loop import Sidecar
from serving.model_lifecycle import ModelManager
from serving.placement import Placement
from serving.planner import Planner


def fitted_lightgbm(seed: int = 0):
    """A real LightGBM policy fitted on synthetic rows: enough to load, save and score."""
    policy = make_policy("lightgbm", {"num_boost_round": 5, "seed": seed})
    rng = np.random.default_rng(seed)
    x = rng.random((400, len(policy.feature_names)), dtype=np.float32)
    y = x[:, 0] > 0.5
    return policy.fit(x[:300], y[:300], x[300:], y[300:])


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    return fitted_lightgbm().save(tmp_path_factory.mktemp("model") / "lightgbm")


def _sidecar(policy) -> Sidecar:
    return Sidecar(policy, Planner(), Placement(["hbm", "dram"], [64, 512]))


def test_a_baseline_name_serves_that_baseline():
    manager = ModelManager("lfu")
    policy = manager.load_initial()
    assert policy.name == "lfu"
    assert manager.status.status == "ok" and manager.status.version == "builtin"
    assert manager.check_for_update() is False


def test_a_saved_model_loads_by_directory_or_by_file(saved_model):
    for spec in (saved_model, saved_model / "model.txt"):
        manager = ModelManager(str(spec))
        assert manager.load_initial().name == "lightgbm"
        assert manager.status.degraded is None
        assert manager.status.version.startswith("sha-")


def test_a_corrupt_model_file_falls_back_to_lru_with_the_reason(saved_model, tmp_path):
    broken = tmp_path / "broken"
    fitted_lightgbm().save(broken)
    (broken / "model.txt").write_text("this is not a LightGBM model\n")
    manager = ModelManager(str(broken))
    policy = manager.load_initial()
    assert policy.name == "lru"
    status = manager.status
    assert status.status == "degraded" and status.degraded == "load_failed"
    assert "model.txt" in status.reason and "LightGBM" in status.reason


def test_a_feature_version_mismatch_is_named(tmp_path):
    old = tmp_path / "old"
    fitted_lightgbm().save(old)
    manifest = json.loads((old / "policy.json").read_text())
    manifest["feature_version"] = -1
    (old / "policy.json").write_text(json.dumps(manifest))
    manager = ModelManager(str(old))
    assert manager.load_initial().name == "lru"
    assert manager.status.degraded == "feature_version_mismatch"
    assert "retrain" in manager.status.reason


@pytest.mark.parametrize(
    ("spec", "kind", "words"),
    [
        ("lightgbm", "load_failed", "needs a trained model"),
        ("oracle", "refused", "future"),
        ("no/such/dir", "load_failed", "no such file"),
    ],
)
def test_unservable_specs_degrade(spec, kind, words):
    manager = ModelManager(spec)
    assert manager.load_initial().name == "lru"
    assert manager.status.degraded == kind and words in manager.status.reason


def test_fixing_the_model_on_disk_swaps_it_in_without_dropping_events(small_trace, tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "policy.json").write_text("{not json")
    manager = ModelManager(str(path), warmup_requests=200)
    sidecar = _sidecar(manager.load_initial())
    manager.attach(sidecar)
    assert manager.status.status == "degraded"
    events = list(read_trace(small_trace))[:600]
    for event in events[:300]:
        sidecar.handle(event)
    assert manager.check_for_update() is False  # still broken: stays on LRU

    fitted_lightgbm().save(path)
    assert manager.check_for_update() is True
    assert sidecar.policy.name == "lightgbm" and manager.status.status == "ok"
    # Warmed with the recent requests, not scoring from a cold start.
    assert sidecar.policy.state.num_tracked > 0
    for event in events[300:]:
        sidecar.handle(event)
    assert sidecar.stats.events == 600
    assert manager.num_swaps == 1 and manager.check_for_update() is False


def test_a_broken_new_version_keeps_the_good_one(saved_model, tmp_path):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(saved_model, path)
    manager = ModelManager(str(path))
    sidecar = _sidecar(manager.load_initial())
    manager.attach(sidecar)
    good = manager.status.version
    (path / "model.txt").write_text("garbage")
    assert manager.check_for_update() is False
    assert sidecar.policy.name == "lightgbm" and manager.status.version == good
    assert manager.status.status == "ok" and "model.txt" in manager.status.last_error
    # The same broken bytes are not parsed (and reported) again at every poll.
    assert manager.check_for_update() is False
    assert manager.num_failed_reloads == 1


def test_learned_to_learned_swap_shares_the_feature_state(saved_model, tmp_path, small_trace):
    path = tmp_path / "model"
    fitted_lightgbm(seed=1).save(path)
    manager = ModelManager(str(path))
    sidecar = _sidecar(manager.load_initial())
    manager.attach(sidecar)
    for event in list(read_trace(small_trace))[:100]:
        sidecar.handle(event)
    state = sidecar.policy.state
    fitted_lightgbm(seed=2).save(path)  # a new version lands at the same path
    assert manager.check_for_update() is True
    assert sidecar.policy.state is state


def test_alias_polls_look_up_the_version_and_download_only_when_it_changes(saved_model):
    import shutil

    from serving.model_lifecycle import Resolver

    class Registry(Resolver):
        """An alias that names version 1, later 2; counts downloads."""

        def __init__(self) -> None:
            self.current = "1"
            self.downloads: list[str] = []

        def version(self, uri: str) -> str:
            return self.current

        def download(self, uri: str, scratch: Path) -> Path:
            self.downloads.append(self.current)
            return Path(shutil.copytree(saved_model, scratch / "policy"))

    registry = Registry()
    manager = ModelManager("models:/kv@champion", resolver=registry)
    manager.load_initial(fallback=False)
    status = manager.status
    assert (status.name, status.alias, status.version) == ("kv", "champion", "1")
    for _ in range(3):
        assert manager.check_for_update() is False
    assert registry.downloads == ["1"]  # three polls, no download
    registry.current = "2"
    assert manager.check_for_update() is True
    assert registry.downloads == ["1", "2"] and manager.status.version == "2"


def test_a_model_trained_on_a_stretched_trace_is_refused(tmp_path):
    from serving.model_lifecycle import ModelStartError

    policy = fitted_lightgbm()
    policy.training_info["time_base"] = {"unit": "ms", "clock": "event", "time_scale": 2.31}
    directory = policy.save(tmp_path / "replay-model")
    assert json.loads((directory / "policy.json").read_text())["time_base"]["time_scale"] == 2.31
    with pytest.raises(ModelStartError, match="stretched x2.31"):
        ModelManager(str(directory)).load_initial(fallback=False)
    unscaled = fitted_lightgbm().save(tmp_path / "trained")
    assert ModelManager(str(unscaled)).load_initial(fallback=False).name == "lightgbm"


def test_serving_sets_the_score_age_of_learned_models_only(saved_model):
    assert ModelManager(str(saved_model)).load_initial().params.score_max_age_ms == 0
    served = ModelManager(str(saved_model), score_max_age_ms=10_000).load_initial()
    assert served.params.score_max_age_ms == 10_000
    assert ModelManager("lru", score_max_age_ms=10_000).load_initial().name == "lru"
