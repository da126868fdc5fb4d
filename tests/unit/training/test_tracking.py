"""MLflow: a tracked training run against a temporary store, and the model registry."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest

from features.decoders import read_trace
from features.feature_set import FEATURE_VERSION
from features.generator import generate_to_file, params_for
from predictor import PolicyLoadError
from training import tracking
from training.train import TrainConfig, load_events, run_tracked, sha256_of


@pytest.fixture(scope="module")
def allow_file_store():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        yield


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory, allow_file_store):
    root = tmp_path_factory.mktemp("mlflow")
    trace = generate_to_file(
        params_for("planted", num_requests=600, seed=2), root / "planted.jsonl"
    )
    # A file store: a fresh SQLite store spends most of this test in schema migrations.
    # The default store (SQLite) differs only in where MLflow keeps its records.
    uri = (root / "store").as_uri()
    config = TrainConfig(
        model="lightgbm",
        horizon_ms=10_000,
        snapshot_interval_ms=10_000,
        snapshot_blocks=128,
        eval_snapshot_every_ms=60_000,
        model_params={"num_boost_round": 30, "num_leaves": 15},
        baselines=("lru", "oracle"),
    )
    result = run_tracked(
        trace, config, experiment="test-exp", register="kv-test", alias="champion", store_uri=uri
    )
    return result, uri, trace, root


def test_run_has_params_metrics_and_plots(tracked):
    result, uri, trace, _ = tracked
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    params, metrics = run.data.params, run.data.metrics
    assert params["model"] == "lightgbm"
    assert params["feature_version"] == str(FEATURE_VERSION)
    assert params["trace_sha256"] == sha256_of(trace)
    assert params["config.horizon_ms"] == "10000"
    # A given horizon and params: no fit choice was made, and the run says so.
    assert params["fit_choice"] == "none: the horizon or params were given"
    assert params["model.num_leaves"] == "15"
    # Refitted on the training and validation rows with the validated trees, and it says so.
    refit = result.policy.training_info["refit"]
    assert params["refit"] == f"{refit['rows']} rows, {refit['trees']} trees"
    for key in ("roc_auc", "pr_auc", "log_loss", "precision_at_1pct", "recall_at_10pct"):
        assert key in metrics, key
        assert metrics[key] == pytest.approx(result.evaluations["lightgbm"].metrics[key])
    assert metrics["oracle.roc_auc"] == pytest.approx(1.0)
    assert "lru.pr_auc" in metrics and "train_s" in metrics and metrics["model_size_bytes"] > 0
    artifacts = {a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert artifacts == {
        "plots/pr_curve.png",
        "plots/calibration.png",
        "plots/feature_importance.png",
    }
    png = Path(
        mlflow.artifacts.download_artifacts(
            run_id=result.run_id, artifact_path="plots/pr_curve.png", tracking_uri=uri
        )
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_registered_version_has_alias_signature_and_scores_identically(tracked, monkeypatch):
    result, uri, trace, root = tracked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("kv-test", "champion")
    assert str(version.version) == result.registered_version
    assert result.model_uri == "models:/kv-test@champion"

    loaded = tracking.load_policy_uri("models:/kv-test@champion", store_uri=uri)
    original = result.policy.fresh_copy()
    events = load_events(trace)
    loaded.observe_many(events)
    original.observe_many(events)
    blocks = np.unique(
        np.fromiter((h for e in events[-30:] for h in e.block_hashes), dtype=np.uint64)
    )
    now_ms = events[-1].ts_ms
    np.testing.assert_array_equal(loaded.score(blocks, now_ms), original.score(blocks, now_ms))

    # MLflow's own pyfunc loader (model from code, no pickle) gives the same
    # probabilities on feature rows, and the signature names the feature columns.
    model = mlflow.pyfunc.load_model("models:/kv-test@champion")
    names = [c.name for c in model.metadata.get_input_schema().inputs]
    assert names == list(result.policy.feature_names)
    import pandas as pd

    x = original.state.features_for(blocks, now_ms)
    np.testing.assert_allclose(
        np.asarray(model.predict(pd.DataFrame(x, columns=names))),
        original.predict_features(x),
        rtol=1e-6,
    )


def test_default_store_is_the_one_mlflow_ui_opens(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking.ui_command(tracking.tracking_uri()) == (
        "mlflow ui --backend-store-uri sqlite:///mlflow.db"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert tracking.tracking_uri() == "sqlite:///elsewhere.db"


def test_uri_credentials_are_masked():
    assert tracking.masked_uri("https://bob:s3cret@mlflow.example:5000/x") == (
        "https://***@mlflow.example:5000/x"
    )
    assert "s3cret" not in tracking.ui_command("postgresql://bob:s3cret@db/mlflow")


def test_lookup_in_a_missing_store_creates_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'nothing' / 'mlflow.db'}"
    with pytest.raises(PolicyLoadError, match="no MLflow store"):
        tracking.load_policy_uri("models:/kv-test@champion", store_uri=uri)
    with pytest.raises(PolicyLoadError, match="no MLflow store"):
        tracking.model_version_for_uri("models:/kv-test@champion", store_uri=uri)
    assert list(tmp_path.iterdir()) == []


def test_alias_version_is_looked_up_without_download(tracked):
    _, uri, _, _ = tracked
    version = tracking.model_version_for_uri("models:/kv-test@champion", store_uri=uri)
    assert version.isdigit()
    with pytest.raises(PolicyLoadError, match="not in the MLflow registry"):
        tracking.model_version_for_uri("models:/kv-test@nope", store_uri=uri)


def test_missing_model_uri_names_it(tracked):
    _, uri, _, _ = tracked
    with pytest.raises(PolicyLoadError, match="models:/kv-test@nope"):
        tracking.load_policy_uri("models:/kv-test@nope", store_uri=uri)


def test_alias_without_name_is_refused(tracked):
    result, uri, trace, _ = tracked
    with pytest.raises(ValueError, match="--register"):
        run_tracked(trace, result.config, alias="champion", store_uri=uri)
    assert json.loads(json.dumps(list(read_trace(trace))[:1][0].to_dict()))  # trace still readable
