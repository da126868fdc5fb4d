"""``kvwarm bench chains`` on the ``planted`` generated workload, whose chat turns all come
back exactly 45 s later with scans in between: there the chain model must rank the
chains about to return far above recency (which puts them below every chain used since),
and the benchmark must say so; and the held-out rows it scores are the whole dataset's
rows at the held-out snapshots."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks.chain_signal import chain_signal, chain_signal_bench, format_signal
from features.decoders import decode_mooncake
from features.generator import generate, generate_to_file, params_for
from predictor.chain_model import CHAIN_FEATURES, chain_dataset
from training.replay import split_events

HORIZON_MS = 10_000


@pytest.fixture(scope="module")
def planted():
    rows = generate(params_for("planted", num_requests=1_500, seed=1))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


def test_held_out_rows_are_the_whole_datasets_rows_from_that_snapshot_on(planted):
    _, test = split_events(planted, 0.6)
    x_all, y_all, since_all = chain_dataset(planted, HORIZON_MS)
    x, y, since = chain_dataset(planted, HORIZON_MS, rows_from_ms=test[0].ts_ms)
    assert 0 < x.shape[0] < x_all.shape[0]
    # Snapshots run in time order and the held-out ones are the last: the same rows.
    n = x.shape[0]
    assert np.array_equal(x, x_all[-n:])
    assert np.array_equal(y, y_all[-n:])
    assert np.array_equal(since, since_all[-n:])


def test_bench_finds_the_planted_return_signal_beyond_recency(planted):
    (result,) = chain_signal(planted, 0.6, [HORIZON_MS])
    assert result.rows > 100 and 0.0 < result.returns < 1.0
    assert result.model_auc >= result.recency_auc + 0.3, result
    assert result.model_ap > result.recency_ap, result
    assert set(result.feature_auc) == set(CHAIN_FEATURES)
    # Time since the last turn alone is recency, scored the other way round.
    assert result.feature_auc["log_since_last_turn_ms"] == pytest.approx(
        1.0 - result.recency_auc, abs=1e-6
    )
    table = format_signal([result])
    assert "model AUC" in table and f"{result.model_auc:.3f}" in table
    assert all(name in table for name in CHAIN_FEATURES)


def test_command_prints_the_table_and_refuses_a_horizon_without_unit(tmp_path):
    trace = generate_to_file(
        params_for("planted", num_requests=1_000, seed=2), tmp_path / "t.jsonl"
    )
    runner = CliRunner()
    done = runner.invoke(chain_signal_bench, ["--trace", str(trace), "--horizons", "10s"])
    assert done.exit_code == 0, done.output
    assert "recency AUC" in done.output and "10 s" in done.output
    bad = runner.invoke(chain_signal_bench, ["--trace", str(trace), "--horizons", "10"])
    assert bad.exit_code != 0 and "no unit" in bad.output


def test_a_horizon_longer_than_the_held_out_part_is_left_out_with_its_reason(planted):
    skipped: list[str] = []
    results = chain_signal(planted, 0.6, [HORIZON_MS, 36_000_000], skipped)
    assert [r.horizon_ms for r in results] == [HORIZON_MS]
    assert len(skipped) == 1 and "36000 s" in skipped[0]
    with pytest.raises(ValueError, match="36000 s"):
        chain_signal(planted, 0.6, [36_000_000])
