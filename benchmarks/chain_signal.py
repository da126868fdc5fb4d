"""``kvwarm bench chains``: how much the chain return model knows beyond recency.

On conversation traces a block's future is its conversation's (``predictor.chain_model``),
so the LRU-to-Belady gap a learned policy can close is bounded by how well "will this
chain come back within H" can be told from what a stream shows. This benchmark measures
that on a trace's held-out part, for a few horizons:

- the chain model is fitted on the first ``--train-fraction`` of the trace's time span
  (``ChainPolicy.fit``, its default parameters, the trace's own time);
- its rows on the rest (``chain_dataset(..., rows_from_ms=)``: every live chain every
  10 s, the chains followed from the first event) are scored by it and by recency alone
  (time since the chain's last turn, sooner = likelier);
- printed per horizon: rows, the share that returns within H, ROC AUC and average
  precision of the model and of recency; then each feature's AUC alone (oriented: a
  feature whose smaller values mean a return is marked ``-``).

A model AUC close to recency's says the trace holds little beyond recency about which
conversations continue; the learned policy's edge over LRU then comes from elsewhere
(which blocks of a chain to keep, admission) and the gap to Belady from what no feature
here sees. The baseline (recency) is computed on the same rows in the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from features.events import BlocksAccessed
from predictor.chain_model import CHAIN_FEATURES, ChainParams, ChainPolicy, chain_dataset
from training.replay import split_events

DEFAULT_HORIZONS = "60s,5m,15m"


def _seconds(ms: int) -> str:
    return f"{ms / 1000:g} s"


@dataclass(frozen=True)
class HorizonSignal:
    horizon_ms: int
    rows: int
    returns: float
    """Share of the held-out rows whose chain returns within the horizon."""
    model_auc: float
    recency_auc: float
    model_ap: float
    recency_ap: float
    feature_auc: dict[str, float] = field(default_factory=dict)
    """Each feature's ROC AUC alone, as scored (above 0.5: larger means likelier)."""


def chain_signal(
    events: Sequence[BlocksAccessed],
    train_fraction: float,
    horizons_ms: Sequence[int],
    skipped: list[str] | None = None,
) -> list[HorizonSignal]:
    """One ``HorizonSignal`` per horizon that can be measured (see the module
    docstring). A horizon that leaves no held-out rows, rows of one class only, or too
    few training rows is left out, with the reason appended to ``skipped``; ValueError
    when none is left."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    train, test = split_events(events, train_fraction)
    if not train or not test:
        raise ValueError("the trace has no held-out part: use a lower --train-fraction")
    out = []
    reasons: list[str] = []
    for horizon_ms in horizons_ms:
        try:
            policy = ChainPolicy(ChainParams(horizon_ms=horizon_ms)).fit(train)
        except ValueError as exc:
            reasons.append(f"horizon {_seconds(horizon_ms)}: training part: {exc}")
            continue
        p = policy.params
        x, y, since = chain_dataset(
            events,
            horizon_ms,
            p.snapshot_interval_ms,
            p.max_chain_age_ms,
            rows_from_ms=test[0].ts_ms,
        )
        if y.all() or not y.any():
            reasons.append(
                f"horizon {_seconds(horizon_ms)}: {x.shape[0]} held-out rows, "
                f"{int(y.sum())} returns; no ranking to measure (a longer trace, or a "
                "shorter horizon)"
            )
            continue
        assert policy.model is not None
        scores = np.asarray(policy.model.predict(x), dtype=np.float64)
        recency = -since.astype(np.float64)
        out.append(
            HorizonSignal(
                horizon_ms=horizon_ms,
                rows=int(x.shape[0]),
                returns=float(y.mean()),
                model_auc=float(roc_auc_score(y, scores)),
                recency_auc=float(roc_auc_score(y, recency)),
                model_ap=float(average_precision_score(y, scores)),
                recency_ap=float(average_precision_score(y, recency)),
                feature_auc={
                    name: float(roc_auc_score(y, x[:, j])) for j, name in enumerate(CHAIN_FEATURES)
                },
            )
        )
    if skipped is not None:
        skipped.extend(reasons)
    if not out:
        raise ValueError("; ".join(reasons) or "no horizon given")
    return out


def format_signal(results: Sequence[HorizonSignal]) -> str:
    lines = [
        f"{'horizon':>9} {'rows':>10} {'returns':>8} {'model AUC':>10} {'recency AUC':>12} "
        f"{'model AP':>9} {'recency AP':>11}"
    ]
    for r in results:
        lines.append(
            f"{_seconds(r.horizon_ms):>9} {r.rows:>10,} {r.returns:>8.3f} {r.model_auc:>10.3f} "
            f"{r.recency_auc:>12.3f} {r.model_ap:>9.3f} {r.recency_ap:>11.3f}"
        )
    lines.append("")
    lines.append("each feature alone, ROC AUC (- : smaller values mean likelier to return)")
    lines.append(f"{'feature':>24} " + " ".join(f"{_seconds(r.horizon_ms):>9}" for r in results))
    for name in CHAIN_FEATURES:
        cells = []
        for r in results:
            auc = r.feature_auc[name]
            cells.append(f"{max(auc, 1 - auc):>8.3f}{'-' if auc < 0.5 else ' '}")
        lines.append(f"{name:>24} " + " ".join(cells))
    return "\n".join(lines)


def _horizons(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    from training.train_cli import parse_duration_ms

    return [parse_duration_ms(part) for part in value.split(",") if part.strip()]


@click.command("chains")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None)
@click.option("--train-fraction", type=click.FloatRange(0.05, 0.95), default=0.6, show_default=True)
@click.option(
    "--horizons",
    default=DEFAULT_HORIZONS,
    show_default=True,
    callback=_horizons,
    help="Comma-separated durations with units (60s, 5m, ...).",
)
def chain_signal_bench(trace: Path | None, train_fraction: float, horizons: list[int]) -> None:
    """How well the chain model tells returning conversations apart, against recency."""
    from benchmarks.traces import load_events

    events, source = load_events(trace)
    click.echo(
        f"trace: {source}; {len(events):,} requests; chain model fitted on the first "
        f"{train_fraction:.0%} of the time span, rows of the rest (every live chain every "
        "10 s) scored by it and by recency alone (time since the chain's last turn)"
    )
    skipped: list[str] = []
    try:
        results = chain_signal(events, train_fraction, horizons, skipped)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_signal(results))
    for reason in skipped:
        click.echo(f"left out: {reason}")
