"""The lazy registry: names, errors, and what importing ``predictor`` costs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from predictor import (
    PolicyLoadError,
    UnknownPolicyError,
    available_policies,
    load_policy,
    make_policy,
    policy_class,
)


def test_registered_names():
    assert available_policies() == [
        "lfu",
        "lightgbm",
        "lru",
        "lru2",
        "lru_2hit",
        "lstm",
        "oracle",
        "prefix_lru",
    ]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownPolicyError) as info:
        make_policy("belady2")
    message = str(info.value)
    assert "belady2" in message
    for name in available_policies():
        assert name in message


def test_importing_predictor_imports_neither_lightgbm_nor_torch():
    code = (
        "import sys, json, predictor, predictor.baselines, predictor.oracle;"
        "predictor.make_policy('lru');"
        "print(json.dumps([m for m in ('lightgbm', 'torch', 'mlflow') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_params_are_typed_and_validated():
    cls = policy_class("prefix_lru")
    with pytest.raises(ValueError):
        make_policy("prefix_lru", {"max_depth": 0})
    with pytest.raises(ValueError):
        make_policy("lru", {"no_such_field": 1})
    policy = make_policy("prefix_lru", {"max_depth": 7})
    assert isinstance(policy.params, cls.Params) and policy.params.max_depth == 7
    with pytest.raises(TypeError):
        make_policy("lru", cls.Params())


def test_only_the_oracle_needs_the_future():
    assert [n for n in available_policies() if policy_class(n).needs_future] == ["oracle"]


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(PolicyLoadError, match="no such directory"):
        load_policy(tmp_path / "nope")
    with pytest.raises(PolicyLoadError, match="policy.json.*missing"):
        load_policy(tmp_path)
    (tmp_path / "policy.json").write_text("{not json")
    with pytest.raises(PolicyLoadError, match="policy.json.*not valid JSON"):
        load_policy(tmp_path)
    (tmp_path / "policy.json").write_text(json.dumps({"format": 1, "policy": "zzz", "params": {}}))
    with pytest.raises(UnknownPolicyError, match="zzz"):
        load_policy(tmp_path)
    (tmp_path / "policy.json").write_text(
        json.dumps({"format": 1, "policy": "prefix_lru", "params": {"max_depth": -3}})
    )
    with pytest.raises(PolicyLoadError, match="invalid parameters"):
        load_policy(tmp_path)
