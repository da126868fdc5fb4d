"""Training datasets from traces: features from the online state, labels from the future.

The builder replays events through ``features.state.FeatureState.observe`` -- the
very call the sidecar makes -- and reads rows with ``features_for_slots``, so a
training row is bit-for-bit the row serving would compute at that instant.

Samples (block, instant):

- access rows: right after each request is observed, one row per block of that
  request (each kept with probability ``sample``), at the request's ``ts_ms``. What
  eviction asks: "this block was just read; will it be read again soon?"
- snapshot rows: every ``snapshot_interval_ms`` of trace time, up to
  ``snapshot_blocks`` tracked blocks drawn uniformly, at the snapshot instant (after
  every access with ``ts_ms <=`` the instant). What prefetch asks about blocks that
  are idle.

Labels, from the row's *next access*: the first access of the block by a later
request (for a snapshot row: by a request after the instant). Timestamps in real
traces are coarse (the Mooncake trace has ~3 s ticks), so a next access can share the
row's ``ts_ms``; it still counts (the interval is closed at t: ``[t, t + H]``, in
event order).

- ``reused_within_{H}ms`` (uint8): the next access happens by ``t + H``.
- ``horizon_complete_{H}ms`` (bool): the label is known -- reused, or ``t + H`` is
  within the observed data. Train on these rows only, or treat the rest as unknown.
- ``time_to_next_access_ms`` (int64) and ``censored`` (bool): the gap to the next
  access; when there is none before the end of the data, the gap to the end and
  ``censored=True`` (survival-style).
- ``next_access_ts_ms`` (int64): the raw oracle, ``NEVER`` when censored. A label,
  never a feature.

Splits (``split_by_time``): consecutive time ranges. Features may use any earlier
event (that is what serving has); labels are recomputed so that each part's labels
see only events inside its own time range: a next access after the part's end is
censored at that end. Nothing of a later part reaches an earlier part's rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from features.annotate import NEVER, access_arrays, next_access_from
from features.decoders import read_trace
from features.events import BlocksAccessed
from features.feature_set import FEATURE_VERSION
from features.state import FeatureParams, FeatureState

DEFAULT_HORIZONS_MS: tuple[int, ...] = (10_000, 60_000, 300_000)
DEFAULT_SNAPSHOT_INTERVAL_MS = 60_000
DEFAULT_SNAPSHOT_BLOCKS = 256


class DatasetError(ValueError):
    """A dataset cannot be built, split or loaded as asked; the message says what to change."""


@dataclass(frozen=True)
class Dataset:
    """Feature rows, their labels and where they came from. Arrays share the row order
    (the order the builder met the instants: time order)."""

    X: np.ndarray  # float32 (n, F), columns = feature_names
    labels: dict[str, np.ndarray]
    ts_ms: np.ndarray  # int64 instant of each row
    block_hashes: np.ndarray  # uint64
    num_events_seen: np.ndarray  # int64 events observed when the row was taken
    is_snapshot: np.ndarray  # bool: snapshot row (else access row)
    feature_names: tuple[str, ...]
    feature_version: int
    horizons_ms: tuple[int, ...]
    end_ts_ms: int  # labels see accesses up to this time
    params: dict[str, Any] = field(default_factory=dict)  # FeatureParams as a dict

    @property
    def num_rows(self) -> int:
        return int(self.X.shape[0])

    def take(self, rows: np.ndarray, end_ts_ms: int | None = None) -> Dataset:
        """The given rows; with ``end_ts_ms``, labels recomputed as if the data ended there."""
        ts = self.ts_ms[rows]
        next_ts = self.labels["next_access_ts_ms"][rows]
        end = self.end_ts_ms if end_ts_ms is None else end_ts_ms
        return replace(
            self,
            X=self.X[rows],
            labels=compute_labels(ts, next_ts, end, self.horizons_ms),
            ts_ms=ts,
            block_hashes=self.block_hashes[rows],
            num_events_seen=self.num_events_seen[rows],
            is_snapshot=self.is_snapshot[rows],
            end_ts_ms=end,
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write one ``.npz`` with the feature version and names in its metadata."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "feature_version": self.feature_version,
            "feature_names": list(self.feature_names),
            "horizons_ms": list(self.horizons_ms),
            "end_ts_ms": self.end_ts_ms,
            "params": self.params,
        }
        arrays: dict[str, np.ndarray] = {f"label__{k}": v for k, v in self.labels.items()}
        arrays |= {
            "X": self.X,
            "ts_ms": self.ts_ms,
            "block_hashes": self.block_hashes,
            "num_events_seen": self.num_events_seen,
            "is_snapshot": self.is_snapshot,
            "meta": np.array(json.dumps(meta)),
        }
        with open(path, "wb") as fh:
            np.savez_compressed(fh, **arrays)  # type: ignore[arg-type]
        return path

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, expect_version: int | None = FEATURE_VERSION
    ) -> Dataset:
        """Read a saved dataset; refuses another feature version unless ``expect_version=None``."""
        with np.load(Path(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if expect_version is not None and meta["feature_version"] != expect_version:
                raise DatasetError(
                    f"{path}: feature version {meta['feature_version']}, this code computes "
                    f"version {expect_version}; rebuild the dataset with `build_dataset`"
                )
            labels = {k.removeprefix("label__"): z[k] for k in z.files if k.startswith("label__")}
            return cls(
                X=z["X"],
                labels=labels,
                ts_ms=z["ts_ms"],
                block_hashes=z["block_hashes"],
                num_events_seen=z["num_events_seen"],
                is_snapshot=z["is_snapshot"],
                feature_names=tuple(meta["feature_names"]),
                feature_version=int(meta["feature_version"]),
                horizons_ms=tuple(int(h) for h in meta["horizons_ms"]),
                end_ts_ms=int(meta["end_ts_ms"]),
                params=meta["params"],
            )


def compute_labels(
    ts_ms: np.ndarray, next_ts_ms: np.ndarray, end_ts_ms: int, horizons_ms: Sequence[int]
) -> dict[str, np.ndarray]:
    """Labels of rows at ``ts_ms`` whose next access is at ``next_ts_ms`` (``NEVER`` if
    none), when only accesses up to ``end_ts_ms`` may be seen."""
    ts = np.asarray(ts_ms, dtype=np.int64)
    nxt = np.asarray(next_ts_ms, dtype=np.int64)
    censored = nxt > end_ts_ms
    labels: dict[str, np.ndarray] = {
        "time_to_next_access_ms": np.where(censored, end_ts_ms - ts, nxt - ts),
        "censored": censored,
        "next_access_ts_ms": np.where(censored, NEVER, nxt),
    }
    for h in horizons_ms:
        reused = ~censored & (nxt - ts <= h)
        labels[f"reused_within_{h}ms"] = reused.astype(np.uint8)
        labels[f"horizon_complete_{h}ms"] = reused | (ts + h <= end_ts_ms)
    return labels


def build_dataset(
    source: str | os.PathLike[str] | Iterable[object],
    *,
    horizons_ms: Sequence[int] = DEFAULT_HORIZONS_MS,
    sample: float = 1.0,
    snapshot_interval_ms: int | None = DEFAULT_SNAPSHOT_INTERVAL_MS,
    snapshot_blocks: int = DEFAULT_SNAPSHOT_BLOCKS,
    params: FeatureParams | None = None,
    seed: int = 0,
) -> Dataset:
    """Replay ``source`` (a trace path, or events in stream order) through a fresh
    ``FeatureState`` and sample rows as the module docstring says.

    ``sample`` in (0, 1] thins access rows; ``snapshot_interval_ms=None`` (or
    ``snapshot_blocks=0``) turns snapshots off. Same inputs and seed, same dataset.
    """
    if not 0 < sample <= 1:
        raise DatasetError(f"sample must be in (0, 1], got {sample}")
    if snapshot_interval_ms is not None and snapshot_interval_ms <= 0:
        raise DatasetError(
            f"snapshot_interval_ms must be positive or None, got {snapshot_interval_ms}"
        )
    if not horizons_ms or any(h <= 0 for h in horizons_ms):
        raise DatasetError(f"horizons_ms must be positive, got {tuple(horizons_ms)}")
    events: Iterable[object] = (
        read_trace(source) if isinstance(source, (str, os.PathLike)) else source
    )
    state = FeatureState(params)
    rng = np.random.default_rng(seed)
    xs: list[np.ndarray] = []
    row_ts: list[np.ndarray] = []
    row_slots_hashes: list[np.ndarray] = []
    row_pos: list[np.ndarray] = []  # accesses observed before the row's next access may happen
    row_seen: list[np.ndarray] = []
    row_snap: list[np.ndarray] = []
    accesses: list[BlocksAccessed] = []
    num_accesses = 0
    num_events = 0
    next_snapshot_ms: int | None = None
    snapshots = snapshot_interval_ms is not None and snapshot_blocks > 0

    def emit(slots: np.ndarray, ts: int, snapshot: bool) -> None:
        n = slots.shape[0]
        xs.append(state.features_for_slots(slots, ts))
        row_ts.append(np.full(n, ts, dtype=np.int64))
        row_slots_hashes.append(state.hashes_of_slots(slots))
        row_pos.append(np.full(n, num_accesses, dtype=np.int64))
        row_seen.append(np.full(n, num_events, dtype=np.int64))
        row_snap.append(np.full(n, snapshot, dtype=bool))

    for event in events:
        if isinstance(event, BlocksAccessed):
            if snapshots:
                assert snapshot_interval_ms is not None
                if next_snapshot_ms is None:
                    next_snapshot_ms = event.ts_ms + snapshot_interval_ms
                while event.ts_ms > next_snapshot_ms:
                    tracked = state.tracked_slots()
                    if tracked.size:
                        pick = rng.choice(
                            tracked.size, size=min(snapshot_blocks, tracked.size), replace=False
                        )
                        emit(tracked[np.sort(pick)], next_snapshot_ms, True)
                    next_snapshot_ms += snapshot_interval_ms
            state.observe(event)
            num_events += 1
            accesses.append(event)
            num_accesses += len(event.block_hashes)
            slots = state.last_request_slots
            if sample < 1.0:
                slots = slots[rng.random(slots.shape[0]) < sample]
            if slots.size:
                emit(slots, event.ts_ms, False)
        else:
            state.observe(event)
            num_events += 1

    names = state.feature_names
    if not xs:
        raise DatasetError(
            "no rows: the source has no block accesses (check the trace path and format)"
        )
    ts_ms = np.concatenate(row_ts)
    hashes = np.concatenate(row_slots_hashes)
    arrays = access_arrays(accesses)
    # Dense id of each row's block, then its first access at or after the row's position.
    sorter = np.argsort(arrays.block_hashes)
    dense = sorter[np.searchsorted(arrays.block_hashes, hashes, sorter=sorter)]
    nxt = next_access_from(arrays.block_ids, dense, np.concatenate(row_pos))
    next_ts = np.full(nxt.shape[0], NEVER, dtype=np.int64)
    has = nxt < arrays.num_accesses
    next_ts[has] = arrays.ts_ms[nxt[has]]
    end_ts = int(arrays.ts_ms.max())
    horizons = tuple(int(h) for h in horizons_ms)
    p = state.params
    return Dataset(
        X=np.concatenate(xs),
        labels=compute_labels(ts_ms, next_ts, end_ts, horizons),
        ts_ms=ts_ms,
        block_hashes=hashes,
        num_events_seen=np.concatenate(row_seen),
        is_snapshot=np.concatenate(row_snap),
        feature_names=names,
        feature_version=FEATURE_VERSION,
        horizons_ms=horizons,
        end_ts_ms=end_ts,
        params={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(p).items()},
    )


def split_by_time(
    dataset: Dataset, fractions: Sequence[float] = (0.6, 0.2, 0.2)
) -> tuple[Dataset, ...]:
    """Cut the rows into consecutive time ranges holding about ``fractions`` of them.

    Boundaries fall between distinct timestamps (rows sharing a ``ts_ms`` stay
    together). Part i holds rows with ``b_{i-1} < ts_ms <= b_i``; its labels are
    censored at ``b_i`` (the last part keeps the data's end), so no label looks past
    its own part. Features need no change: they only ever use earlier events.
    """
    if not fractions or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise DatasetError(f"fractions must be positive and sum to 1, got {tuple(fractions)}")
    n = dataset.num_rows
    if n < len(fractions):
        raise DatasetError(f"{n} rows cannot be split {len(fractions)} ways")
    order = np.argsort(dataset.ts_ms, kind="stable")
    ts_sorted = dataset.ts_ms[order]
    cum = np.cumsum(fractions)[:-1]
    bounds = [int(ts_sorted[max(int(round(c * n)) - 1, 0)]) for c in cum]
    parts: list[Dataset] = []
    lower = None
    for i in range(len(fractions)):
        upper = bounds[i] if i < len(bounds) else None
        mask = np.ones(n, dtype=bool)
        if lower is not None:
            mask &= dataset.ts_ms > lower
        if upper is not None:
            mask &= dataset.ts_ms <= upper
        end = dataset.end_ts_ms if upper is None else min(upper, dataset.end_ts_ms)
        parts.append(dataset.take(np.flatnonzero(mask), end_ts_ms=end))
        lower = upper
    return tuple(parts)
