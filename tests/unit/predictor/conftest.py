"""Fixtures of the predictor tests: a small generated workload and ready-to-score
policies of every registered name (learned ones fitted on the same workload)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from features.decoders import decode_mooncake
from features.events import BlocksAccessed
from features.generator import generate, params_for
from predictor import Policy, make_policy, policy_class


def generated_events(profile: str, num_requests: int, seed: int) -> list[BlocksAccessed]:
    rows = generate(params_for(profile, num_requests=num_requests, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


@pytest.fixture(scope="session")
def contract_events() -> list[BlocksAccessed]:
    """400 requests of the mixed profile: shared prefixes, chats, scans."""
    return generated_events("mixed", 400, seed=3)


def _fit_learned(name: str, events: list[BlocksAccessed]) -> Policy:
    from training.train import fit_policy_on_events

    return fit_policy_on_events(name, events, seed=0, quick=True)


@pytest.fixture(scope="session")
def ready_policy(contract_events: list[BlocksAccessed]) -> Callable[[str], Policy]:
    """``ready_policy(name)``: a fresh policy that can score (the oracle gets the future
    of ``contract_events``, learned policies a model fitted on them, cached)."""
    from predictor.oracle import FutureAccesses

    fitted: dict[str, Policy] = {}
    future = FutureAccesses.from_events(contract_events)

    def build(name: str) -> Policy:
        cls = policy_class(name)
        if cls.needs_future:
            return make_policy(name, future=future)
        if name in ("lightgbm", "lstm"):
            if name not in fitted:
                fitted[name] = _fit_learned(name, contract_events)
            return fitted[name].fresh_copy()
        return make_policy(name)

    return build
