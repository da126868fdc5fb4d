"""Policies that score KV blocks (see ``predictor.base`` for the interface).

Importing this package is cheap: LightGBM and torch are imported only when the
``lightgbm`` or ``lstm`` policy is first asked for by name.
"""

from predictor.base import (
    Policy,
    PolicyError,
    PolicyLoadError,
    PolicyParams,
    UnknownPolicyError,
)
from predictor.registry import available_policies, load_policy, make_policy, policy_class

__all__ = [
    "Policy",
    "PolicyError",
    "PolicyLoadError",
    "PolicyParams",
    "UnknownPolicyError",
    "available_policies",
    "load_policy",
    "make_policy",
    "policy_class",
]
