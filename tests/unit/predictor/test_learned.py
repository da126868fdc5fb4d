"""Learned policies: safe loading with errors that name the file, seeded training."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from predictor import PolicyLoadError, load_policy, make_policy
from predictor.learned import NotFittedError


@pytest.mark.parametrize("name, model_file", [("lightgbm", "model.txt"), ("lstm", "weights.pt")])
def test_corrupt_or_missing_model_file_is_named(name, model_file, ready_policy, tmp_path):
    good = ready_policy(name).save(tmp_path / "good")
    corrupt = shutil.copytree(good, tmp_path / "corrupt")
    (corrupt / model_file).write_bytes(b"\x00garbage, not a model\n" * 10)
    with pytest.raises(PolicyLoadError, match=model_file) as info:
        load_policy(corrupt)
    assert str(corrupt / model_file) in str(info.value)
    missing = shutil.copytree(good, tmp_path / "missing")
    (missing / model_file).unlink()
    with pytest.raises(PolicyLoadError, match=f"{model_file}.*missing"):
        load_policy(missing)


@pytest.mark.parametrize("name", ["lightgbm", "lstm"])
def test_other_feature_version_is_refused(name, ready_policy, tmp_path):
    saved = ready_policy(name).save(tmp_path / name)
    manifest = json.loads((saved / "policy.json").read_text())
    manifest["feature_version"] += 1
    (saved / "policy.json").write_text(json.dumps(manifest))
    with pytest.raises(PolicyLoadError, match="feature version"):
        load_policy(saved)


def test_lstm_weights_load_with_weights_only(ready_policy, tmp_path):
    import argparse

    import torch

    saved = ready_policy("lstm").save(tmp_path / "lstm")
    # A pickled object (not a tensor dict) is refused by the weights_only loader.
    torch.save({"net": argparse.Namespace(payload="code would run here")}, saved / "weights.pt")
    with pytest.raises(PolicyLoadError, match="weights.pt"):
        load_policy(saved)


@pytest.mark.parametrize("name", ["lightgbm", "lstm"])
def test_unfitted_policy_refuses_to_score_or_save(name, tmp_path):
    policy = make_policy(name)
    with pytest.raises(NotFittedError):
        policy.score(np.array([1], dtype=np.uint64), 0)
    with pytest.raises(NotFittedError):
        policy.save(tmp_path / name)


def test_lstm_training_repeats_with_a_seed(contract_events):
    from training.train import fit_policy_on_events

    first = fit_policy_on_events("lstm", contract_events[:200], seed=4)
    second = fit_policy_on_events("lstm", contract_events[:200], seed=4)
    for a, b in zip(first.net.state_dict().values(), second.net.state_dict().values(), strict=True):
        assert np.array_equal(a.numpy(), b.numpy())


def test_lightgbm_training_repeats_with_a_seed(contract_events):
    from training.train import fit_policy_on_events

    first = fit_policy_on_events("lightgbm", contract_events[:200], seed=4)
    second = fit_policy_on_events("lightgbm", contract_events[:200], seed=4)
    assert first.booster.model_to_string() == second.booster.model_to_string()
