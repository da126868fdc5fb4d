"""`kvwarm demo` end to end on a small workload, with a real MLflow file store."""

from __future__ import annotations

import json

from click.testing import CliRunner

from serving.cli import main


def test_demo_writes_tables_plots_results_and_an_mlflow_run(tmp_path, monkeypatch):
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{store}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "demo",
            "--requests",
            "900",
            "--capacities",
            "0.02,0.1",
            "--policies",
            "lru,lightgbm,oracle",
            "--out",
            str(out),
            "--experiment",
            "kvwarm-test",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Single tier, demand caching" in result.output
    assert "Tiered with prefetch" in result.output
    data = json.loads((out / "results.json").read_text())
    assert [row["capacity"] for row in data["single"]] == [0.02, 0.1]
    for row in data["single"]:
        refs = row["references"]
        assert refs["lru_exact"] <= refs["belady"]
        assert set(row["policies"]) == {"lru", "lightgbm", "oracle"}
        assert row["peers"]["hit_ratios"]["LRU"] == refs["lru_exact"]  # same sequence, same count
        assert row["peers"]["future_aware"]["Belady"] == refs["belady"]
        assert "Belady" not in row["peers"]["hit_ratios"]
        # Nothing online may beat the optimum with bypass (future leaking into a policy).
        assert max(row["policies"].values()) <= refs["belady_bypass"] + 1e-12
    policies = {row["policy"] for row in data["tiered"]}
    assert policies == {"no_cache", "no_prewarm", "lru", "lightgbm", "oracle"}
    assert data["trace"]["sha256"] and data["training"]["lightgbm"]["seconds"] > 0
    assert data["training"]["lightgbm"]["model_size_bytes"] > 0
    # Whether the chain blend was kept, and on what figures, is on record.
    assert data["training"]["lightgbm"]["chain_blend"].startswith("chain blend: ")
    assert data["training"]["lightgbm"]["horizon"].startswith("horizon: ")
    for png in ("hit_ratio_vs_capacity.png", "gap_closed.png", "ttft_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The MLflow run holds the same results and plots.
    runs = list(store.glob("*/*/artifacts"))
    assert len(runs) == 1
    logged = {p.name for p in runs[0].iterdir()}
    assert {"results.json", "ttft_cdf.png", "gap_closed.png"} <= logged


def test_replay_refuses_unknown_policies(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    result = CliRunner().invoke(
        main, ["replay", "--trace", str(trace), "--policies", "lru,belady9"]
    )
    assert result.exit_code != 0
    assert "valid: " in result.output and "lightgbm" in result.output


def test_replay_takes_batched_eviction_and_records_it(tmp_path):
    """``--evict-ahead-visits`` reaches the planner (LFU evicts differently) and the
    results say which was used."""
    trace = tmp_path / "trace.jsonl"
    runner = CliRunner()
    made = runner.invoke(
        main,
        ["generate", "--requests", "1200", "--seed", "3", "--profile", "mixed", "-o", str(trace)],
    )
    assert made.exit_code == 0, made.output
    hit = {}
    for visits in (0, 8):
        out = tmp_path / f"out{visits}"
        result = runner.invoke(
            main,
            [
                "replay",
                "--trace",
                str(trace),
                "--policies",
                "lfu",
                "--modes",
                "single",
                "--capacities",
                "0.1",
                "--no-peers",
                "--evict-ahead-visits",
                str(visits),
                "--out",
                str(out),
                "--experiment",
                "",
            ],
        )
        assert result.exit_code == 0, result.output
        data = json.loads((out / "results.json").read_text())
        assert data["config"]["evict_ahead_visits"] == visits
        hit[visits] = data["single"][0]["policies"]["lfu"]
    assert hit[0] != hit[8]
    assert abs(hit[0] - hit[8]) < 0.05
