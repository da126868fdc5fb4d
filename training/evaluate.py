"""Evaluate policies side by side on the test part of a trace, by replaying it.

Every policy, baseline or learned, sees the same events in the same order through its
own ``observe`` and is scored through its own ``score`` at the same points, so the
comparison never depends on how a model was trained.

- Ranking metrics (ROC-AUC, PR-AUC, log loss) are measured at the rows of the test
  part of a ``training.dataset.Dataset`` (access rows and sampled snapshot rows), each
  scored right after the number of events the row was built after, against its
  ``reused_within_{H}ms`` label; rows whose horizon runs past the data are left out.
  Rank-only scorers get probabilities for log loss from an isotonic map fitted on the
  validation part's rows.
- Top-k precision/recall: every ``snapshot_every_ms`` of the test part, every block
  seen so far is scored and the top k kept (k = 1%, 5%, 10% of distinct blocks);
  label = next access (by a later request) within H.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from features.events import BlocksAccessed
from predictor.base import Policy
from predictor.oracle import FutureAccesses
from training.dataset import Dataset
from training.metrics import (
    TOP_K_FRACTIONS,
    Snapshot,
    capacity_name,
    classification_metrics,
    fit_calibrator,
    top_k_metrics,
)


@dataclass
class PolicyEvaluation:
    name: str
    metrics: dict[str, float]
    score_seconds: float
    test_labels: np.ndarray
    test_probabilities: np.ndarray
    calibrated: bool
    """True when probabilities came from an isotonic map fitted on the validation window."""


def _row_groups(parts: Sequence[Dataset]) -> dict[int, list[tuple[int, int, int]]]:
    """events seen -> [(part, first row, end row)] for runs of rows sharing (seen, ts)."""
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for p, part in enumerate(parts):
        seen, ts = part.num_events_seen, part.ts_ms
        if seen.shape[0] == 0:
            continue
        if np.any(np.diff(seen) < 0):
            raise ValueError("dataset rows must be in build order (num_events_seen non-decreasing)")
        cuts = np.flatnonzero((np.diff(seen) != 0) | (np.diff(ts) != 0)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [seen.shape[0]]])
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            groups.setdefault(int(seen[a]), []).append((p, a, b))
    return groups


def evaluate_policies(
    policies: Mapping[str, Policy],
    events: Sequence[BlocksAccessed],
    *,
    valid: Dataset,
    test: Dataset,
    horizon_ms: int,
    snapshot_every_ms: int,
    capacity_fractions: Sequence[float] = TOP_K_FRACTIONS,
    future: FutureAccesses | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, PolicyEvaluation]:
    """Replay ``events`` (the stream the datasets were built from) through every policy
    and measure them on ``test``; ``valid`` calibrates rank-only scorers."""
    future = future or FutureAccesses.from_events(events)
    distinct = int(future.block_hashes_sorted.shape[0])
    capacities = {capacity_name(f): int(f * distinct) for f in capacity_fractions}
    parts = (valid, test)
    groups = _row_groups(parts)
    scores: dict[str, list[list[np.ndarray]]] = {name: [[], []] for name in policies}
    snapshots: dict[str, list[Snapshot]] = {name: [] for name in policies}
    seconds = dict.fromkeys(policies, 0.0)
    seen: dict[int, None] = {}
    test_start_ms = int(test.ts_ms.min()) if test.num_rows else 0
    next_snapshot = test_start_ms
    position = 0

    def timed_score(name: str, blocks: np.ndarray, now_ms: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = policies[name].score(blocks, now_ms)
        seconds[name] += time.perf_counter() - t0
        return out

    for k in range(len(events) + 1):
        for p, a, b in groups.get(k, ()):
            part = parts[p]
            for name in policies:
                scores[name][p].append(
                    timed_score(name, part.block_hashes[a:b], int(part.ts_ms[a]))
                )
        if k == len(events):
            break
        event = events[k]
        while test.num_rows and event.ts_ms > next_snapshot and seen:
            blocks = np.fromiter(seen, dtype=np.uint64, count=len(seen))
            nxt = future.next_access_ms(blocks, position)
            labels = (nxt >= 0) & (nxt - next_snapshot <= horizon_ms)
            for name in policies:
                snapshots[name].append(Snapshot(labels, timed_score(name, blocks, next_snapshot)))
            next_snapshot += snapshot_every_ms
        for policy in policies.values():
            policy.observe(event)
        seen.update(dict.fromkeys(event.block_hashes))
        position += len(event.block_hashes)
        if progress is not None:
            progress(1)

    label_key = f"reused_within_{horizon_ms}ms"
    complete_key = f"horizon_complete_{horizon_ms}ms"
    results: dict[str, PolicyEvaluation] = {}
    for name, policy in policies.items():
        s_valid, s_test = (
            np.concatenate(x) if x else np.zeros(0, np.float32) for x in scores[name]
        )
        vmask, tmask = valid.labels[complete_key], test.labels[complete_key]
        vy, y = (
            valid.labels[label_key][vmask].astype(bool),
            test.labels[label_key][tmask].astype(bool),
        )
        vs, s = s_valid[vmask], s_test[tmask]
        probabilities = s
        calibrated = not policy.outputs_probability
        if calibrated:
            if vy.size and 0 < vy.sum() < vy.size:
                probabilities = (
                    fit_calibrator(vs, vy).predict(s.astype(np.float64)).astype(np.float32)
                )
            else:
                probabilities = np.full_like(s, float(vy.mean()) if vy.size else 0.5)
        metrics = classification_metrics(y, s, probabilities)
        metrics.update(top_k_metrics(snapshots[name], capacities))
        metrics["num_test_rows"] = float(y.size)
        metrics["num_snapshots"] = float(len(snapshots[name]))
        results[name] = PolicyEvaluation(name, metrics, seconds[name], y, probabilities, calibrated)
    return results
