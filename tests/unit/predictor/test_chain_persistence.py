"""The chain return model travels with a saved learned policy (issue 12), and the chain
tracker's memory stays bounded on an endless stream.

- save -> load gives the same chain predictions and prefetch candidates;
- a directory saved without a chain model (older kvwarm) loads with ``chain`` None;
- a corrupt or missing chain file raises ``PolicyLoadError`` naming it, and the sidecar's
  model manager then serves LRU, as for a corrupt block model;
- ``latest_leaf`` holds only blocks of live chains, ``root_requests`` at most
  ``2 * max_chains`` roots, on generated and adversarial streams.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from features.events import BlocksAccessed
from predictor.base import PolicyLoadError
from predictor.chain_model import CHAIN_MODEL_FILE, ChainPolicy, ChainTracker
from predictor.registry import load_policy
from training.replay import split_events

from .conftest import generated_events

HORIZON_MS = 10_000


@pytest.fixture(scope="module")
def trained():
    from training.train import fit_policy_on_events

    train, test = split_events(generated_events("planted", 1_500, seed=1), 0.6)
    model = fit_policy_on_events("lightgbm", train, quick=True, horizon_ms=HORIZON_MS)
    assert model.chain is not None
    return model, train, test


@pytest.fixture()
def saved(trained, tmp_path) -> Path:
    model, _, _ = trained
    return model.save(tmp_path / "model")


def _warm(policy, events):
    policy.observe_many(events)
    return events[-1].ts_ms + 1


def test_save_load_round_trip_gives_the_same_chain_predictions_and_candidates(trained, saved):
    model, train, test = trained
    manifest = json.loads((saved / "policy.json").read_text())
    assert manifest["chain"]["file"] == CHAIN_MODEL_FILE
    assert CHAIN_MODEL_FILE in manifest["files"]
    assert manifest["chain"]["params"]["horizon_ms"] == HORIZON_MS
    loaded = load_policy(saved)
    assert loaded.chain is not None and loaded.chain.params == model.chain.params
    original = model.fresh_copy()
    now_ms = _warm(original, train)
    assert _warm(loaded, train) == now_ms
    leaves = list(original.chain.tracker.chains)
    assert leaves == list(loaded.chain.tracker.chains) and len(leaves) > 20
    expected = original.chain.predict_chains(leaves, now_ms)
    assert np.ptp(expected) > 0  # a model that tells chains apart
    assert np.array_equal(loaded.chain.predict_chains(leaves, now_ms), expected)
    candidates = original.prefetch_candidates(now_ms, 256)
    assert candidates.shape[0] > 0
    assert np.array_equal(loaded.prefetch_candidates(now_ms, 256), candidates)
    # The block model is unchanged by the chain model beside it.
    blocks = np.unique(np.fromiter((b for e in test[:50] for b in e.block_hashes), np.uint64))
    assert np.array_equal(loaded.score(blocks, now_ms), original.score(blocks, now_ms))
    assert loaded.model_size_bytes() == sum(
        (saved / name).stat().st_size for name in manifest["files"]
    )


def test_fresh_copy_and_resave_keep_the_chain_model(trained, saved, tmp_path):
    loaded = load_policy(saved)
    copy = loaded.fresh_copy()
    assert copy.chain is not None and copy.chain is not loaded.chain
    assert copy.chain.booster is loaded.chain.booster and not copy.chain.tracker.chains
    again = load_policy(copy.save(tmp_path / "again"))
    assert again.chain is not None
    assert (tmp_path / "again" / CHAIN_MODEL_FILE).read_text() == (
        saved / CHAIN_MODEL_FILE
    ).read_text()


def test_a_directory_without_a_chain_model_loads_with_chain_none(trained, saved):
    _, train, _ = trained
    manifest = json.loads((saved / "policy.json").read_text())
    del manifest["chain"]
    manifest["files"].remove(CHAIN_MODEL_FILE)
    (saved / "policy.json").write_text(json.dumps(manifest))
    (saved / CHAIN_MODEL_FILE).unlink()
    old = load_policy(saved)
    assert old.chain is None
    now_ms = _warm(old, train)
    assert old.prefetch_candidates(now_ms, 256).shape == (0,)


def test_saving_a_policy_without_a_chain_drops_a_stale_chain_file(trained, saved):
    loaded = load_policy(saved)
    loaded.chain = None
    loaded.save(saved)
    assert not (saved / CHAIN_MODEL_FILE).exists()
    assert load_policy(saved).chain is None


def _block_model_text(saved: Path) -> str:
    return (saved / "model.txt").read_text()


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda d: "this is not a LightGBM model\n", id="garbage"),
        pytest.param(lambda d: (d / CHAIN_MODEL_FILE).read_text()[:400], id="truncated"),
        pytest.param(
            lambda d: (
                (d / CHAIN_MODEL_FILE).read_text().replace("split_feature=", "split_feature=99 ", 1)
            ),
            id="extra-split-feature",
        ),
        pytest.param(_block_model_text, id="block-model-as-chain-model"),
        pytest.param(lambda d: b"\xff\xfe\x00garbage", id="not-utf8"),
    ],
)
def test_a_corrupt_chain_file_raises_policy_load_error_naming_it(saved, corrupt):
    data = corrupt(saved)
    path = saved / CHAIN_MODEL_FILE
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    with pytest.raises(PolicyLoadError) as err:
        load_policy(saved)
    assert CHAIN_MODEL_FILE in str(err.value)
    assert Path(err.value.path).name == CHAIN_MODEL_FILE


def test_a_missing_chain_file_named_by_the_manifest_is_refused(saved):
    (saved / CHAIN_MODEL_FILE).unlink()
    with pytest.raises(PolicyLoadError, match=CHAIN_MODEL_FILE):
        load_policy(saved)


def test_a_bad_chain_manifest_entry_is_refused(saved):
    manifest = json.loads((saved / "policy.json").read_text())
    manifest["chain"]["params"]["num_leaves"] = 1
    (saved / "policy.json").write_text(json.dumps(manifest))
    with pytest.raises(PolicyLoadError, match="chain model parameters"):
        load_policy(saved)


def test_the_model_manager_serves_lru_when_the_chain_file_is_corrupt(saved, tmp_path):
    from serving.model_lifecycle import ModelManager

    good = ModelManager(str(saved))
    assert good.load_initial().name == "lightgbm" and good.status.degraded is None
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    (broken / CHAIN_MODEL_FILE).write_text("tree\nversion=v4\nnum_class=1\n")
    manager = ModelManager(str(broken))
    policy = manager.load_initial()
    assert policy.name == "lru"
    status = manager.status
    assert status.status == "degraded" and status.degraded == "load_failed"
    assert CHAIN_MODEL_FILE in status.reason


def test_a_learned_policys_chain_without_a_blend_keeps_no_block_map(trained):
    model, train, _ = trained
    copy = model.fresh_copy()
    copy.chain.blend = None  # what training leaves where the blend does not help
    copy.chain = copy.chain
    copy.observe_many(train)
    assert copy.chain.tracker.chains and not copy.chain.tracker.latest_leaf
    with pytest.raises(ValueError, match="prefetch candidates only"):
        copy.chain.score(np.array([1], dtype=np.uint64), 0)


# -- bounded memory ------------------------------------------------------------------------


def _check_bounds(tracker: ChainTracker, reference: dict[int, int]) -> None:
    chains = tracker.chains
    assert len(chains) <= tracker.max_chains
    live_blocks = sum(len(c.blocks) for c in chains.values())
    assert len(tracker.latest_leaf) <= live_blocks
    assert len(tracker.anchors) <= 2 * len(chains)
    assert len(tracker.root_requests) <= 2 * tracker.max_chains
    assert {c.blocks[0] for c in chains.values()} <= set(tracker.root_requests)
    # Exactly the unbounded map restricted to blocks of the chain it names, if live:
    # what score reads is unchanged by forgetting.
    expected = {
        b: leaf for b, leaf in reference.items() if leaf in chains and b in chains[leaf].blocks
    }
    assert tracker.latest_leaf == expected


def test_latest_leaf_and_root_requests_stay_bounded_on_a_long_generated_stream():
    events = generated_events("mixed", 6_000, seed=11)
    tracker = ChainTracker(max_chains=64)
    reference: dict[int, int] = {}
    peak = 0
    for i, event in enumerate(events):
        tracker.observe(event)
        for b in event.block_hashes:
            reference[b] = event.block_hashes[-1]
        peak = max(peak, len(tracker.latest_leaf))
        if i % 500 == 499:
            _check_bounds(tracker, reference)
    _check_bounds(tracker, reference)
    assert len(reference) > 20 * peak  # the stream is far bigger than what is kept


def test_bounds_hold_on_an_adversarial_stream():
    """Every request a new root (root counts must be pruned), repeated leaves with other
    prefixes (the replaced chain's blocks must go), one popular root (two requests every
    40: no live chain has it for most prunes, its count keeps it)."""
    rng = np.random.default_rng(0)
    tracker = ChainTracker(max_chains=16)
    reference: dict[int, int] = {}
    popular = 10**18
    popular_count = 0
    for i in range(4_000):
        if i % 40 in (0, 1):
            blocks = (popular, 10**17 + i)
            popular_count += 1
        else:
            tail = int(rng.integers(1, 40))  # small: leaves repeat with other prefixes
            blocks = (i + 1, *range(10**6 + i, 10**6 + i + int(rng.integers(0, 5))), tail)
        blocks = tuple(dict.fromkeys(blocks))
        tracker.observe(BlocksAccessed(i * 1_000, str(i), blocks, 16))
        for b in blocks:
            reference[b] = blocks[-1]
        _check_bounds(tracker, reference)
    assert tracker.root_requests[popular] == popular_count  # never pruned: most requested


def test_chain_table_round_trip_rebuilds_the_same_chains():
    events = generated_events("chat", 800, seed=2)
    tracker = ChainTracker(max_chains=128)
    for event in events:
        tracker.observe(event)
    other = ChainTracker(max_chains=128)
    other.chain_table = {k: v.copy() for k, v in tracker.chain_table.items()}
    assert list(other.chains) == list(tracker.chains)
    assert other.chains == tracker.chains
    bad = dict(tracker.chain_table)
    bad["length"] = bad["length"] + 1
    with pytest.raises(ValueError, match="lengths"):
        other.chain_table = bad
    with pytest.raises(ValueError, match="keeps 16"):
        ChainTracker(max_chains=16).chain_table = tracker.chain_table


def test_chain_policy_fresh_copy_keeps_the_block_map_setting():
    policy = ChainPolicy()
    policy.tracker.index_blocks = False
    assert policy.fresh_copy().tracker.index_blocks is False


def test_a_hot_swap_hands_the_chain_tracker_over_with_the_feature_state(trained, tmp_path):
    from serving.loop import Sidecar
    from serving.model_lifecycle import ModelManager
    from serving.placement import Placement
    from serving.planner import Planner

    model, train, _ = trained
    path = model.save(tmp_path / "model")
    manager = ModelManager(str(path))
    sidecar = Sidecar(manager.load_initial(), Planner(), Placement(["hbm", "dram"], [64, 512]))
    manager.attach(sidecar)
    for event in train[:300]:
        sidecar.handle(event)
    state, tracker = sidecar.policy.state, sidecar.policy.chain.tracker
    assert tracker.chains
    newer = load_policy(path)
    newer.chain.params = newer.chain.params.model_copy(update={"candidate_chains": 512})
    newer.save(path)  # a new version lands at the same path
    assert manager.check_for_update() is True
    assert sidecar.policy.state is state and sidecar.policy.chain.tracker is tracker
    assert sidecar.policy.chain.params.candidate_chains == 512
