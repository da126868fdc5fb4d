"""``kvwarm replay`` and ``kvwarm demo``: the evaluation and the main job."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from features.decoders import TIME_UNITS, RejectLog, TraceFormatError, read_trace
from features.events import BlocksAccessed
from features.stats_cli import parse_fractions
from predictor.base import Policy
from serving.planner import DEFAULT_EVICT_AHEAD_VISITS
from training.report import (
    DEFAULT_POLICIES,
    LEARNED,
    ComparisonConfig,
    ComparisonReport,
    Trainer,
    format_single,
    format_tiered,
    run_comparison,
    trace_checksum,
)

DEFAULT_OUT = Path("runs")


def make_trainer(quick: bool, horizon_ms: int | None = None) -> Trainer:
    """Train a learned policy on the replay's training part with the training module's
    settings (``quick``: a few seconds, for demos and tests). The horizon is given in
    the original trace's time and stretched with the replay's time scale; None chooses
    it on held-out requests (``training.train.choose_horizon``)."""

    def trainer(name: str, events: Sequence[BlocksAccessed], time_scale: float) -> Policy:
        from training.train import fit_policy_on_events

        return fit_policy_on_events(
            name,
            events,
            quick=quick,
            horizon_ms=int(horizon_ms * time_scale) if horizon_ms is not None else None,
            time_scale=time_scale,
        )

    return trainer


def _load_models(specs: tuple[str, ...]) -> dict[str, Policy]:
    from predictor.base import PolicyError

    models: dict[str, Policy] = {}
    for spec in specs:
        name, sep, uri = spec.partition("=")
        if not sep or name not in LEARNED:
            raise click.BadParameter(
                f"{spec!r}: expected lightgbm=PATH_OR_URI or lstm=PATH_OR_URI",
                param_hint="--model",
            )
        from training.tracking import load_policy_uri

        try:
            models[name] = load_policy_uri(uri)
        except (PolicyError, OSError) as exc:
            raise click.ClickException(
                f"--model {spec}: {str(exc).splitlines()[0]}; check the name and alias "
                "(kvwarm train ... --register NAME --alias ALIAS) or pass a saved policy directory"
            ) from None
    return models


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if not np.isfinite(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def write_outputs(
    report: ComparisonReport,
    out_dir: Path,
    *,
    trace_name: str,
    checksum: str | None,
    experiment: str | None,
    training: str = "full",
) -> dict[str, Any]:
    """results.json + PNG plots in ``out_dir``; the same logged to MLflow unless
    ``experiment`` is None. Returns what was written."""
    from training import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    data = _jsonable(report.to_dict())
    data["trace"]["name"] = trace_name
    data["trace"]["sha256"] = checksum
    data["config"]["training"] = training
    results = out_dir / "results.json"
    results.write_text(json.dumps(data, indent=2))
    figures = plots.write_plots(report, out_dir)
    written: dict[str, Any] = {
        "results": str(results),
        "plots": [str(out_dir / n) for n in figures],
    }
    if experiment:
        from training.tracking import tracked_run

        with tracked_run(experiment, run_name=f"replay-{trace_name}") as run:
            run.log_params(
                {
                    **{k: v for k, v in data["config"].items()},
                    "trace": trace_name,
                    "trace_sha256": checksum or "",
                }
            )
            metrics: dict[str, float] = {}
            for row in data["single"]:
                tag = f"{row['capacity'] * 100:g}pct"
                for name, value in row["policies"].items():
                    metrics[f"single.{name}.hit_ratio.{tag}"] = value
                for name, value in row["gap_closed"].items():
                    if value is not None:
                        metrics[f"single.{name}.gap_closed.{tag}"] = value
            for row in data["tiered"]:
                tag = f"{row['capacity'] * 100:g}pct"
                metrics[f"tiered.{row['policy']}.ttft_p50_ms.{tag}"] = row["ttft_ms"]["p50"]
                metrics[f"tiered.{row['policy']}.throughput_rps.{tag}"] = row["throughput_rps"]
            run.log_metrics({k: v for k, v in metrics.items() if v is not None})
            run.log_dict(data, "results.json")
            for name, fig in figures.items():
                run.log_figure(fig, name)
            written["mlflow_run_id"] = run.run_id
            written["tracking_uri"] = run.tracking_uri
    plots.close(figures)
    return written


def _run(
    trace: Path,
    events: list[BlocksAccessed],
    config: ComparisonConfig,
    *,
    models: dict[str, Policy],
    out_dir: Path,
    experiment: str | None,
    quick: bool = False,
) -> ComparisonReport:
    def progress(message: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {message}", err=True)

    report = run_comparison(
        events, config, trainer=make_trainer(quick), trained=models, progress=progress
    )
    click.echo("")
    click.echo(format_single(report))
    click.echo("")
    click.echo(format_tiered(report))
    written = write_outputs(
        report,
        out_dir,
        trace_name=trace.name,
        checksum=trace_checksum(trace),
        experiment=experiment,
        training="quick" if quick else "full",
    )
    click.echo("")
    click.echo(f"results: {written['results']}")
    for plot in written["plots"]:
        click.echo(f"plot:    {plot}")
    if "mlflow_run_id" in written:
        from training.tracking import masked_uri, ui_command

        click.echo(
            f"MLflow run {written['mlflow_run_id']} in {masked_uri(written['tracking_uri'])}"
        )
        click.echo(f"browse the run: {ui_command(written['tracking_uri'])}")
    click.echo(f"took {report.seconds:.0f} s")
    return report


EVICT_AHEAD_OPTION = click.option(
    "--evict-ahead-visits",
    type=click.IntRange(0, 1024),
    default=DEFAULT_EVICT_AHEAD_VISITS,
    show_default=True,
    help="Batched eviction, as the sidecar runs it: a scored round also queues the victims "
    "of about this many more requests, which then score only the blocks they store, for "
    "the admission veto against those victims (see serving.planner). 0: one round per "
    "request.",
)
"""``--evict-ahead-visits``, shared with ``kvwarm bench quality``."""

_common = [
    click.option(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        show_default=True,
        help="Comma-separated policy names.",
    ),
    click.option(
        "--capacities",
        default="0.01,0.05,0.1",
        show_default=True,
        help="Fast-tier sizes as fractions of the replayed part's distinct blocks.",
    ),
    click.option(
        "--train-fraction", type=click.FloatRange(0.0, 0.95), default=0.6, show_default=True
    ),
    click.option(
        "--profile",
        default=None,
        help="Timing profile TOML (default: the bundled 480B TP8 profile).",
    ),
    click.option(
        "--load",
        type=click.FloatRange(0.05, 2.0),
        default=0.9,
        show_default=True,
        help="Open loop: engine load (prefill and decode) offered with nothing cached, "
        "in 90% of the trace's windows (~100 requests each); sets the time scale.",
    ),
    click.option(
        "--concurrency",
        type=click.IntRange(1, 4096),
        default=None,
        help="Tiered mode: closed loop, N requests in flight (each client sends its next "
        "request when the previous one ends, plus think time); default: open loop at "
        "--load.",
    ),
    click.option(
        "--think-ms",
        type=click.FloatRange(0.0, 3_600_000.0),
        default=0.0,
        show_default=True,
        help="Closed loop: mean think time between a client's requests (exponential, seeded).",
    ),
    click.option(
        "--modes",
        default="single,tiered",
        show_default=True,
        help="Comma-separated: single, tiered, or single,tiered.",
    ),
    click.option(
        "--training",
        type=click.Choice(["full", "quick"]),
        default=None,
        help="How the learned policies train on the first part: full (what kvwarm train "
        "does; replay's default) or quick (seconds, fewer trees; demo's default). The two "
        "give different learned numbers; results.json records which.",
    ),
    click.option(
        "--time-unit",
        type=click.Choice(TIME_UNITS),
        default="auto",
        show_default=True,
        help="Unit of the trace's timestamps (auto: by magnitude).",
    ),
    click.option("--no-peers", is_flag=True, help="Skip the libCacheSim policies."),
    click.option(
        "--guard/--no-guard",
        default=True,
        show_default=True,
        help="Serve learned policies behind the online guard (ghost caches of the model, "
        "LRU, LFU and LRU-2; the best one serves), as kvwarm serve does.",
    ),
    EVICT_AHEAD_OPTION,
    click.option(
        "--out",
        "out_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Output folder (default runs/<time>-<name>).",
    ),
    click.option(
        "--experiment",
        default="kvwarm-replay",
        show_default=True,
        help="MLflow experiment; '' to skip MLflow.",
    ),
]


def comparison_options(fn: Any) -> Any:
    """Add the options every comparison takes; the command receives them as one
    ``ComparisonConfig`` (``config``) plus ``out_dir`` and ``experiment``."""

    @functools.wraps(fn)
    def wrapper(
        *args: Any,
        policies: str,
        capacities: str,
        train_fraction: float,
        profile: str | None,
        load: float,
        concurrency: int | None,
        think_ms: float,
        modes: str,
        no_peers: bool,
        guard: bool,
        evict_ahead_visits: int,
        **kwargs: Any,
    ) -> Any:
        config = _config(policies, capacities, train_fraction, profile, load, modes, no_peers)
        config.concurrency = concurrency
        config.think_ms = think_ms
        config.guard = guard
        config.evict_ahead_visits = evict_ahead_visits
        experiment = kwargs.get("experiment")
        if experiment is not None and experiment != "" and not experiment.strip():
            raise click.BadParameter("blank name; use '' to skip MLflow", param_hint="--experiment")
        return fn(*args, config=config, **kwargs)

    for option in reversed(_common):
        wrapper = option(wrapper)
    return wrapper


def _config(
    policies: str,
    capacities: str,
    train_fraction: float,
    profile: str | None,
    load: float,
    modes: str,
    no_peers: bool,
) -> ComparisonConfig:
    from predictor.registry import available_policies

    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    unknown = [n for n in names if n not in available_policies()]
    if unknown:
        raise click.BadParameter(
            f"unknown policies {unknown}; valid: {', '.join(available_policies())}",
            param_hint="--policies",
        )
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not mode_list or any(m not in ("single", "tiered") for m in mode_list):
        raise click.BadParameter(
            f"{modes!r}: give single, tiered, or single,tiered", param_hint="--modes"
        )
    if profile is not None and profile != "default" and not Path(profile).is_file():
        raise click.BadParameter(
            f"{profile}: no such profile file; omit --profile for the bundled 480B TP8 "
            "profile (executor/profiles/default.toml) or pass a TOML file shaped like it",
            param_hint="--profile",
        )
    return ComparisonConfig(
        policies=names,
        capacities=parse_fractions(capacities),
        train_fraction=train_fraction,
        modes=mode_list,
        profile=profile,
        load=load,
        peers=not no_peers,
    )


def _out_dir(out_dir: Path | None, name: str) -> Path:
    return out_dir or DEFAULT_OUT / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


@click.command()
@click.option(
    "--trace", "trace", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path)
)
@click.option(
    "--model",
    "models",
    multiple=True,
    help="Use a trained model instead of training: lightgbm=PATH|models:/NAME@ALIAS.",
)
@comparison_options
def replay(
    trace: Path,
    models: tuple[str, ...],
    config: ComparisonConfig,
    out_dir: Path | None,
    experiment: str,
    training: str | None,
    time_unit: str,
) -> None:
    """Replay a trace through the sidecar loop for every policy and capacity, in the
    single-tier and tiered-with-prefetch settings; train the learned policies on the
    first part of the trace by time unless models are given."""
    rejects = RejectLog()
    try:
        events = list(read_trace(trace, rejects=rejects, time_unit=time_unit))
    except TraceFormatError as exc:
        raise click.ClickException(str(exc)) from None
    if not events:
        raise click.ClickException(
            f"{trace}: no valid requests to replay; "
            + (rejects.summary() or "the file holds no rows")
        )
    if rejects.total:
        click.echo(rejects.summary(), err=True)
    loaded = _load_models(models)
    _run(
        trace,
        events,
        config,
        models=loaded,
        out_dir=_out_dir(out_dir, trace.name.split(".")[0]),
        experiment=experiment or None,
        quick=training == "quick",
    )


@click.command()
@click.option(
    "--requests", "num_requests", type=click.IntRange(min=500), default=4000, show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--profile-mix",
    "mix",
    default="mixed",
    show_default=True,
    help="Workload profile of the generator.",
)
@comparison_options
def demo(
    num_requests: int,
    seed: int,
    mix: str,
    config: ComparisonConfig,
    out_dir: Path | None,
    experiment: str,
    training: str | None,
    time_unit: str,
) -> None:
    """The main job on an embedded default: generate a workload, train LightGBM and
    the LSTM, replay every policy against the baselines and the oracle, print the
    tables, write the plots and log everything to MLflow."""
    from features.generator import generate_to_file, params_for

    out = _out_dir(out_dir, "demo")
    trace = generate_to_file(
        params_for(mix, num_requests=num_requests, seed=seed), out / f"{mix}-{num_requests}.jsonl"
    )
    quick = training != "full"
    click.echo(
        f"generated {num_requests:,} requests ({mix}, seed {seed}) in {trace}; learned "
        f"policies train {'quick' if quick else 'full'} (same numbers: kvwarm replay --trace "
        f"{trace} --training {'quick' if quick else 'full'})",
        err=True,
    )
    _run(
        trace,
        list(read_trace(trace)),
        config,
        models={},
        out_dir=out,
        experiment=experiment or None,
        quick=quick,
    )
    click.echo(f"\nplots and results.json are in {out}/")
