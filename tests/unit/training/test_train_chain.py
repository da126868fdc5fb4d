"""``kvwarm train`` fits the chain return model beside the block model (issue 12): on the
same span (train + validation; nothing of the test part), said in the log, saved with
the policy and read back."""

from __future__ import annotations

import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from predictor.chain_model import CHAIN_MODEL_FILE, chain_dataset
from predictor.registry import load_policy
from training.train import TrainConfig, fit_chain_model_noted, time_cuts, train_and_evaluate

HORIZON_MS = 10_000


def _events(num: int, seed: int):
    rows = generate(params_for("planted", num_requests=num, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


@pytest.fixture(scope="module")
def trained():
    events = _events(1_500, seed=4)
    config = TrainConfig(
        horizon_ms=HORIZON_MS,
        gate=False,
        baselines=("lru",),
        model_params={"num_boost_round": 30, "num_leaves": 7},
    )
    lines: list[str] = []
    result = train_and_evaluate(events, config, echo=lines.append)
    return events, config, result, lines


def test_train_fits_the_chain_model_on_the_training_span_only(trained):
    events, config, result, lines = trained
    chain = result.policy.chain
    assert chain is not None and chain.params.horizon_ms == HORIZON_MS
    assert result.chain_note.startswith("chain model: fitted")
    assert any(line.startswith("chain model: fitted") for line in lines)
    # The blend is fitted on the validation rows and kept or not, with the figures.
    blend_line = next(line for line in lines if line.startswith("chain blend:"))
    assert ("held-out hit ratio" in blend_line) or ("not fitted" in blend_line)
    assert (chain.blend is not None) == blend_line.startswith("chain blend: kept")
    # Its rows are those of the requests up to the end of validation, not one more.
    _, test_cut = time_cuts(events, config)
    span = [e for e in events if e.ts_ms <= test_cut]
    assert len(span) < len(events)
    p = chain.params
    rows = chain_dataset(span, p.horizon_ms, p.snapshot_interval_ms, p.max_chain_age_ms)[0]
    everything = chain_dataset(events, p.horizon_ms, p.snapshot_interval_ms, p.max_chain_age_ms)[0]
    assert chain.training_info["rows"] == rows.shape[0] < everything.shape[0]


def test_the_saved_policy_holds_the_chain_model(trained, tmp_path):
    events, _, result, _ = trained
    directory = result.policy.save(tmp_path / "model")
    assert (directory / CHAIN_MODEL_FILE).is_file()
    loaded = load_policy(directory)
    assert loaded.chain is not None
    original = result.policy.fresh_copy()
    for policy in (loaded, original):
        policy.observe_many(events[:1_000])
    now_ms = events[999].ts_ms + 1
    expected = original.prefetch_candidates(now_ms, 128)
    assert expected.shape[0] > 0
    assert np.array_equal(loaded.prefetch_candidates(now_ms, 128), expected)


def test_too_few_chain_returns_are_said_and_leave_no_chain_model():
    chain, note = fit_chain_model_noted(_events(30, seed=1), HORIZON_MS)
    assert chain is None
    assert note.startswith("chain model: not fitted") and "too few" in note
