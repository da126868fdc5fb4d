"""Model-file mutation fuzzing: no edit of ``model.txt`` crashes, hangs or poisons the sidecar.

Each case loads a mutated copy of a real LightGBM model the way the sidecar does
(``ModelManager.load_initial``: structural check, LightGBM parse, timed probe) in a
child process, so a segfault (rc 139) or an abort fails the test instead of pytest.
A case holds when the model is refused (LRU serves, status degraded) or, if the edit
left a valid model, its scores are finite.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from predictor.registry import make_policy
from tests.chaos.mutations import MUTATIONS
from tests.chaos.sidecar_process import REPO_ROOT, SidecarProcess

pytestmark = pytest.mark.chaos

NUM_RANDOM_MUTATIONS = 60

CHILD = """
import json, sys
import numpy as np
from serving.model_lifecycle import ModelManager
for directory in sys.argv[1:]:
    print(json.dumps({"case": directory, "started": True}), flush=True)
    manager = ModelManager(directory, probe_timeout_s=2.0)
    policy = manager.load_initial()
    scores = policy.score(np.arange(1, 200, dtype=np.uint64), 10_000)
    print(json.dumps({
        "case": directory, "policy": policy.name, "status": manager.status.status,
        "reason": manager.status.reason, "finite": bool(np.isfinite(scores).all()),
    }), flush=True)
"""


def _fitted_model(directory: Path) -> Path:
    policy = make_policy(
        "lightgbm", {"num_boost_round": 4, "seed": 1, "min_data_in_leaf": 5, "num_leaves": 6}
    )
    rng = np.random.default_rng(1)
    x = rng.random((500, len(policy.feature_names)), dtype=np.float32)
    y = (x[:, 0] + x[:, 3]) > 1.0
    return policy.fit(x[:400], y[:400], x[400:], y[400:]).save(directory)


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    return _fitted_model(tmp_path_factory.mktemp("fuzz") / "good")


def _random_mutation(text: str, rng: random.Random) -> str:
    """Replace one value of one tree field with a hostile one."""
    keys = ["split_feature", "left_child", "right_child", "threshold", "leaf_value",
            "num_leaves", "decision_type", "shrinkage", "num_cat", "max_feature_idx"]  # fmt: skip
    key = rng.choice(keys)
    lines = [i for i, line in enumerate(text.split("\n")) if line.startswith(key + "=")]
    hostile = ["-1", "0", "1", "999999", "-999999", "nan", "inf", "-inf", "1e308", "",
               "2147483648", "-2147483649", "x", "3.5"]  # fmt: skip
    out = text.split("\n")
    i = rng.choice(lines)
    values = out[i].split("=", 1)[1].split(" ")
    values[rng.randrange(len(values))] = rng.choice(hostile)
    out[i] = key + "=" + " ".join(values)
    return "\n".join(out)


def _run_cases(directories: list[Path]) -> list[dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, directories)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = [r for r in records if "started" not in r]
    if proc.returncode != 0:
        last = records[-1]["case"] if records else "?"
        pytest.fail(f"the loader died with rc {proc.returncode} on {last}:\n{proc.stderr[-2000:]}")
    assert len(done) == len(directories)
    return done


def test_every_mutation_is_refused_or_scores_finite(good_model, tmp_path):
    text = (good_model / "model.txt").read_text()
    cases: dict[Path, str] = {}
    for name, mutate in MUTATIONS.items():
        directory = tmp_path / name
        _copy_with(good_model, directory, mutate(text))
        cases[directory] = name
    rng = random.Random(18)
    for i in range(NUM_RANDOM_MUTATIONS):
        directory = tmp_path / f"random-{i}"
        _copy_with(good_model, directory, _random_mutation(text, rng))
        cases[directory] = f"random-{i}"
    results = _run_cases(list(cases))
    refused = [r for r in results if r["status"] == "degraded"]
    served = [r for r in results if r["status"] == "ok"]
    print(
        f"model fuzz: {len(results)} mutated models ({len(MUTATIONS)} named, "
        f"{NUM_RANDOM_MUTATIONS} random); refused {len(refused)}, still valid {len(served)}; "
        "0 crashes, 0 hangs"
    )
    assert all(r["finite"] for r in results)
    assert all(r["policy"] == "lru" and r["reason"] for r in refused)
    by_name = {cases[Path(str(r["case"]))]: r for r in results}
    for name in list(MUTATIONS)[:11] + ["child_cycle_two_nodes", "shared_leaf"]:
        assert by_name[name]["status"] == "degraded", (name, by_name[name])


def _copy_with(src: Path, dst: Path, model_text: str) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / "model.txt").write_text(model_text)


def _wait_health(sidecar: SidecarProcess, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    health: dict = {}
    while time.monotonic() < deadline:
        health = sidecar.health()
        if predicate(health):
            return health
        time.sleep(0.2)
    raise AssertionError(f"health never matched: {health}")


def test_serve_refuses_a_segfaulting_model_then_swaps_in_a_good_one_and_keeps_it(
    good_model, tmp_path
):
    """The initial load and two hot-swaps through ``kvwarm serve`` (a real process)."""
    text = (good_model / "model.txt").read_text()
    live = tmp_path / "live"
    _copy_with(good_model, live, MUTATIONS["split_feature_out_of_range"](text))
    sidecar = SidecarProcess(
        [
            "--model",
            str(live),
            "--fallback",
            "lru",
            "--source",
            "zmq://127.0.0.1:1",
            "--clock",
            "wall",
            "--http-port",
            "0",
            "--executor",
            "none",
            "--model-poll-s",
            "0.3",
        ]  # fmt: skip
    )
    try:
        sidecar.wait_for("kvwarm serve: model")
        health = sidecar.health()
        assert health["status"] == "degraded" and health["policy"] == "lru"
        assert "split_feature 9999" in str(health["reason"])
        (live / "model.txt").write_text(text)  # the fix lands
        health = _wait_health(sidecar, lambda h: h["status"] == "ok")
        assert health["policy"] == "lightgbm"
        (live / "model.txt").write_text(MUTATIONS["tree_loops_to_itself"](text))
        health = _wait_health(sidecar, lambda h: h["last_reload_error"])
        assert health["status"] == "ok" and health["policy"] == "lightgbm"
        assert re.search("cycle", str(health["last_reload_error"]))
        print(f"serve: refused, swapped in, kept through a broken version: {health}")
        sidecar.terminate_and_time(bound_s=10)
        assert sidecar.proc.returncode == 0, sidecar.stderr()
    finally:
        sidecar.close()
