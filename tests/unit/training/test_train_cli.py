"""``kvwarm train`` end to end on a small generated trace and a temporary store."""

from __future__ import annotations

from click.testing import CliRunner

from features.generator import generate_to_file, params_for
from serving.cli import main


def test_train_command_trains_logs_registers_and_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trace = generate_to_file(params_for("planted", num_requests=500, seed=5), tmp_path / "t.jsonl")
    store = (tmp_path / "store").as_uri()
    args = [
        "train", "--trace", str(trace), "--model", "lightgbm", "--horizon", "10s",
        "--experiment", "cli", "--register", "kv-cli", "--alias", "champion",
        "--param", "num_boost_round=20", "--param", "num_leaves=7",
        "--tracking-uri", store, "--save", str(tmp_path / "saved"), "--no-progress",
    ]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for name in ("lru", "lfu", "prefix_lru", "oracle", "lightgbm"):
        assert f"\n{name} " in result.output
    assert "models:/kv-cli@champion" in result.output
    assert (tmp_path / "saved" / "model.txt").is_file()
    assert "chain model: fitted" in result.output
    assert (tmp_path / "saved" / "chain_model.txt").is_file()


def test_bad_arguments_fail_with_a_message(tmp_path):
    trace = generate_to_file(params_for("planted", num_requests=20, seed=5), tmp_path / "t.jsonl")
    runner = CliRunner()
    out = runner.invoke(main, ["train", "--trace", str(trace), "--model", "xgboost"])
    assert out.exit_code != 0 and "lightgbm" in out.output
    out = runner.invoke(
        main, ["train", "--trace", str(trace), "--model", "lstm", "--alias", "champion"]
    )
    assert out.exit_code != 0 and "--register" in out.output
    out = runner.invoke(
        main, ["train", "--trace", str(trace), "--model", "lstm", "--horizon", "soon"]
    )
    assert out.exit_code != 0 and "duration" in out.output
    out = runner.invoke(
        main, ["train", "--trace", str(trace), "--model", "lightgbm", "--param", "num_leaves=1"]
    )
    assert out.exit_code != 0 and "num_leaves" in out.output
