"""The chain blend (issue 12): a learned policy folds its chain return model's
probabilities into every block score, where training found that it hits more.

- ``ChainBlend`` refuses weights that are not finite or absurdly large, and round-trips
  through its manifest form;
- a policy with a blend scores ``blend.apply(model scores, the chain's block scores)``,
  with exact and with stored scores; without one, the block model alone;
- save -> load keeps the blend; a bad blend entry is refused naming the manifest;
- ``scores_at_rows`` answers each dataset row as a tracker that saw exactly the events
  before it would;
- training keeps a blend only when the held-out replay hits more with it (its note gives
  both figures), and refuses it on the shared-prefix workload, where boosting
  conversation tails over shared prefixes evicts worse;
- a checkpoint carries the block -> chain map; a hot swap to a blending model turns the
  map on for the tracker it takes over.
"""

from __future__ import annotations

import json
import math
import pickle
import re

import numpy as np
import pytest

from predictor.base import PolicyLoadError
from predictor.chain_model import ChainBlend, ChainTracker
from predictor.learned import LearnedPolicy
from predictor.registry import load_policy
from training.dataset import build_dataset
from training.replay import split_events

from .conftest import generated_events

HORIZON_MS = 10_000
BLEND = ChainBlend((1.1, 0.7, 0.4), -0.2)


@pytest.fixture(scope="module")
def trained():
    from training.train import fit_policy_on_events

    train, test = split_events(generated_events("chat", 1_200, seed=2), 0.6)
    model = fit_policy_on_events("lightgbm", train, quick=True, horizon_ms=HORIZON_MS)
    assert model.chain is not None
    return model, train, test


def _with_blend(model: LearnedPolicy, blend: ChainBlend | None) -> LearnedPolicy:
    policy = model.fresh_copy()
    assert policy.chain is not None
    policy.chain.blend = blend
    policy.chain = policy.chain  # the setter turns the block -> chain map on or off
    return policy


def _blocks(events) -> np.ndarray:
    return np.unique(np.fromiter((b for e in events for b in e.block_hashes), np.uint64))


@pytest.mark.parametrize(
    "coef, intercept",
    [((1.0, math.nan, 0.0), 0.0), ((1.0, 0.0, 0.0), math.inf), ((1.0, 0.0), 0.0), ((1e4, 0, 0), 0)],
)
def test_a_blend_with_bad_weights_is_refused(coef, intercept):
    with pytest.raises(ValueError, match="chain blend"):
        ChainBlend(coef, intercept)


def test_a_blend_equals_its_logistic_regression_written_plainly():
    """``apply`` (one pass over both logits, clipping by maximum and minimum, the
    sigmoid in place) gives the float32 values of the regression written with np.clip
    and column_stack, bit for bit, extremes, NaN and blocks of no chain included."""
    rng = np.random.default_rng(3)
    block = rng.random(4_000).astype(np.float32)
    chain = rng.random(4_000).astype(np.float32)
    block[:6] = [0.0, 1.0, 1e-9, 1 - 1e-9, np.nan, 0.5]
    chain[6:12] = [0.0, 1.0, 1e-9, 1 - 1e-9, np.nan, 0.5]
    has = rng.random(4_000) < 0.7

    def logit(p):
        q = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1.0 - 1e-6)
        return np.log(q / (1.0 - q))

    for blend in (BLEND, ChainBlend((0.95, 0.36, 0.40), 0.28)):
        design = np.column_stack((logit(block), np.where(has, logit(chain), 0.0), has * 1.0))
        z = design @ np.asarray(blend.coef) + blend.intercept
        plain = (1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))).astype(np.float32)
        np.testing.assert_array_equal(blend.apply(block, chain, has), plain)
        for n in (0, 1, 7):
            np.testing.assert_array_equal(blend.apply(block[:n], chain[:n], has[:n]), plain[:n])
        # A copy (a replay job's pickle, a state handed over) scores the same.
        copied = pickle.loads(pickle.dumps(blend))
        assert copied == blend
        np.testing.assert_array_equal(copied.apply(block, chain, has), plain)


def test_a_blend_round_trips_and_is_monotone_in_both_scores():
    assert ChainBlend.from_dict(json.loads(json.dumps(BLEND.to_dict()))) == BLEND
    grid = np.linspace(0.01, 0.99, 25)
    has = np.ones_like(grid, dtype=bool)
    assert np.all(np.diff(BLEND.apply(grid, np.full_like(grid, 0.5), has)) > 0)
    assert np.all(np.diff(BLEND.apply(np.full_like(grid, 0.5), grid, has)) > 0)
    # A block of no live chain ignores the chain input.
    none = ~has
    assert np.array_equal(BLEND.apply(grid, grid, none), BLEND.apply(grid, grid * 0, none))


@pytest.mark.parametrize("max_age_ms", [0, 5_000])
def test_a_blending_policy_scores_the_blend_of_both_models(trained, max_age_ms):
    model, train, test = trained
    plain = _with_blend(model, None)
    blended = _with_blend(model, BLEND)
    blended.set_score_max_age(max_age_ms)
    for policy in (plain, blended):
        policy.observe_many(train)
    assert blended.chain.tracker.latest_leaf and not plain.chain.tracker.latest_leaf
    now_ms = train[-1].ts_ms + 1
    blocks = np.concatenate([_blocks(train[-40:]), _blocks(test[:20])])
    base = plain.score(blocks, now_ms)
    returns, has = blended.chain.block_scores(blocks, now_ms)
    assert has.any() and not has.all()  # blocks of live chains and unseen ones
    expected = BLEND.apply(base, returns, has)
    assert np.allclose(blended.score(blocks, now_ms), expected, atol=1e-6)
    # Asked again (stored scores, when on), the same answer.
    assert np.allclose(blended.score(blocks, now_ms), expected, atol=1e-6)


def test_save_load_keeps_the_blend_and_a_bad_one_is_refused(trained, tmp_path):
    model, train, test = trained
    blended = _with_blend(model, BLEND)
    directory = blended.save(tmp_path / "model")
    manifest_path = directory / "policy.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["chain"]["blend"] == BLEND.to_dict()
    loaded = load_policy(directory)
    assert loaded.chain.blend == BLEND and loaded.chain.tracker.index_blocks
    for policy in (loaded, blended):
        policy.observe_many(train)
    now_ms = train[-1].ts_ms + 1
    blocks = _blocks(train[-30:])
    assert np.array_equal(loaded.score(blocks, now_ms), blended.score(blocks, now_ms))
    manifest["chain"]["blend"] = {"coef": [1.0, "x", 0.0], "intercept": 0.0}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(PolicyLoadError, match="invalid chain blend") as info:
        load_policy(directory)
    assert "policy.json" in str(info.value)


def test_scores_at_rows_are_what_a_tracker_answered_at_each_row(trained):
    model, train, _ = trained
    chain = model.chain
    events = train[:300]
    rows = build_dataset(
        events, horizons_ms=(HORIZON_MS,), snapshot_interval_ms=5_000, snapshot_blocks=32
    )
    assert rows.is_snapshot.any() and not rows.is_snapshot.all()
    scores, has = chain.scores_at_rows(events, rows.num_events_seen, rows.ts_ms, rows.block_hashes)
    assert has.any() and not has.all()
    # Every row, one by one, against a tracker that has seen exactly its events.
    probe = chain.fresh_copy()
    probe.tracker = ChainTracker(max_chains=chain.params.max_chains, index_blocks=True)
    for seen, event in enumerate(events, start=1):
        probe.observe(event)
        for row in np.flatnonzero(rows.num_events_seen == seen).tolist():
            block = rows.block_hashes[row : row + 1]
            expected, expected_has = probe.block_scores(block, int(rows.ts_ms[row]))
            assert (has[row], scores[row]) == (expected_has[0], expected[0]), row
    assert not chain.tracker.latest_leaf  # its own tracker is untouched


def _figures(note: str) -> tuple[float, float]:
    found = re.search(r"held-out hit ratio ([\d.]+) with it, ([\d.]+) without", note)
    assert found, note
    return float(found.group(1)), float(found.group(2))


@pytest.mark.parametrize("profile", ["scan", "sharedprefix"])
def test_training_keeps_a_blend_only_where_the_held_out_replay_hits_more(profile):
    from training.train import fit_policy_on_events

    events = generated_events(profile, 1_200, seed=0)
    policy = fit_policy_on_events("lightgbm", events, quick=True)
    note = policy.training_info["chain_blend"]
    with_it, without = _figures(note)
    kept = note.startswith("chain blend: kept")
    assert kept == (with_it > without) == (policy.chain.blend is not None)
    assert policy.chain.tracker.index_blocks == kept
    if profile == "sharedprefix":
        assert not kept  # long shared prefixes: the block model alone evicts better


def test_a_checkpoint_carries_the_block_map_and_a_hot_swap_turns_it_on(trained):
    from serving.checkpoint import capture, fresh_policy, restore
    from serving.state_store import decode_state, encode_state

    model, train, test = trained
    live = _with_blend(model, BLEND)
    live.observe_many(train)
    tree = decode_state(encode_state(capture(live, copy=True)))
    restored = fresh_policy(live)
    restore(restored, tree)
    assert restored.chain.tracker.latest_leaf == live.chain.tracker.latest_leaf
    now_ms = train[-1].ts_ms + 1
    blocks = _blocks(train[-30:])
    assert np.array_equal(restored.score(blocks, now_ms), live.score(blocks, now_ms))
    # Hot swap: a model without a blend hands its tracker (no block map) to one with.
    outgoing = _with_blend(model, None)
    outgoing.observe_many(train)
    incoming = _with_blend(model, BLEND)
    assert incoming.adopt_state(outgoing.handover_state())
    assert incoming.chain.tracker is outgoing.chain.tracker
    assert incoming.chain.tracker.index_blocks
    incoming.observe_many(test[:50])
    assert incoming.chain.tracker.latest_leaf
    assert np.isfinite(incoming.score(_blocks(test[:50]), test[49].ts_ms + 1)).all()
