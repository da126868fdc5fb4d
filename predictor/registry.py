"""The lazy policy registry: names to classes, imported only when asked for.

Importing ``predictor`` never imports LightGBM or torch: each entry is a
``"module:Class"`` string resolved on first use. To add a policy, add one line to
``POLICIES`` (see docs/adding-a-policy.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from predictor.base import Policy, PolicyParams, UnknownPolicyError, read_manifest

# name -> "module:Class"
POLICIES: dict[str, str] = {
    "lru": "predictor.baselines:LRUPolicy",
    "lfu": "predictor.baselines:LFUPolicy",
    "lru2": "predictor.baselines:LRU2Policy",
    "lru_2hit": "predictor.baselines:LRU2HitPolicy",
    "prefix_lru": "predictor.baselines:PrefixLRUPolicy",
    "lightgbm": "predictor.lightgbm_policy:LightGBMPolicy",
    "lstm": "predictor.lstm_policy:LSTMPolicy",
    "oracle": "predictor.oracle:OraclePolicy",
}


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; raises ``UnknownPolicyError`` listing valid names."""
    target = POLICIES.get(name)
    if target is None:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; valid policies: {', '.join(available_policies())}"
        )
    module_name, attr = target.split(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"{target} is not a Policy subclass")
    return cls


def make_policy(
    name: str, params: PolicyParams | dict[str, Any] | None = None, **kwargs: Any
) -> Policy:
    """Build a fresh policy by name. ``params`` may be its ``Params`` or a plain dict
    (validated); ``kwargs`` go to the constructor (the oracle's ``future=``)."""
    cls = policy_class(name)
    if isinstance(params, dict):
        params = cls.Params.model_validate(params)
    return cls(params, **kwargs)


def load_policy(directory: str | Path, **kwargs: Any) -> Policy:
    """Load a policy saved with ``Policy.save``; the manifest says which class.

    MLflow ``models:/NAME@ALIAS`` URIs are resolved to a directory by
    ``training.tracking.load_policy_uri`` (the only module that imports MLflow).
    """
    manifest = read_manifest(directory)
    return policy_class(str(manifest["policy"])).load(directory, **kwargs)
