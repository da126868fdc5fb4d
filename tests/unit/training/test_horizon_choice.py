"""The horizon is chosen per workload (issue 12): a quick fit at each candidate horizon,
replayed on the held-out requests, and the one that hits most is kept, by the replay's
own training and by ``kvwarm train`` (``--horizon auto``, the default).

On the agent profile (tool loops: nearly every block comes back within a minute) a 60 s
label is almost always positive and ranks blocks no better than recency; the choice
must go shorter there, and say every candidate's figure."""

from __future__ import annotations

import re

import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from training.train import (
    HORIZON_CANDIDATES_MS,
    TrainConfig,
    fit_policy_on_events,
    train_and_evaluate,
)


def _events(profile: str, num: int, seed: int = 0):
    rows = generate(params_for(profile, num_requests=num, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


def _figures(note: str) -> dict[int, float]:
    pairs = re.findall(r"([\d.]+) s (0\.\d+)", note.split("of ", 1)[1])
    return {round(float(h) * 1000): float(m) for h, m in pairs}


@pytest.fixture(scope="module")
def agent():
    return _events("agent", 1_200)


@pytest.mark.parametrize("time_scale", [1.0, 3.0])
def test_the_replays_training_keeps_the_horizon_that_hits_most_held_out(agent, time_scale):
    policy = fit_policy_on_events("lightgbm", agent, horizon_ms=None, time_scale=time_scale)
    note = policy.training_info["horizon"]
    figures = _figures(note)
    stretched = {max(1, int(h * time_scale)) for h in HORIZON_CANDIDATES_MS}
    assert set(figures) <= stretched and len(figures) >= 2, note
    skipped = set(figures) ^ stretched  # every candidate is fitted or said single-class
    assert all(f"{h / 1000:g} s" in note.split("single-class")[-1] for h in skipped), note
    chosen = policy.params.horizon_ms
    assert chosen == max(figures, key=figures.__getitem__), note
    assert chosen < 60_000 * time_scale  # tool loops: a minute says nothing
    assert policy.chain is None or policy.chain.params.horizon_ms == chosen


def test_a_given_horizon_is_kept_as_given(agent):
    policy = fit_policy_on_events("lightgbm", agent, horizon_ms=60_000)
    assert policy.params.horizon_ms == 60_000 and "horizon" not in policy.training_info


def test_train_chooses_the_horizon_on_the_validation_span_and_says_so(agent):
    lines: list[str] = []
    config = TrainConfig(horizon_ms=None, gate=False, baselines=("lru",))
    result = train_and_evaluate(agent, config, echo=lines.append)
    chosen = result.config.horizon_ms
    assert chosen in HORIZON_CANDIDATES_MS and result.policy.params.horizon_ms == chosen
    note = next(line for line in lines if line.startswith("horizon: "))
    figures = _figures(note)
    assert chosen == max(figures, key=figures.__getitem__)
    assert result.policy.training_info["horizon"] in note
    assert f"training lightgbm (horizon {chosen / 1000:g} s)" in "\n".join(lines)
