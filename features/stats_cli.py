"""``kvwarm stats TRACE``: statistics of a trace and its LRU/Belady hit ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from features.annotate import access_arrays
from features.decoders import TIME_UNITS, TRACE_FORMATS, RejectLog, TraceFormatError, read_trace
from features.trace_stats import DEFAULT_CAPACITIES, format_stats, trace_stats


def parse_fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected comma-separated fractions such as 0.01,0.05"
        ) from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise click.BadParameter(f"{text!r}: each fraction must be in (0, 1]")
    return values


@click.command()
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--capacities",
    default=",".join(str(c) for c in DEFAULT_CAPACITIES),
    show_default=True,
    help="Cache sizes as fractions of the distinct blocks.",
)
@click.option(
    "--format", "fmt", type=click.Choice(TRACE_FORMATS), default="auto", show_default=True
)
@click.option(
    "--rejects",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append rejected rows here (JSONL).",
)
@click.option(
    "--time-unit",
    type=click.Choice(TIME_UNITS),
    default="auto",
    show_default=True,
    help="Unit of the trace's timestamps (auto: by magnitude).",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def stats(
    trace: Path, capacities: str, fmt: str, rejects: Path | None, time_unit: str, as_json: bool
) -> None:
    """Print a trace's size, reuse and LRU/Belady hit ratios at each capacity.

    Capacity = int(fraction x distinct blocks); every access of every block in
    prefix order counts; both caches always admit.
    """
    fractions = parse_fractions(capacities)
    log = RejectLog(path=rejects)
    try:
        arrays = access_arrays(read_trace(trace, fmt=fmt, rejects=log, time_unit=time_unit))
    except TraceFormatError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        log.close()
    if arrays.num_accesses == 0:
        raise click.ClickException(
            f"{trace}: no valid requests; "
            + (log.summary() or "the file holds no rows")
            + (
                "; if the timestamps are not ms, pass --time-unit s|us|ns"
                if "ts_" in (log.counts.most_common(1)[0][0] if log.counts else "")
                else ""
            )
        )
    result = trace_stats(arrays, fractions)
    result.num_rejects = log.total
    result.rejects_by_reason = dict(log.counts)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        click.echo(format_stats(result))
        for example in log.examples[:5]:
            click.echo(f"rejected: {example}", err=True)
