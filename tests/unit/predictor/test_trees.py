"""predictor.trees: the parsed ensemble equals LightGBM, and structural validation
refuses every malformed model with the tree, node and problem named (issue 18)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pytest

from predictor.base import PolicyLoadError
from predictor.lightgbm_policy import LightGBMPolicy, predict_rows
from predictor.trees import parse_lightgbm_model


def _train(objective: str, x: np.ndarray, y: np.ndarray, **extra: object) -> lgb.Booster:
    params = {
        "objective": objective,
        "num_leaves": 15,
        "min_data_in_leaf": 5,
        "verbosity": -1,
        "num_threads": 1,
        "seed": 0,
        "deterministic": True,
        **extra,
    }
    return lgb.train(params, lgb.Dataset(x, y), num_boost_round=40)


@pytest.fixture(scope="module")
def random_models() -> list[tuple[lgb.Booster, np.ndarray]]:
    """Models on random rows with NaNs, zeros and -1 (kvwarm's MISSING), binary and
    regression, with and without zero-as-missing: every split rule LightGBM applies."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 100, size=(3000, 8)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    x[rng.random(x.shape) < 0.1] = 0.0
    x[rng.random(x.shape) < 0.1] = -1.0
    signal = np.nan_to_num(x[:, 0]) + 0.5 * np.nan_to_num(x[:, 1]) - np.isnan(x[:, 2]) * 50
    y_bin = (signal + rng.normal(0, 30, 3000) > 0).astype(np.float32)
    models = [
        _train("binary", x, y_bin),
        _train("regression", x, signal),
        _train("binary", x, y_bin, zero_as_missing=True),
        _train("regression", x, signal, use_missing=False),
    ]
    test = rng.normal(0, 100, size=(2000, 8)).astype(np.float32)
    test[rng.random(test.shape) < 0.1] = np.nan
    test[rng.random(test.shape) < 0.1] = 0.0
    test[rng.random(test.shape) < 0.05] = 1e-36
    return [(m, test) for m in models]


def test_parsed_trees_equal_lightgbm_on_random_inputs(random_models) -> None:
    for booster, x in random_models:
        ensemble = parse_lightgbm_model(booster.model_to_string())
        expected = booster.predict(x, num_threads=1)
        assert np.abs(ensemble.predict(x) - expected).max() <= 1e-6
        assert np.abs(predict_rows(booster, x) - expected).max() <= 1e-6


def test_parsed_trees_equal_lightgbm_on_real_features(shared_trace: Path) -> None:
    from features.decoders import read_trace
    from training.train import fit_policy_on_events

    events = list(itertools.islice(read_trace(shared_trace), 3000))
    policy = fit_policy_on_events("lightgbm", events[:2000], quick=True)
    assert isinstance(policy, LightGBMPolicy) and policy.trees is not None
    policy.observe_many(events[:2500])
    hashes = policy.state.tracked_hashes()
    x = policy.state.features_for(hashes, events[2499].ts_ms + 5_000)
    expected = policy.booster.predict(x, num_threads=1)
    assert np.abs(policy.trees.predict(x) - expected).max() <= 1e-6
    assert np.abs(policy.predict_features(x) - expected).max() <= 1e-6
    if policy.compiled is not None:  # what scores when a C compiler is at hand
        raw = policy.booster.predict(x, raw_score=True, num_threads=1)
        assert np.array_equal(policy.compiled.predict_raw(x), raw)


# --- validation: one edited field per case, as a broken file or a bad upstream would ---


@pytest.fixture(scope="module")
def model_text(random_models) -> str:
    return random_models[0][0].model_to_string()


def _edit(text: str, tree: int, key: str, fn) -> str:
    """Apply ``fn`` to the value list of ``key`` in tree ``tree``."""
    head, sep, rest = text.partition(f"\nTree={tree}\n")
    body, sep2, tail = rest.partition("\n\n")
    lines = body.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(f"{key}="):
            values = line[len(key) + 1 :].split(" ")
            lines[i] = f"{key}=" + " ".join(fn(values))
    return head + sep + "\n".join(lines) + sep2 + tail


def _set(index: int, value: str):
    def fn(values: list[str]) -> list[str]:
        values[index] = value
        return values

    return fn


@pytest.mark.parametrize(
    ("key", "edit", "message"),
    [
        ("split_feature", _set(0, "999"), r"tree 2 node 0: split_feature 999 out of range 0\.\.7"),
        ("split_feature", _set(1, "-3"), r"tree 2 node 1: split_feature -3 out of range"),
        ("left_child", _set(0, "999"), r"tree 2 node 0: left_child 999 out of range"),
        ("right_child", _set(0, "-999"), r"tree 2 node 0: right_child -999 names leaf 998"),
        ("left_child", _set(1, "0"), r"tree 2 node 1: left_child 0 is reached twice"),
        ("left_child", _set(0, "0"), r"tree 2 node 0: left_child 0 is reached twice"),
        ("leaf_value", _set(3, "nan"), r"tree 2 leaf 3: leaf_value nan is not finite"),
        ("leaf_value", _set(0, "inf"), r"tree 2 leaf 0: leaf_value inf is not finite"),
        ("threshold", _set(2, "nan"), r"tree 2 node 2: threshold is NaN"),
        ("decision_type", _set(0, "1"), r"tree 2 node 0: categorical splits"),
        ("leaf_value", lambda v: v[:-1], r"tree 2: 'leaf_value' has \d+ values, expected"),
        ("threshold", _set(0, "abc"), r"tree 2: 'threshold' is not a list of numbers"),
    ],
)
def test_malformed_trees_are_refused_naming_tree_node_and_problem(
    model_text: str, key: str, edit, message: str
) -> None:
    bad = _edit(model_text, 2, key, edit)
    assert bad != model_text
    with pytest.raises(PolicyLoadError, match=message):
        parse_lightgbm_model(bad, "model.txt")


def test_a_shared_subtree_is_refused(model_text: str) -> None:
    # Both children of the root point at one subtree: the tree has as many child slots
    # as nodes, so the other half is unreachable and one node is reached twice.
    def same(values: list[str]) -> list[str]:
        return values

    left = _edit(model_text, 0, "left_child", same)
    first_left = left.split("\nTree=0\n")[1].split("left_child=")[1].split(" ")[0]
    bad = _edit(model_text, 0, "right_child", _set(0, first_left))
    with pytest.raises(PolicyLoadError, match=r"tree 0 node 0: right_child .* reached twice"):
        parse_lightgbm_model(bad)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (r"max_feature_idx=\d+", "max_feature_idx=x", "max_feature_idx"),
        (r"objective=binary[^\n]*", "objective=multiclass num_class:3", "objective"),
        (r"num_class=1", "num_class=3", "single-output"),
        (r"objective=binary sigmoid:1", "objective=binary sigmoid:nan", "sigmoid"),
        (r"\nTree=1\n", "\nTree=7\n", r"tree 1: header says Tree='7'"),
        (r"num_leaves=\d+", "num_leaves=0", r"tree 0: num_leaves 0 out of range"),
    ],
)
def test_malformed_headers_are_refused(model_text: str, old: str, new: str, message: str) -> None:
    bad = re.sub(old, new, model_text, count=1)
    assert bad != model_text
    with pytest.raises(PolicyLoadError, match=message):
        parse_lightgbm_model(bad)


def test_policy_load_refuses_a_corrupt_model_file(ready_policy, tmp_path: Path) -> None:
    policy = ready_policy("lightgbm")
    policy.save(tmp_path)
    path = tmp_path / "model.txt"
    path.write_text(_edit(path.read_text(), 0, "split_feature", _set(0, "4096")))
    with pytest.raises(PolicyLoadError, match=r"model\.txt.*tree 0 node 0: split_feature 4096"):
        LightGBMPolicy.load(tmp_path)


# --- the compiled evaluator (predictor.compiled_trees) ---


@pytest.fixture
def tree_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVWARM_TREE_EVALUATOR", raising=False)
    return tmp_path / "trees"


needs_cc = pytest.mark.skipif(
    __import__("shutil").which("cc") is None, reason="no C compiler on this machine"
)


@needs_cc
def test_compiled_trees_equal_lightgbm_bit_for_bit(random_models, tree_cache: Path) -> None:
    from predictor.compiled_trees import compile_ensemble, self_test_rows

    for booster, x in random_models:
        ensemble = parse_lightgbm_model(booster.model_to_string())
        compiled = compile_ensemble(ensemble)
        assert compiled is not None
        for rows in (x, self_test_rows(8, seed=3), x[:1], x[:0]):
            raw = compiled.predict_raw(rows)
            assert np.array_equal(raw, booster.predict(rows, raw_score=True, num_threads=1))
            assert np.array_equal(raw, ensemble.predict_raw(rows))
    assert len(list(tree_cache.glob("trees-*.so"))) == len(random_models)


@needs_cc
def test_a_learned_policy_scores_with_the_compiled_trees_and_says_so(
    tree_cache: Path, tmp_path: Path
) -> None:
    import copy

    from predictor.compiled_trees import self_test_rows

    policy = LightGBMPolicy()
    width = len(policy.feature_names)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2000, width)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.float32)
    policy.fit(x[:1500], y[:1500], x[1500:], y[1500:])
    assert policy.evaluator == "compiled"
    loaded = copy.deepcopy(LightGBMPolicy.load(policy.save(tmp_path / "model")))
    assert isinstance(loaded, LightGBMPolicy)
    assert loaded.evaluator == "compiled" and loaded.compiled is not None
    assert loaded.online_status()["evaluator"] == "compiled"
    rows = self_test_rows(width, seed=7)
    assert loaded.booster is not None
    expected = loaded.booster.predict(rows, num_threads=1)
    assert np.abs(loaded.predict_features(rows) - expected).max() <= 1e-6


@needs_cc
def test_without_a_compiler_or_when_told_lightgbm_scores_and_health_says_why(
    random_models, tree_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from predictor import compiled_trees

    ensemble = parse_lightgbm_model(random_models[0][0].model_to_string())
    monkeypatch.setenv("CC", "no-such-compiler-kvwarm")
    assert compiled_trees.compile_ensemble(ensemble) is None
    assert "no-such-compiler-kvwarm" in compiled_trees.last_failure
    monkeypatch.delenv("CC")
    monkeypatch.setenv("KVWARM_TREE_EVALUATOR", "lightgbm")
    assert compiled_trees.compile_ensemble(ensemble) is None
    assert "KVWARM_TREE_EVALUATOR=lightgbm" in compiled_trees.last_failure


@needs_cc
def test_compiled_code_that_disagrees_with_the_trees_is_discarded(
    random_models, tree_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from predictor import compiled_trees

    ensemble = parse_lightgbm_model(random_models[1][0].model_to_string())
    right = compiled_trees.c_source
    # A code generator bug: strict instead of <= at every split.
    monkeypatch.setattr(
        compiled_trees, "c_source", lambda e: right(e).replace("if (v <= ", "if (v < ")
    )
    assert compiled_trees.compile_ensemble(ensemble) is None
    assert "self-test failed" in compiled_trees.last_failure


@needs_cc
def test_a_compiled_model_is_cached_and_loads_again_without_the_compiler(
    random_models, tree_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    from predictor import compiled_trees

    ensemble = parse_lightgbm_model(random_models[2][0].model_to_string())
    assert compiled_trees.compile_ensemble(ensemble) is not None

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    again = compiled_trees.compile_ensemble(ensemble)
    assert again is not None
    x = random_models[2][1]
    assert np.array_equal(again.predict_raw(x), ensemble.predict_raw(x))


@needs_cc
def test_the_library_cache_keeps_the_most_recently_used(
    random_models, tree_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib
    import os

    from predictor import compiled_trees

    monkeypatch.setattr(compiled_trees, "MAX_CACHED_LIBRARIES", 2)
    ensembles = [parse_lightgbm_model(b.model_to_string()) for b, _ in random_models[:3]]
    for ensemble in ensembles:
        assert compiled_trees.compile_ensemble(ensemble) is not None
        for lib in tree_cache.glob("trees-*.so"):  # make mtimes distinct and ordered
            os.utime(lib, (lib.stat().st_mtime - 10, lib.stat().st_mtime - 10))
    assert len(list(tree_cache.glob("trees-*.so"))) == 2
    digest = hashlib.sha256(compiled_trees.c_source(ensembles[0]).encode()).hexdigest()[:32]
    assert not (tree_cache / f"trees-{digest}.so").exists()  # the least recently used
    # The first model's library went; compiling it again works (and evicts another).
    assert compiled_trees.compile_ensemble(ensembles[0]) is not None
    assert len(list(tree_cache.glob("trees-*.so"))) == 2


_UNPICKLE = """
import pickle, sys
import numpy as np
policy = pickle.loads(open(sys.argv[1], "rb").read())
x = np.load(sys.argv[2])
np.save(sys.argv[3], policy.predict_features(x))
print(policy.evaluator)
"""


@needs_cc
def test_a_pickled_model_whose_library_was_pruned_compiles_it_again(
    tree_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replay worker (a fresh process) unpickles a policy whose compiled library other
    # processes' compiles may have pruned from the cache in between: it compiles the
    # library again, or scores with LightGBM's predictor; it never fails to unpickle.
    import pickle
    import subprocess
    import sys

    policy = LightGBMPolicy()
    width = len(policy.feature_names)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2000, width)).astype(np.float32)
    y = (x[:, 0] - x[:, 2] > 0).astype(np.float32)
    policy.fit(x[:1500], y[:1500], x[1500:], y[1500:])
    assert policy.compiled is not None
    blob, rows, out = tmp_path / "policy.pkl", tmp_path / "x.npy", tmp_path / "scores.npy"
    blob.write_bytes(pickle.dumps(policy))
    np.save(rows, x)
    library = policy.compiled.library
    expected = policy.predict_features(x)

    def unpickle_elsewhere() -> str:
        done = subprocess.run(
            [sys.executable, "-c", _UNPICKLE, str(blob), str(rows), str(out)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    library.unlink()
    assert unpickle_elsewhere() == "compiled"
    assert library.is_file()  # compiled again, under the same name
    assert np.array_equal(np.load(out), expected)
    library.unlink()
    monkeypatch.setenv("CC", "no-such-compiler-kvwarm")
    evaluator = unpickle_elsewhere()
    assert evaluator.startswith("lightgbm") and "no-such-compiler-kvwarm" in evaluator
    assert np.abs(np.load(out) - expected).max() <= 1e-6
