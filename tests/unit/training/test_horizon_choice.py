"""The horizon is chosen per workload (issue 12): a quick fit at each candidate horizon,
replayed on the held-out requests, and the one that hits most is kept, by the replay's
own training and by ``kvwarm train`` (``--horizon auto``, the default).

On the agent profile (tool loops: nearly every block comes back within a minute) a 60 s
label is almost always positive and ranks blocks no better than recency; the choice
must go shorter there, and say every candidate's figure."""

from __future__ import annotations

import re

import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from predictor.registry import make_policy
from training.dataset import build_dataset
from training.replay import split_events
from training.train import (
    DEFAULT_HORIZON_MS,
    FIT_MARGIN,
    HORIZON_CANDIDATES_MS,
    HORIZON_MARGIN,
    TrainConfig,
    choose_horizon,
    fit_learned,
    fit_policy_on_events,
    holdout_capacities,
    holdout_hit_ratios,
    keep_better_fit,
    quick_model_params,
    train_and_evaluate,
)


def _events(profile: str, num: int, seed: int = 0):
    rows = generate(params_for(profile, num_requests=num, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


def _check_choice(note: str, chosen: int, default_ms: int) -> None:
    """The best held-out figure wins, unless it beats the default's by less than the
    margin: then the default is kept, and the note says so."""
    figures = _figures(note)
    best = max(figures, key=figures.__getitem__)
    if (
        default_ms in figures  # else single-class there: the best wins
        and best != default_ms
        and figures[best] < figures[default_ms] * (1 + HORIZON_MARGIN)
    ):
        assert chosen == default_ms and "the default" in note, note
    else:
        assert chosen == best and "the best held-out hit ratio" in note, note


def _figures(note: str) -> dict[int, float]:
    pairs = re.findall(r"([\d.]+) s (0\.\d+)", note.split(") of ", 1)[1])
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
    _check_choice(note, chosen, int(DEFAULT_HORIZON_MS * time_scale))
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
    _check_choice(note, chosen, DEFAULT_HORIZON_MS)
    assert result.policy.training_info["horizon"] in note
    assert f"training lightgbm (horizon {chosen / 1000:g} s)" in "\n".join(lines)


def test_a_candidate_must_clearly_beat_the_default_to_be_chosen(agent):

    warm, holdout = split_events(agent, 0.75)
    cut = warm[-1].ts_ms
    rows = build_dataset(agent, horizons_ms=(10_000, 60_000), snapshot_interval_ms=10_000)
    train = rows.take(np.flatnonzero(rows.ts_ms <= cut), end_ts_ms=cut)
    valid = rows.take(np.flatnonzero(rows.ts_ms > cut))
    params = quick_model_params("lightgbm")
    free, _, free_note, _ = choose_horizon(
        "lightgbm", train, valid, warm, holdout, model_params=params
    )
    figures = _figures(free_note)
    assert free == max(figures, key=figures.__getitem__)  # no default: the best wins
    # The default is kept unless beaten by the margin.
    kept, _, kept_note, _ = choose_horizon(
        "lightgbm", train, valid, warm, holdout, model_params=params, default_ms=60_000
    )
    _check_choice(kept_note, kept, 60_000)


def _agent_parts(agent):
    warm, holdout = split_events(agent, 0.75)
    cut = warm[-1].ts_ms
    rows = build_dataset(agent, horizons_ms=(10_000,), snapshot_interval_ms=10_000)
    train = rows.take(np.flatnonzero(rows.ts_ms <= cut), end_ts_ms=cut)
    valid = rows.take(np.flatnonzero(rows.ts_ms > cut))
    return warm, holdout, train, valid


def test_a_full_fit_that_holds_out_worse_than_the_quick_one_is_not_kept(agent):
    """The quick fit of the horizon choice against a "full" fit trained on shuffled
    labels: the broken one ranks blocks at random, holds out worse, and is not kept."""
    warm, holdout, train, valid = _agent_parts(agent)
    params = quick_model_params("lightgbm")
    choice = choose_horizon("lightgbm", train, valid, warm, holdout, model_params=params)
    key = "reused_within_10000ms"
    broken_rows = train.take(np.arange(train.num_rows))
    broken_rows.labels[key] = np.random.default_rng(0).permutation(train.labels[key])
    broken = fit_learned("lightgbm", broken_rows, valid, horizon_ms=10_000, model_params=params)
    blocks = holdout_capacities(holdout, (0.01, 0.05, 0.1))
    figures = holdout_hit_ratios(broken.fresh_copy(), warm, holdout, blocks)
    assert np.mean(choice.hit_ratios) > np.mean(figures) * (1 + FIT_MARGIN)  # the planted gap
    kept, note = keep_better_fit(figures, broken, choice.hit_ratios, choice.policy)
    assert kept is choice.policy and note.startswith("quick fit kept")
    assert f"{np.mean(figures):.4f} full, {np.mean(choice.hit_ratios):.4f} quick" in note
    assert kept.training_info["fit"] == note and "fit" not in broken.training_info


@pytest.mark.parametrize(
    ("full", "quick", "kept"),
    [
        ((0.10, 0.20, 0.30), (0.10, 0.20, 0.30), "full"),  # a tie keeps the full fit
        ((0.10, 0.20, 0.30), (0.10, 0.20, 0.30 + 0.017), "full"),  # +2.8% of the mean: under
        ((0.10, 0.20, 0.30), (0.10, 0.20, 0.30 + 0.019), "quick"),  # +3.2%: over the margin
        ((0.10, 0.20, 0.30), (0.05, 0.10, 0.15), "full"),
    ],
)
def test_the_full_fit_is_kept_unless_the_quick_one_beats_it_by_the_margin(full, quick, kept):
    policies = {"full": make_policy("lightgbm"), "quick": make_policy("lightgbm")}
    chosen, note = keep_better_fit(list(full), policies["full"], list(quick), policies["quick"])
    assert chosen is policies[kept] and note.startswith(f"{kept} fit kept")
    assert f"{np.mean(full):.4f} full, {np.mean(quick):.4f} quick" in note


def test_the_replays_full_training_says_which_fit_it_kept_and_why(agent):
    policy = fit_policy_on_events("lightgbm", agent, horizon_ms=None, quick=False)
    note = policy.training_info["fit"]
    full, quick = (float(v) for v in re.findall(r"(0\.\d+) (?:full|quick)", note))
    if quick > full * (1 + FIT_MARGIN):
        assert note.startswith("quick fit kept")
        assert policy.params.num_boost_round == quick_model_params("lightgbm")["num_boost_round"]
    else:
        assert note.startswith("full fit kept")
        assert policy.params.num_boost_round > quick_model_params("lightgbm")["num_boost_round"]
    assert policy.training_info["horizon"].startswith("horizon: ")


def test_train_makes_the_fit_choice_as_the_replay_does_and_says_so(agent):
    lines: list[str] = []
    config = TrainConfig(horizon_ms=None, gate=False, baselines=("lru",))
    result = train_and_evaluate(agent, config, echo=lines.append)
    note = result.policy.training_info["fit"]
    assert any(line.startswith(note) for line in lines)
    full, quick = (float(v) for v in re.findall(r"(0\.\d+) (?:full|quick)", note))
    quick_trees = quick_model_params("lightgbm")["num_boost_round"]
    if quick > full * (1 + FIT_MARGIN):
        assert note.startswith("quick fit kept")
        assert result.policy.params.num_boost_round == quick_trees
    else:
        assert note.startswith("full fit kept")
        assert result.policy.params.num_boost_round > quick_trees
    # The kept policy is the one evaluated and registered: its horizon note goes with it.
    assert result.policy.training_info["horizon"].startswith("horizon: ")


def test_train_with_model_params_given_trains_what_was_asked(agent):
    config = TrainConfig(
        horizon_ms=None, gate=False, baselines=("lru",), model_params={"num_boost_round": 25}
    )
    result = train_and_evaluate(agent, config)
    assert "fit" not in result.policy.training_info
    assert result.policy.params.num_boost_round == 25
