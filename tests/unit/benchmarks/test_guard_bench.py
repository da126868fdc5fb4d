"""``kvwarm bench guard``: its cold replays are the suite's replays, its warm ones let
the cache follow the training tail first, and the command prints one row per setting."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from benchmarks.guard_cache import CANDIDATES, compare
from benchmarks.quality import workload_events
from predictor.registry import make_policy
from training.replay import distinct_blocks, replay_single_tier, split_events, spread_ties
from training.train import fit_policy_on_events


def test_cold_is_the_suites_replay_and_warm_starts_from_the_training_tail() -> None:
    events, _ = workload_events("chat", 400, seed=1)
    train, test = split_events(spread_ties(events), 0.6)
    capacity = max(1, int(0.05 * distinct_blocks(test)))
    model = fit_policy_on_events("lightgbm", train, seed=0, quick=True)
    result = compare(train, test, model, capacity)
    for name in ("lru", "lru2"):
        suite = make_policy(name)
        suite.observe_many(train)
        assert result["alone"]["cold"][name] == replay_single_tier(suite, test, capacity).hit_ratio
        # Warm: the tail's blocks are in the cache when the replayed part starts.
        tail_fed = make_policy(name)
        assert (
            result["alone"]["warm"][name]
            == replay_single_tier(tail_fed, test, capacity, warm=train).hit_ratio
        )
    assert result["alone"]["warm"]["lru"] > result["alone"]["cold"]["lru"]
    for mode in ("cold", "warm"):
        assert set(result["alone"][mode]) == set(CANDIDATES)
        assert result["guarded"][mode]["chosen"] in CANDIDATES
        assert 0.0 < result["guarded"][mode]["hit_ratio"] < 1.0


def test_the_command_prints_a_row_per_setting_and_writes_json(tmp_path: Path) -> None:
    from serving.cli import main

    out = tmp_path / "guard.json"
    args = ["bench", "guard", "--workloads", "chat", "--requests", "300", "--seed", "1"]
    args += ["--capacities", "0.05,0.1", "--quick-fit", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| chat |")]
    assert [r.split("|")[2].strip() for r in rows] == ["5%", "10%"]
    data = json.loads(out.read_text())
    assert set(data["results"]["chat"]) == {"0.05", "0.1"}
    refused = CliRunner().invoke(main, ["bench", "guard", "--workloads", "nope"])
    assert refused.exit_code != 0 and "unknown workload" in refused.output
