"""Validation-gated training against a real MLflow store in a temporary folder.

A model that learned the planted pattern is promoted (the alias points at it); then
deliberately broken models (shuffled labels; a constant score) trained on the same
data are registered but refused promotion: the alias does not move, and the reason
and the held-out table are logged with them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
import numpy as np
import pytest

from features.generator import generate_to_file, params_for
from training import tracking
from training.train import (
    TrainConfig,
    _labelled,
    degeneracy_warnings,
    load_events,
    log_training_run,
    run_tracked,
    time_cuts,
    validate_on_holdout,
)

HORIZON_MS = 10_000
RECENCY = ("lru", "prefix_lru")


@pytest.fixture(scope="module")
def promoted(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        trace = generate_to_file(
            params_for("planted", num_requests=700, seed=2), root / "planted.jsonl"
        )
        uri = (root / "store").as_uri()
        config = TrainConfig(
            model="lightgbm",
            horizon_ms=HORIZON_MS,
            snapshot_interval_ms=10_000,
            snapshot_blocks=128,
            eval_snapshot_every_ms=60_000,
            model_params={"num_boost_round": 40, "num_leaves": 15, "min_data_in_leaf": 20},
            baselines=("lru",),
            # On this workload LFU beats a quickly trained model (the gate says so);
            # against recency alone the model wins by far.
            gate_heuristics=RECENCY,
        )
        lines: list[str] = []
        result = run_tracked(
            trace,
            config,
            experiment="gate",
            register="kv-gate",
            alias="champion",
            store_uri=uri,
            echo=lines.append,
        )
        yield result, uri, trace, lines


def _broken(result, how: str):
    """A LightGBM fitted on the same rows with shuffled labels, or to a constant."""
    from training.train import fit_learned

    train, valid = result.parts["train"], result.parts["valid"]
    if how == "constant":
        return fit_learned(
            "lightgbm",
            train,
            valid,
            horizon_ms=HORIZON_MS,
            model_params={"num_boost_round": 1, "min_data_in_leaf": 10**9},
        )
    shuffled = train.take(np.arange(train.num_rows))
    key = f"reused_within_{HORIZON_MS}ms"
    shuffled.labels[key] = np.random.default_rng(0).permutation(shuffled.labels[key])
    return fit_learned(
        "lightgbm",
        shuffled,
        valid,
        horizon_ms=HORIZON_MS,
        model_params={"num_boost_round": 40, "num_leaves": 15, "min_data_in_leaf": 20},
    )


def test_a_model_that_beats_the_heuristics_is_promoted(promoted):
    result, uri, _, lines = promoted
    table = result.validation
    assert table is not None and table.promote, table.to_dict()
    assert result.promoted is True and result.warnings == []
    assert table.mean("lightgbm") > max(table.mean(h) for h in RECENCY)
    assert any(line.startswith("promoted: kv-gate@champion") for line in lines)
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.get_model_version_by_alias("kv-gate", "champion").version == int(
        result.registered_version
    )
    logged = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=result.run_id, artifact_path="validation.json", tracking_uri=uri
            )
        ).read_text()
    )
    assert logged["promote"] is True and set(logged["hit_ratios"]) == {"lightgbm", *RECENCY}


@pytest.mark.parametrize("how", ["shuffled", "constant"])
def test_a_broken_model_is_refused_and_the_alias_stays(promoted, how):
    promoted_result, uri, trace, _ = promoted
    champion = int(promoted_result.registered_version)
    result = dataclasses.replace(promoted_result)  # this test's run; the fixture's stays
    broken = _broken(result, how)
    warnings = degeneracy_warnings(broken, _labelled(result.parts["valid"], HORIZON_MS)[0])
    if how == "constant":
        assert any("same score" in w for w in warnings), warnings
    events = load_events(trace)
    test_cut = time_cuts(events, result.config)[1]
    cut = next(i for i, e in enumerate(events) if e.ts_ms > test_cut)
    table = validate_on_holdout(
        broken, events[:cut], events[cut:], heuristics=RECENCY, warnings=warnings
    )
    assert not table.promote and table.winner in RECENCY, table.to_dict()
    result.policy, result.validation, result.warnings = broken, table, warnings
    lines: list[str] = []
    with tracking.tracked_run("gate", uri=uri) as run:
        log_training_run(
            run,
            result,
            trace=str(trace),
            register="kv-gate",
            alias="champion",
            echo=lines.append,
        )
    assert result.promoted is False
    assert int(result.registered_version) > champion  # registered, with its table
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.get_model_version_by_alias("kv-gate", "champion").version == champion
    refusal = next(line for line in lines if line.startswith("NOT promoted"))
    assert "kv-gate@champion stays" in refusal and table.winner in refusal
    params = client.get_run(result.run_id).data.params
    assert params["validation.promote"] == "False"
