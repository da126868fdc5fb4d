"""``kvwarm train``: build the dataset, train a model, compare it with the baselines on
the test part, and log everything to MLflow (optionally registering the model)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000}


def parse_duration_ms(text: str) -> int:
    """``"60s"`` -> 60000. The unit is required: a bare ``60`` is refused (it has meant
    ms to some readers and seconds to others)."""
    match = _DURATION.match(text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a duration; use e.g. 60s, 2m, 45000ms")
    if match.group(2) is None:
        raise click.BadParameter(
            f"{text!r} has no unit; write {match.group(1)}s, {match.group(1)}ms or "
            f"{match.group(1)}m"
        )
    value = int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    if value <= 0:
        raise click.BadParameter("the horizon must be positive")
    return value


def _parse_params(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE (e.g. num_leaves=31)")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


@click.command("train")
@click.option(
    "--trace",
    "trace",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Trace file (Mooncake JSONL, canonical JSONL or CSV; .gz ok).",
)
@click.option(
    "--model",
    type=click.Choice(["lightgbm", "lstm"]),
    required=True,
    help="Which learned policy to train.",
)
@click.option(
    "--horizon",
    "horizon",
    default="auto",
    show_default=True,
    help="H: predict reuse within (t, t+H]; with a unit: 60s, 2m, 45000ms. auto: the "
    "one of 2s, 10s, 60s, 5m whose quick fit hits most on the validation span.",
    callback=lambda ctx, param, value: None if value == "auto" else parse_duration_ms(value),
)
@click.option("--experiment", default="kvwarm", show_default=True, help="MLflow experiment name.")
@click.option("--register", "register", default=None, help="Register the model under this name.")
@click.option(
    "--alias",
    default=None,
    help="Point this alias (e.g. champion) at the new version; needs --register.",
)
@click.option(
    "--train-fraction",
    default=0.6,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="Share of the trace's time span for training+validation; the rest is test.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--param",
    "params",
    multiple=True,
    help="Model parameter KEY=VALUE (repeatable), e.g. objective=log_time_to_next.",
)
@click.option(
    "--save",
    "save_dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Also save the policy directory here.",
)
@click.option(
    "--tracking-uri",
    default=None,
    help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db).",
)
@click.option(
    "--gate/--no-gate",
    default=True,
    show_default=True,
    help="Move --alias only if the model beats LRU, LFU and prefix LRU on the held-out "
    "part (single-tier hit ratio at 1/5/10%); a refused model is registered without it.",
)
@click.option(
    "--refit/--no-refit",
    default=True,
    show_default=True,
    help="Once the validation rows have made their choices, fit the model again on the "
    "training and validation rows together (the newest requests too), before the gate.",
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def train(
    trace: Path,
    model: str,
    horizon: int | None,
    experiment: str,
    register: str | None,
    alias: str | None,
    train_fraction: float,
    seed: int,
    params: tuple[str, ...],
    save_dir: Path | None,
    tracking_uri: str | None,
    gate: bool,
    refit: bool,
    no_progress: bool,
) -> None:
    """Train a learned policy on a trace and log the run to MLflow."""
    from training.train import TrainConfig, TrainingError, run_tracked

    if alias and not register:
        raise click.UsageError("--alias needs --register NAME")
    if not experiment.strip():
        raise click.BadParameter(
            "an MLflow experiment needs a name (train always logs its run); e.g. "
            "--experiment kvwarm",
            param_hint="--experiment",
        )
    try:
        config = TrainConfig(
            model=model,
            horizon_ms=horizon,
            train_fraction=train_fraction,
            seed=seed,
            model_params=_parse_params(params),
            gate=gate,
            refit=refit,
        )
        result = run_tracked(
            trace,
            config,
            experiment=experiment,
            register=register,
            alias=alias,
            store_uri=tracking_uri,
            echo=click.echo,
            show_progress=not no_progress,
        )
    except (TrainingError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("")
    click.echo(result.table())
    click.echo("")
    timings = ", ".join(f"{k} {v:.1f}" for k, v in result.timings_s.items())
    click.echo(f"times (s): {timings}; model {result.policy.model_size_bytes():,} bytes")
    if save_dir is not None:
        result.policy.save(save_dir)
        click.echo(f"saved policy to {save_dir}")
    from training.tracking import tracking_uri as default_uri
    from training.tracking import ui_command

    click.echo(f"browse the run: {ui_command(tracking_uri or default_uri())}")
