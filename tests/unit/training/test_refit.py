"""The refit: once the validation rows have made every choice, the kept model is fitted
again on the training and validation rows together, with the validated number of trees,
and never on a later part (``training.train.refit_on_training_span``)."""

from __future__ import annotations

import lightgbm as lgb
import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from predictor.lightgbm_policy import LightGBMPolicy
from predictor.lstm_policy import LSTMPolicy
from training import train as train_module
from training.dataset import build_dataset
from training.train import (
    TrainConfig,
    _labelled,
    fit_policy_on_events,
    refit_on_training_span,
    split_dataset,
    time_cuts,
    train_and_evaluate,
)

HORIZON_MS = 60_000


def _events(profile: str, num: int, seed: int = 0):
    rows = generate(params_for(profile, num_requests=num, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


@pytest.fixture(scope="module")
def parts():
    events = _events("chat", 600)
    dataset = build_dataset(events, horizons_ms=(HORIZON_MS,), seed=0)
    valid_cut, test_cut = time_cuts(events, TrainConfig())
    return dataset, split_dataset(dataset, valid_cut, test_cut), test_cut


def _fitted(parts_) -> LightGBMPolicy:
    train, valid = parts_["train"], parts_["valid"]
    policy = LightGBMPolicy(
        LightGBMPolicy.Params(horizon_ms=HORIZON_MS, num_boost_round=60, min_data_in_leaf=20)
    )
    x_tr, y_tr, _ = _labelled(train, HORIZON_MS)
    x_va, y_va, _ = _labelled(valid, HORIZON_MS)
    return policy.fit(x_tr, y_tr, x_va, y_va)


def test_refit_is_the_validated_settings_on_every_row_given(parts):
    dataset, parts_, test_cut = parts
    policy = _fitted(parts_)
    trees = policy.training_info["best_iteration"]
    span = dataset.take(np.flatnonzero(dataset.ts_ms <= test_cut), end_ts_ms=test_cut)
    x, y, _ = _labelled(span, HORIZON_MS)
    assert x.shape[0] > _labelled(parts_["train"], HORIZON_MS)[0].shape[0]
    before = policy.predict_features(x[:500])

    note = refit_on_training_span(policy, span)

    assert policy.training_info["refit"] == {"rows": x.shape[0], "trees": trees}
    assert f"{x.shape[0]:,} rows, {trees} trees" in note
    assert policy.booster.num_trees() == trees
    # Exactly LightGBM's own fit of those rows with the validated settings.
    expected = lgb.train(
        policy._lgb_params(), lgb.Dataset(x, y.astype(np.float32)), num_boost_round=trees
    )
    np.testing.assert_allclose(
        policy.predict_features(x[:500]), expected.predict(x[:500]), rtol=0, atol=1e-6
    )
    assert not np.allclose(policy.predict_features(x[:500]), before)


def test_a_model_without_refit_keeps_its_validated_fit(parts):
    dataset, _, _ = parts
    lstm = LSTMPolicy(LSTMPolicy.Params(horizon_ms=HORIZON_MS))
    assert refit_on_training_span(lstm, dataset) == "refit: lstm keeps its validated fit"
    assert "refit" not in lstm.training_info


def test_the_replays_training_refits_unless_told_not_to():
    events = _events("chat", 400)
    refit = fit_policy_on_events("lightgbm", events, quick=True)
    kept = fit_policy_on_events("lightgbm", events, quick=True, refit=False)
    assert "refit" not in kept.training_info
    info = refit.training_info["refit"]
    assert info["trees"] == kept.training_info["best_iteration"] == refit.booster.num_trees()
    x = np.random.default_rng(0).random((64, len(kept.feature_names)), dtype=np.float32)
    assert not np.allclose(refit.predict_features(x), kept.predict_features(x))


def test_kvwarm_train_refits_on_the_training_span_only(monkeypatch):
    """The rows given to the refit end where the test part starts: the gate and the
    test figures measure a model that never saw them."""
    events = _events("chat", 500)
    seen = []
    real = train_module.refit_on_training_span

    def spy(policy, rows):
        seen.append(rows)
        return real(policy, rows)

    monkeypatch.setattr(train_module, "refit_on_training_span", spy)
    config = TrainConfig(gate=False, baselines=("lru",))
    lines: list[str] = []
    result = train_and_evaluate(events, config, echo=lines.append)
    (rows,) = seen
    _, test_cut = time_cuts(events, config)
    assert rows.end_ts_ms == test_cut and rows.ts_ms.max() <= test_cut
    assert rows.num_rows == result.parts["train"].num_rows + result.parts["valid"].num_rows
    assert result.policy.training_info["refit"]["rows"] == _labelled(rows, 60_000)[0].shape[0]
    assert any(line.startswith("refit on the training and validation rows") for line in lines)

    seen.clear()
    train_and_evaluate(events, TrainConfig(gate=False, baselines=("lru",), refit=False))
    assert seen == []
