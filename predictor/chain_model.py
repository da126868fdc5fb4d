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

- ``ChainTracker(max_chains)``: ``observe(event)``, ``features(leaves, now_ms)``;
  memory bounded by ``max_chains`` chains (oldest dropped): the block -> chain map holds
  only blocks of live chains, and the root counts at most ``2 * max_chains`` roots
  (see ``ChainTracker``). ``chain_table`` is the live chains as parallel arrays (what
  ``serving.checkpoint`` captures and restores).
- ``chain_dataset(events, horizon_ms, snapshot_interval_ms)``: feature rows of live
  chains at snapshot instants with their labels (continued within H), built by the
  same tracker; rows whose horizon runs past the trace are left out.
- ``ChainPolicy``: ``fit(events)`` then ``observe``/``score``/``prefetch_candidates``;
  ``save_model(directory)`` / ``load_model(directory, entry)``: the booster as
  LightGBM text (``chain_model.txt``) plus a manifest entry (params, file), read back
  through the same checks as the block model (``predictor.model_check``,
  ``predictor.trees``); any problem raises ``PolicyLoadError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field, ValidationError

from features.events import BlocksAccessed, Event
from predictor.base import Policy, PolicyLoadError, PolicyParams, as_hash_array

if TYPE_CHECKING:
    from predictor.lightgbm_policy import TreeModel

CHAIN_MODEL_FILE = "chain_model.txt"
"""The chain booster in a saved learned-policy directory (LightGBM text model)."""

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


_CHAIN_COLUMNS: dict[str, Any] = {
    f.name: np.float64 if f.type == "float" else np.int64
    for f in dataclasses.fields(_Chain)
    if f.name != "blocks"
}
"""``_Chain``'s scalar fields in order, with the dtype of their ``chain_table`` column."""


_ROW_PATH_MAX_CHAINS = 32
"""``ChainTracker.features`` of at most this many chains is computed row by row
(Python floats), of more column by column (numpy): the cheaper of the two (they cross
near 50 chains on the shared trace)."""


def _column(chains: Sequence[_Chain], name: str, dtype: Any) -> np.ndarray:
    """Field ``name`` of every chain as one array."""
    return np.fromiter(map(attrgetter(name), chains), dtype=dtype, count=len(chains))


@dataclass
class ChainTracker:
    """Online chain state; see the module docstring.

    Memory is bounded on an endless stream: at most ``max_chains`` live chains (the
    oldest dropped), ``anchors`` at most two entries per live chain, ``latest_leaf``
    only blocks of live chains (a dropped chain's blocks that still point to it are
    forgotten when it is dropped: their score was 0 already, a dead chain scores
    nothing) and ``root_requests`` at most ``2 * max_chains`` roots (over that, the roots
    of live chains are kept with the ``max_chains // 2`` most requested others; the
    rest start again from 0 if they come back)."""

    max_chains: int = 50_000
    chains: dict[int, _Chain] = field(default_factory=dict)
    """Last block of a live chain -> its state (insertion order = creation order)."""
    latest_leaf: dict[int, int] = field(default_factory=dict)
    """Block of a live chain -> last block of the latest live chain that read it."""
    anchors: dict[int, int] = field(default_factory=dict)
    """Last and second-to-last block of each live chain -> its leaf. The last block of
    a prompt is usually partial, so the next turn re-reads it with more tokens under
    another id; the last full block is what the next turn shares."""
    root_requests: dict[int, int] = field(default_factory=dict)
    """First block of a request -> requests seen with it (bounded, see above)."""
    finished: list[tuple[int, _Chain]] = field(default_factory=list)
    keep_finished: bool = False
    index_blocks: bool = True
    """Keep ``latest_leaf`` (what ``ChainPolicy.score`` reads). Off where only chains
    matter (training rows, a learned policy's prefetch candidates): observe then
    touches no per-block map at all."""

    @property
    def max_roots(self) -> int:
        return 2 * self.max_chains

    def keep_block_map(self, on: bool) -> None:
        """Keep ``latest_leaf`` from the next request on, or stop and drop it."""
        self.index_blocks = on
        if not on:
            self.latest_leaf.clear()

    def observe(self, event: Event) -> None:
        if not isinstance(event, BlocksAccessed) or not event.block_hashes:
            return
        blocks = event.block_hashes
        ts = event.ts_ms
        chains = self.chains
        anchors = self.anchors
        anchor = next((b for b in reversed(blocks) if b in anchors), None)
        parent_leaf = anchors[anchor] if anchor is not None else None
        parent = None
        if parent_leaf is not None:
            parent = self._drop(parent_leaf)
            parent.continued_at_ms = ts
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
        replaced = self._drop(leaf) if leaf in chains else None
        chains[leaf] = chain
        for anchor_block in blocks[-2:]:
            anchors[anchor_block] = leaf
        index = self.index_blocks
        if index:
            self.latest_leaf.update(zip(blocks, itertools.repeat(leaf)))
        root = blocks[0]
        roots = self.root_requests
        count = roots.get(root)
        if count is None:
            roots[root] = 1
            if len(roots) > self.max_roots:
                self._prune_roots()
        else:
            roots[root] = count + 1
        # Forget the dropped chains' blocks that still point to them (after the new
        # chain wrote its own, so a continued chain's shared prefix is skipped).
        if parent is not None:
            assert parent_leaf is not None
            if index:
                self._forget(parent_leaf, parent, leaf, blocks)
            if self.keep_finished:
                self.finished.append((parent_leaf, parent))
        if replaced is not None:
            if index:
                self._forget(leaf, replaced, leaf, blocks)
            if self.keep_finished:
                self.finished.append((leaf, replaced))
        while len(chains) > self.max_chains:
            oldest = next(iter(chains))
            dropped = self._drop(oldest)
            if index:
                self._forget(oldest, dropped, leaf, blocks)
            if self.keep_finished:
                self.finished.append((oldest, dropped))

    def _drop(self, leaf: int) -> _Chain:
        chain = self.chains.pop(leaf)
        for block in chain.blocks[-2:]:
            if self.anchors.get(block) == leaf:
                del self.anchors[block]
        return chain

    def _forget(self, leaf: int, chain: _Chain, new_leaf: int, new_blocks: tuple[int, ...]) -> None:
        """Drop the ``latest_leaf`` entries of the dropped ``chain`` (at ``leaf``) that
        still point to it. Called after the new request (``new_blocks``, at
        ``new_leaf``) wrote its entries: the blocks it shares with ``chain`` point to it
        already, and a shared prefix (a continued turn) is skipped by one comparison.
        The scan runs in C (map/compress): the eviction of the oldest chain, once per
        new chain at ``max_chains``, scans every block of it."""
        latest = self.latest_leaf
        old = chain.blocks
        if leaf == new_leaf:  # the new chain took the same leaf (a repeated prompt)
            keep = set(new_blocks)
            stale = [b for b in old if b not in keep and latest.get(b) == leaf]
        else:
            n = len(old) - 1
            if n > 0 and new_blocks[:n] == old[:n]:
                old = old[n:]  # all but the last block were rewritten by new_blocks
            # Block hashes are >= 0, so the default -1 never equals a leaf.
            points_here = map(leaf.__eq__, map(latest.get, old, itertools.repeat(-1)))
            stale = list(itertools.compress(old, points_here))
        for block in stale:
            del latest[block]

    def _prune_roots(self) -> None:
        """Keep the roots of live chains and the ``max_chains // 2`` most requested
        others (the later seen first among equals); insertion order is kept."""
        live = {c.blocks[0] for c in self.chains.values()}
        roots = self.root_requests
        others = [(n, i, r) for i, (r, n) in enumerate(roots.items()) if r not in live]
        others.sort(reverse=True)
        kept = {r for _, _, r in others[: self.max_chains // 2]}
        self.root_requests = {r: n for r, n in roots.items() if r in live or r in kept}

    # -- checkpoint form ----------------------------------------------------------------

    @property
    def chain_table(self) -> dict[str, np.ndarray]:
        """The live chains as parallel arrays, oldest first (``serving.checkpoint``
        captures this; assigning it back rebuilds ``chains``): ``leaf``, ``length``,
        ``blocks`` (concatenated, ``length`` per chain) and one column per ``_Chain``
        field (``_CHAIN_COLUMNS``)."""
        chains = list(self.chains.values())
        n = len(chains)
        table = {
            "leaf": np.fromiter(self.chains, dtype=np.uint64, count=n),
            "length": np.fromiter(map(len, map(attrgetter("blocks"), chains)), np.int64, n),
            "blocks": np.fromiter(
                itertools.chain.from_iterable(c.blocks for c in chains),
                dtype=np.uint64,
                count=sum(len(c.blocks) for c in chains),
            ),
        }
        for name, dtype in _CHAIN_COLUMNS.items():
            table[name] = _column(chains, name, dtype)
        return table

    @chain_table.setter
    def chain_table(self, table: Any) -> None:
        names = ("leaf", "length", "blocks", *_CHAIN_COLUMNS)
        if not isinstance(table, dict) or any(k not in table for k in names):
            raise ValueError(f"a chain table needs the arrays {', '.join(names)}")
        cols = {k: np.asarray(table[k]) for k in names}
        n = cols["leaf"].shape[0]
        if any(cols[k].shape != (n,) for k in names if k != "blocks"):
            raise ValueError("chain table columns differ in length")
        lengths = cols["length"].astype(np.int64)
        if (lengths < 1).any() or int(lengths.sum()) != cols["blocks"].shape[0]:
            raise ValueError("chain table block lengths do not add up to its blocks")
        if n > self.max_chains:
            raise ValueError(f"{n} chains in the table, this tracker keeps {self.max_chains}")
        blocks = cols["blocks"].tolist()
        ends = np.cumsum(lengths).tolist()
        scalars = zip(
            *(cols[name].astype(dtype).tolist() for name, dtype in _CHAIN_COLUMNS.items()),
            strict=True,
        )
        chains: dict[int, _Chain] = {}
        for leaf, end, length, values in zip(
            cols["leaf"].tolist(), ends, lengths.tolist(), scalars, strict=True
        ):
            chain_blocks = tuple(blocks[end - length : end])
            if chain_blocks[-1] != leaf:
                raise ValueError(f"chain table: chain at {leaf} does not end with it")
            chains[leaf] = _Chain(chain_blocks, *values)
        if len(chains) != n:
            raise ValueError("chain table: a leaf appears twice")
        self.chains = chains

    def features(self, leaves: Sequence[int], now_ms: int) -> np.ndarray:
        """One row of ``CHAIN_FEATURES`` per live chain leaf (float32): column by column
        (``features_by_column``; a prefetch round asks for ~2,000 chains) or, for a
        few, row by row (``features_row``, the same row computed as Python scalars)."""
        if not leaves or len(leaves) > _ROW_PATH_MAX_CHAINS:
            return self.features_by_column(leaves, now_ms)
        # Few chains (a request's own, scored for the admission veto): the row
        # definition costs less than ~20 numpy calls (1.5 against 21 us for one chain)
        # and gives the same float32 values (a test holds the two paths equal).
        return np.array([self.features_row(leaf, now_ms) for leaf in leaves], np.float32)

    def features_by_column(self, leaves: Sequence[int], now_ms: int) -> np.ndarray:
        """``features`` computed column by column in numpy (what it does for more than
        ``_ROW_PATH_MAX_CHAINS`` chains)."""
        n = len(leaves)
        out = np.empty((n, len(CHAIN_FEATURES)), dtype=np.float32)
        if n == 0:
            return out
        root_get = self.root_requests.get
        # One pass over the chains into one float64 table (each int converted as
        # fromiter would): turns, last_ts_ms, last_think_ms, think_sum_ms,
        # prev_length, length, requests seen with the chain's first block. Each
        # column contiguous, as fromiter made them: numpy's vector loops (log1p) may
        # round differently from its strided ones.
        turns, last_ts, last_think, think_sum, prev_length, length, root_requests = np.array(
            [
                (c.turns, c.last_ts_ms, c.last_think_ms, c.think_sum_ms, c.prev_length,
                 len(c.blocks), root_get(c.blocks[0], 0))
                for c in map(self.chains.__getitem__, leaves)
            ],
            dtype=np.float64,
        ).T.copy()  # fmt: skip
        since = np.maximum(0.0, now_ms - last_ts)
        mean_think = np.divide(think_sum, turns - 1, out=np.full(n, -1.0), where=turns > 1)
        has_mean = mean_think >= 0
        out[:, 0] = turns
        out[:, 1] = np.log1p(since)
        out[:, 2] = np.where(has_mean, np.log1p(np.maximum(mean_think, 0.0)), -1.0)
        out[:, 3] = np.where(last_think >= 0, np.log1p(np.maximum(last_think, 0.0)), -1.0)
        out[:, 4] = np.divide(since, mean_think + 1.0, out=np.full(n, -1.0), where=has_mean)
        out[:, 5] = length
        out[:, 6] = length - prev_length
        out[:, 7] = np.log1p(root_requests)
        out[:, 8] = (now_ms / 3_600_000.0) % 24.0
        return out

    def features_row(self, leaf: int, now_ms: int) -> tuple[float, ...]:
        """``features`` of one chain, as Python floats (the reference definition)."""
        c = self.chains[leaf]
        since = max(0, now_ms - c.last_ts_ms)
        mean_think = c.think_sum_ms / (c.turns - 1) if c.turns > 1 else -1.0
        return (
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


def chain_dataset(
    events: Sequence[BlocksAccessed],
    horizon_ms: int,
    snapshot_interval_ms: int = 10_000,
    max_chain_age_ms: int = 3_600_000,
    rows_from_ms: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, continued within H, time since last turn in ms) of every chain idle
    for at most ``max_chain_age_ms`` at each snapshot instant. ``rows_from_ms``: rows
    only at the snapshots from then on (a held-out part), the chains followed from the
    first event all the same; the rows are those the whole dataset has at them."""
    tracker = ChainTracker(keep_finished=True, index_blocks=False)
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
            held_out = rows_from_ms is None or next_snapshot >= rows_from_ms
            if leaves and held_out and next_snapshot + horizon_ms <= end_ms:
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


@dataclass(frozen=True)
class ChainBlend:
    """How a learned policy folds the chain model into its block scores: a logistic
    regression on (logit of the block model's score, logit of the return probability
    of the block's latest live chain, whether it has one) fitted on held-out rows
    (``training.train.fit_chain_blend``). The block model sees one block's history; the
    chain model sees its conversation's pace. Where the two disagree the fitted weights
    say which to trust on this workload, and training keeps the blend only where a
    held-out replay hits more with it."""

    coef: tuple[float, float, float]
    intercept: float

    def __post_init__(self) -> None:
        values = (*self.coef, self.intercept)
        if len(self.coef) != 3 or not all(
            isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= 1e3 for v in values
        ):
            raise ValueError(
                "a chain blend needs 3 finite coefficients and a finite intercept, "
                f"each within +-1000; got {values!r}"
            )

    @functools.cached_property
    def _coef(self) -> np.ndarray:
        """``coef`` as the float64 vector ``apply`` multiplies by (made on first use: a
        blend unpickled from a process that never used it has none yet)."""
        return np.asarray(self.coef, dtype=np.float64)

    def apply(self, block: np.ndarray, chain: np.ndarray, has_chain: np.ndarray) -> np.ndarray:
        """Blended P(reuse within H) per block (float32)."""
        z = self.design(block, chain, has_chain) @ self._coef + self.intercept
        np.maximum(z, -40.0, out=z)  # np.clip(z, -40, 40), at less call overhead
        np.minimum(z, 40.0, out=z)
        np.negative(z, out=z)
        np.exp(z, out=z)
        z += 1.0
        return np.reciprocal(z, out=z).astype(np.float32)

    @staticmethod
    def design(block: np.ndarray, chain: np.ndarray, has_chain: np.ndarray) -> np.ndarray:
        """The regression's inputs, one row per block: the two logits (of the block
        model's score, and of the chain's return probability where the block has a live
        chain, else 0) and whether it has one. Both logits in one pass over a (2, n)
        table (elementwise: each value's logit is the one ``_logit`` gives alone)."""
        has = np.asarray(has_chain, dtype=bool)
        n = has.shape[0]
        both = np.empty((2, n), dtype=np.float64)
        both[0] = block
        both[1] = chain
        logits = _logit(both)
        out = np.empty((n, 3), dtype=np.float64)
        out[:, 0] = logits[0]
        out[:, 1] = np.where(has, logits[1], 0.0)
        out[:, 2] = has
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"coef": list(self.coef), "intercept": self.intercept}

    @classmethod
    def from_dict(cls, data: Any) -> ChainBlend:
        if not isinstance(data, dict) or set(data) != {"coef", "intercept"}:
            raise ValueError("a chain blend is a table with exactly 'coef' and 'intercept'")
        coef = data["coef"]
        if not isinstance(coef, list):
            raise ValueError("a chain blend's 'coef' must be a list of 3 numbers")
        return cls(tuple(coef), data["intercept"])  # type: ignore[arg-type]


def _logit(p: np.ndarray) -> np.ndarray:
    # Clipped to [1e-6, 1 - 1e-6] by maximum and minimum, as np.clip would (NaN too)
    # at a third of its call overhead.
    q = np.maximum(np.asarray(p, dtype=np.float64), 1e-6)
    np.minimum(q, 1.0 - 1e-6, out=q)
    q /= 1.0 - q
    return np.log(q, out=q)


class ChainPolicy(Policy):
    """Block score = P(the latest chain that read it continues within H)."""

    name = "chain"
    Params = ChainParams
    params: ChainParams
    outputs_probability = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self.tracker = ChainTracker(max_chains=self.params.max_chains)
        self.model: TreeModel | None = None
        """The booster with its validated, compiled trees (``predictor.lightgbm_policy.
        TreeModel``, as the block model holds): chains score through native code, ~8x
        faster than ``Booster.predict`` at 1,000 rows, raw scores bit-identical."""
        self.training_info: dict[str, Any] = {}
        self.blend: ChainBlend | None = None
        """Set when training found that folding the chain model into the block scores
        hits more on held-out requests (a learned policy then keeps ``latest_leaf``)."""
        self._predicted: dict[int, tuple[_Chain, int, float]] = {}
        """Leaf -> (its chain, when predicted, the prediction): the last prefetch
        round's chain predictions, reused by the next ones under ``max_age_ms``."""

    @property
    def booster(self) -> Any:
        """LightGBM's booster (None before ``fit`` or ``load_model``)."""
        return self.model.booster if self.model is not None else None

    def fit(self, events: Sequence[BlocksAccessed], valid_fraction: float = 0.25) -> ChainPolicy:
        """Train on ``events`` (the last ``valid_fraction`` of rows drive early stopping)."""
        import lightgbm as lgb

        from predictor.lightgbm_policy import tree_model

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
        self.model = tree_model(booster.model_to_string(num_iteration=best), CHAIN_MODEL_FILE)
        self.training_info = {
            "best_iteration": int(best),
            "rows": int(x.shape[0]),
            "returns": int(y.sum()),
        }
        return self

    def fresh_copy(self) -> ChainPolicy:
        """Same params and model, empty tracker."""
        clone = ChainPolicy(self.params)
        clone.tracker.index_blocks = self.tracker.index_blocks
        clone.model = self.model
        clone.training_info = dict(self.training_info)
        clone.blend = self.blend
        return clone

    # -- persistence (inside a learned policy's directory) -------------------------------

    def save_model(self, directory: Path) -> dict[str, Any]:
        """Write the booster to ``directory / CHAIN_MODEL_FILE``; return the manifest
        entry that ``load_model`` reads back (params, file, what training learned)."""
        if self.booster is None:
            raise ValueError("the chain model is not fitted: nothing to save")
        (directory / CHAIN_MODEL_FILE).write_text(self.booster.model_to_string(), encoding="utf-8")
        info = {k: v for k, v in self.training_info.items() if isinstance(v, (int, float, str))}
        entry: dict[str, Any] = {
            "params": self.params.model_dump(mode="json"),
            "file": CHAIN_MODEL_FILE,
            "training_info": info,
        }
        if self.blend is not None:
            entry["blend"] = self.blend.to_dict()
        return entry

    @classmethod
    def load_model(cls, directory: Path, entry: Any, where: Path) -> ChainPolicy:
        """The chain model described by a manifest ``entry`` (``where`` names the
        manifest); its file is size-checked, parsed and validated structurally before
        LightGBM reads it, and probed: ``PolicyLoadError`` naming the file otherwise."""
        from predictor.lightgbm_policy import read_tree_model
        from predictor.model_check import check_scores, probe_rows

        if not isinstance(entry, dict) or entry.get("file") != CHAIN_MODEL_FILE:
            raise PolicyLoadError(
                where, f"'chain' must be a table naming the file {CHAIN_MODEL_FILE!r}"
            )
        try:
            params = ChainParams.model_validate(entry.get("params", {}))
        except ValidationError as exc:
            raise PolicyLoadError(where, f"invalid chain model parameters: {exc}") from exc
        path = directory / CHAIN_MODEL_FILE
        policy = cls(params)
        policy.model = read_tree_model(path, len(CHAIN_FEATURES))
        check_scores(policy.model.predict(probe_rows(len(CHAIN_FEATURES))), policy, path)
        info = entry.get("training_info", {})
        policy.training_info = dict(info) if isinstance(info, dict) else {}
        if entry.get("blend") is not None:
            try:
                policy.blend = ChainBlend.from_dict(entry["blend"])
            except (TypeError, ValueError) as exc:
                raise PolicyLoadError(where, f"invalid chain blend: {exc}") from exc
        return policy

    def predict_chains(self, leaves: Sequence[int], now_ms: int) -> np.ndarray:
        """P(continues within H) per live chain leaf."""
        if self.model is None:
            raise ValueError("the chain model is not fitted: call fit(events) first")
        if not leaves:
            return np.zeros(0, dtype=np.float32)
        return np.asarray(self.model.predict(self.tracker.features(leaves, now_ms)), np.float32)

    def observe(self, event: Event) -> None:
        self.tracker.observe(event)

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        return self.block_scores(block_hashes, now_ms)[0]

    def block_scores(self, block_hashes: np.ndarray, now_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """(P(the block's latest live chain continues within H), whether it has one) per
        block; 0 and False for a block of no live chain."""
        if not self.tracker.index_blocks:
            raise ValueError(
                "this chain model keeps no block -> chain map (a learned policy's chain "
                "model names prefetch candidates only, unless it blends)"
            )
        hashes = as_hash_array(block_hashes).tolist()
        chains = self.tracker.chains
        leaves = list(map(self.tracker.latest_leaf.get, hashes, itertools.repeat(-1)))
        # Each live chain once, in first-seen order (a row's prediction does not depend
        # on the others in the call).
        live = [leaf for leaf in dict.fromkeys(leaves) if leaf in chains]
        prob = dict(zip(live, self.predict_chains(live, now_ms).tolist(), strict=True))
        n = len(leaves)
        scores = np.fromiter(map(prob.get, leaves, itertools.repeat(-1.0)), np.float32, count=n)
        has = scores >= 0
        scores[~has] = 0.0
        return scores, has

    def scores_at_rows(
        self,
        events: Sequence[BlocksAccessed],
        events_seen: np.ndarray,
        ts_ms: np.ndarray,
        block_hashes: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``block_scores`` of dataset rows (``training.dataset.Dataset``: a row taken
        after ``events_seen`` of ``events`` were observed, at ``ts_ms``), each as a
        fresh tracker following ``events`` would have answered it then. The policy's
        own tracker is left as it was."""
        n = block_hashes.shape[0]
        scores, has = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=bool)
        saved = self.tracker
        self.tracker = ChainTracker(max_chains=self.params.max_chains, index_blocks=True)
        try:
            order = np.lexsort((ts_ms, events_seen))
            seen_sorted = events_seen[order]
            bounds = np.searchsorted(seen_sorted, np.arange(len(events) + 2)).tolist()
            for k, event in enumerate(events, start=1):
                self.tracker.observe(event)
                rows = order[bounds[k] : bounds[k + 1]]
                if rows.size == 0:
                    continue
                instants = ts_ms[rows]
                for ts in np.unique(instants).tolist():
                    at = rows[instants == ts]
                    scores[at], has[at] = self.block_scores(block_hashes[at], int(ts))
        finally:
            self.tracker = saved
        return scores, has

    def prefetch_candidates(self, now_ms: int, limit: int, max_age_ms: int = 0) -> np.ndarray:
        """Blocks of the chains most likely to continue within H, best chain first,
        among the ``candidate_chains`` most recently continued ones. ``max_age_ms`` > 0
        (serving: ``LearnedParams.score_max_age_ms``): a chain's prediction is reused
        while the chain is not continued or replaced and the prediction is at most this
        old (event time), as a block's stored score is; 0 predicts every chain anew."""
        if self.booster is None or limit <= 0 or not self.tracker.chains:
            return np.zeros(0, dtype=np.uint64)
        chains = self.tracker.chains
        n = min(len(chains), self.params.candidate_chains)
        leaves = list(itertools.islice(reversed(chains), n))
        order = np.argsort(-self._round_predictions(leaves, now_ms, max_age_ms), kind="stable")
        out: dict[int, None] = {}
        for i in order.tolist():
            for block in chains[leaves[i]].blocks:
                out[block] = None
            if len(out) >= limit:
                break
        return np.fromiter(out, dtype=np.uint64, count=len(out))[:limit]

    def _round_predictions(self, leaves: list[int], now_ms: int, max_age_ms: int) -> np.ndarray:
        """``predict_chains(leaves, now_ms)``, except that with ``max_age_ms`` > 0 a
        prediction kept from an earlier round is reused while its chain is the same
        object (a continued or repeated chain is a new one) and it has not expired. A
        prediction made at ``t`` expires at ``t + max_age_ms * (1/2 .. 1)``, the share
        drawn from the leaf's hash: predictions made in one round do not all expire in
        the same later one, which would then predict every chain at once. Only this
        round's chains are kept (at most ``candidate_chains``)."""
        if max_age_ms <= 0:
            self._predicted = {}
            return self.predict_chains(leaves, now_ms)
        chains = self.tracker.chains
        get = self._predicted.get
        out = np.empty(len(leaves), dtype=np.float32)
        keep: dict[int, tuple[_Chain, int, float]] = {}
        need: list[int] = []
        for i, leaf in enumerate(leaves):
            hit = get(leaf)
            if hit is not None and hit[0] is chains[leaf] and now_ms <= hit[1]:
                out[i] = hit[2]
                keep[leaf] = hit
            else:
                need.append(i)
        if need:
            fresh_leaves = [leaves[i] for i in need]
            fresh = self.predict_chains(fresh_leaves, now_ms)
            out[need] = fresh
            expires = now_ms + expiry_ms(np.asarray(fresh_leaves, dtype=np.uint64), max_age_ms)
            for leaf, at, p in zip(fresh_leaves, expires.tolist(), fresh.tolist(), strict=True):
                keep[leaf] = (chains[leaf], at, p)
        self._predicted = keep
        return out


def expiry_ms(leaves: np.ndarray, max_age_ms: int) -> np.ndarray:
    """How long each chain's prediction lives: ``max_age_ms`` times a share in [1/2, 1]
    drawn from the leaf's hash (Fibonacci hashing: leaves are block hashes, already
    uniform, but a multiply spreads ones that share high bits), as int64 ms."""
    mixed = (leaves.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(11)
    share = 0.5 + 0.5 * (mixed.astype(np.float64) / float(1 << 53))
    return np.floor(max_age_ms * share).astype(np.int64)
