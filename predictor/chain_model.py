"""The per-chain return-time model: will this conversation (prefix chain) come back soon?

Most of a KV block's future is its conversation's: a chat's next turn re-reads the
whole previous prompt and extends it. ``ChainTracker`` follows chains online: a request
whose blocks contain a tracked chain's last block continues that chain (one more turn,
its think time recorded); otherwise it starts a new one. ``ChainReturnModel`` is a
LightGBM classifier of "the chain continues within H" on chain features (turns so far,
time since the last turn, think-time history, prompt length and growth, how popular the
chain's root block is, time of day). ``ChainPolicy`` scores a block by the return
probability of the latest chain that read it, and offers the blocks of the chains
most likely back as prefetch candidates (``Policy.prefetch_candidates``).

Primitives:

- ``ChainTracker(max_chains)``: ``observe(event)``, ``features(leaves, now_ms)``,
  ``chain_of(block)``; memory bounded by ``max_chains`` chains (oldest dropped).
- ``chain_dataset(events, horizon_ms, snapshot_interval_ms)``: feature rows of live
  chains at snapshot instants with their labels (continued within H), built by the
  same tracker; rows whose horizon runs past the trace are left out.
- ``ChainPolicy``: ``fit(events)`` then ``observe``/``score``/``prefetch_candidates``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field

from features.events import BlocksAccessed, Event
from predictor.base import Policy, PolicyParams, as_hash_array

CHAIN_FEATURES = (
    "turns",
    "log_since_last_turn_ms",
    "log_mean_think_ms",
    "log_last_think_ms",
    "since_over_mean_think",
    "length_blocks",
    "growth_blocks",
    "log_root_requests",
    "hour_of_day",
)


@dataclass
class _Chain:
    blocks: tuple[int, ...]
    first_ts_ms: int
    last_ts_ms: int
    turns: int = 1
    think_sum_ms: float = 0.0
    last_think_ms: float = -1.0
    prev_length: int = 0
    continued_at_ms: int = -1
    """Set when a later request continues this chain (offline labelling only)."""


@dataclass
class ChainTracker:
    """Online chain state; see the module docstring."""

    max_chains: int = 50_000
    chains: dict[int, _Chain] = field(default_factory=dict)
    """Last block of a live chain -> its state (insertion order = creation order)."""
    latest_leaf: dict[int, int] = field(default_factory=dict)
    """Block -> last block of the latest chain that read it."""
    anchors: dict[int, int] = field(default_factory=dict)
    """Last and second-to-last block of each live chain -> its leaf. The last block of
    a prompt is usually partial, so the next turn re-reads it with more tokens under
    another id; the last full block is what the next turn shares."""
    root_requests: dict[int, int] = field(default_factory=dict)
    finished: list[tuple[int, _Chain]] = field(default_factory=list)
    keep_finished: bool = False

    def observe(self, event: Event) -> None:
        if not isinstance(event, BlocksAccessed) or not event.block_hashes:
            return
        blocks = event.block_hashes
        ts = event.ts_ms
        anchor = next((b for b in reversed(blocks) if b in self.anchors), None)
        parent_leaf = self.anchors[anchor] if anchor is not None else None
        if parent_leaf is not None:
            parent = self._drop(parent_leaf)
            parent.continued_at_ms = ts
            if self.keep_finished:
                self.finished.append((parent_leaf, parent))
            think = float(ts - parent.last_ts_ms)
            chain = _Chain(
                blocks,
                parent.first_ts_ms,
                ts,
                parent.turns + 1,
                parent.think_sum_ms + think,
                think,
                len(parent.blocks),
            )
        else:
            chain = _Chain(blocks, ts, ts)
        leaf = blocks[-1]
        if leaf in self.chains:
            old = self._drop(leaf)
            if self.keep_finished:
                self.finished.append((leaf, old))
        self.chains[leaf] = chain
        for anchor_block in blocks[-2:]:
            self.anchors[anchor_block] = leaf
        for block in blocks:
            self.latest_leaf[block] = leaf
        root = blocks[0]
        self.root_requests[root] = self.root_requests.get(root, 0) + 1
        while len(self.chains) > self.max_chains:
            oldest = next(iter(self.chains))
            dropped = self._drop(oldest)
            if self.keep_finished:
                self.finished.append((oldest, dropped))

    def _drop(self, leaf: int) -> _Chain:
        chain = self.chains.pop(leaf)
        for block in chain.blocks[-2:]:
            if self.anchors.get(block) == leaf:
                del self.anchors[block]
        return chain

    def features(self, leaves: Sequence[int], now_ms: int) -> np.ndarray:
        """One row of ``CHAIN_FEATURES`` per live chain leaf (float32)."""
        out = np.zeros((len(leaves), len(CHAIN_FEATURES)), dtype=np.float32)
        for i, leaf in enumerate(leaves):
            c = self.chains[leaf]
            since = max(0, now_ms - c.last_ts_ms)
            mean_think = c.think_sum_ms / (c.turns - 1) if c.turns > 1 else -1.0
            out[i] = (
                c.turns,
                math.log1p(since),
                math.log1p(mean_think) if mean_think >= 0 else -1.0,
                math.log1p(c.last_think_ms) if c.last_think_ms >= 0 else -1.0,
                since / (mean_think + 1.0) if mean_think >= 0 else -1.0,
                len(c.blocks),
                len(c.blocks) - c.prev_length,
                math.log1p(self.root_requests.get(c.blocks[0], 0)),
                (now_ms / 3_600_000.0) % 24.0,
            )
        return out


def chain_dataset(
    events: Sequence[BlocksAccessed],
    horizon_ms: int,
    snapshot_interval_ms: int = 10_000,
    max_chain_age_ms: int = 3_600_000,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, continued within H, time since last turn in ms) of every chain idle
    for at most ``max_chain_age_ms`` at each snapshot instant."""
    tracker = ChainTracker(keep_finished=True)
    rows: list[np.ndarray] = []
    keys: list[tuple[int, int, int]] = []  # (chain id, snapshot ts, since)
    ids: dict[int, _Chain] = {}
    if not events:
        empty = np.zeros((0, len(CHAIN_FEATURES)), dtype=np.float32)
        return empty, np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
    end_ms = events[-1].ts_ms
    next_snapshot = events[0].ts_ms + snapshot_interval_ms
    for event in events:
        while event.ts_ms >= next_snapshot:
            leaves = [
                leaf
                for leaf, c in tracker.chains.items()
                if next_snapshot - c.last_ts_ms <= max_chain_age_ms
            ]
            if leaves and next_snapshot + horizon_ms <= end_ms:
                rows.append(tracker.features(leaves, next_snapshot))
                for leaf in leaves:
                    chain = tracker.chains[leaf]
                    ids[id(chain)] = chain
                    keys.append((id(chain), next_snapshot, next_snapshot - chain.last_ts_ms))
            next_snapshot += snapshot_interval_ms
        tracker.observe(event)
    if not rows:
        empty = np.zeros((0, len(CHAIN_FEATURES)), dtype=np.float32)
        return empty, np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
    x = np.concatenate(rows)
    y = np.array(
        [
            0 < ids[k].continued_at_ms - ts <= horizon_ms if ids[k].continued_at_ms >= 0 else False
            for k, ts, _ in keys
        ],
        dtype=bool,
    )
    since = np.array([s for _, _, s in keys], dtype=np.int64)
    return x, y, since


class ChainParams(PolicyParams):
    horizon_ms: int = Field(60_000, ge=1, description="Predict a chain's return within H.")
    snapshot_interval_ms: int = Field(
        10_000, ge=1, description="Training rows: live chains sampled this often."
    )
    max_chain_age_ms: int = Field(
        3_600_000, ge=1, description="Training rows: chains idle at most this long."
    )
    num_boost_round: int = Field(200, ge=1, le=10_000, description="Most trees.")
    num_leaves: int = Field(15, ge=2, le=1024, description="Leaves per tree.")
    min_data_in_leaf: int = Field(50, ge=1, description="Fewest rows in a leaf.")
    max_chains: int = Field(50_000, ge=16, description="Live chains kept (memory bound).")
    candidate_chains: int = Field(
        2_048,
        ge=1,
        description="Prefetch candidates: the chains whose last turn is among this many most "
        "recent ones are ranked (a conversation returns a median ~384 requests later on the "
        "shared trace, so the last 128 requests' blocks miss most returns).",
    )
    seed: int = Field(0, ge=0, description="Seed of training.")


class ChainPolicy(Policy):
    """Block score = P(the latest chain that read it continues within H)."""

    name = "chain"
    Params = ChainParams
    params: ChainParams
    outputs_probability = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self.tracker = ChainTracker(max_chains=self.params.max_chains)
        self.booster: Any = None
        self.training_info: dict[str, Any] = {}

    def fit(self, events: Sequence[BlocksAccessed], valid_fraction: float = 0.25) -> ChainPolicy:
        """Train on ``events`` (the last ``valid_fraction`` of rows drive early stopping)."""
        import lightgbm as lgb

        p = self.params
        x, y, _ = chain_dataset(events, p.horizon_ms, p.snapshot_interval_ms, p.max_chain_age_ms)
        if x.shape[0] < 20 or y.all() or not y.any():
            raise ValueError(
                f"{x.shape[0]} chain rows with {int(y.sum())} returns: too few to learn "
                "chain returns; use a longer trace or another horizon"
            )
        cut = int(x.shape[0] * (1 - valid_fraction))
        params = {
            "objective": "binary",
            "learning_rate": 0.05,
            "num_leaves": p.num_leaves,
            "min_data_in_leaf": p.min_data_in_leaf,
            "seed": p.seed,
            "deterministic": True,
            "num_threads": 1,
            "verbosity": -1,
        }
        train = lgb.Dataset(x[:cut], y[:cut], feature_name=list(CHAIN_FEATURES))
        valid = lgb.Dataset(x[cut:], y[cut:], reference=train)
        booster = lgb.train(
            params,
            train,
            p.num_boost_round,
            valid_sets=[valid],
            callbacks=[lgb.early_stopping(30, verbose=False)],
        )
        best = booster.best_iteration or booster.current_iteration()
        self.booster = lgb.Booster(model_str=booster.model_to_string(num_iteration=best))
        self.training_info = {"best_iteration": int(best), "rows": int(x.shape[0])}
        return self

    def fresh_copy(self) -> ChainPolicy:
        """Same params and model, empty tracker."""
        clone = ChainPolicy(self.params)
        clone.booster = self.booster
        clone.training_info = dict(self.training_info)
        return clone

    def predict_chains(self, leaves: Sequence[int], now_ms: int) -> np.ndarray:
        """P(continues within H) per live chain leaf."""
        if self.booster is None:
            raise ValueError("the chain model is not fitted: call fit(events) first")
        if not leaves:
            return np.zeros(0, dtype=np.float32)
        x = self.tracker.features(leaves, now_ms)
        return np.asarray(self.booster.predict(x, num_threads=1), dtype=np.float32)

    def observe(self, event: Event) -> None:
        self.tracker.observe(event)

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        hashes = as_hash_array(block_hashes).tolist()
        latest = self.tracker.latest_leaf
        chains = self.tracker.chains
        leaves = [latest.get(b, -1) for b in hashes]
        live = sorted({leaf for leaf in leaves if leaf in chains})
        prob = dict(zip(live, self.predict_chains(live, now_ms).tolist(), strict=True))
        return np.fromiter(
            (prob.get(leaf, 0.0) for leaf in leaves), dtype=np.float32, count=len(leaves)
        )

    def prefetch_candidates(self, now_ms: int, limit: int) -> np.ndarray:
        """Blocks of the chains most likely to continue within H, best chain first,
        among the ``candidate_chains`` most recently continued ones."""
        if self.booster is None or limit <= 0 or not self.tracker.chains:
            return np.zeros(0, dtype=np.uint64)
        chains = self.tracker.chains
        n = min(len(chains), self.params.candidate_chains)
        leaves = list(itertools.islice(reversed(chains), n))
        order = np.argsort(-self.predict_chains(leaves, now_ms), kind="stable")
        out: dict[int, None] = {}
        for i in order.tolist():
            for block in self.tracker.chains[leaves[i]].blocks:
                out[block] = None
            if len(out) >= limit:
                break
        return np.fromiter(out, dtype=np.uint64, count=len(out))[:limit]
