"""``kvwarm produce``: replay a trace into a Kafka topic. kafka-python is imported only
when it runs. (The local broker, ``kvwarm kafka up``, is a devtool: ``devtools.kafka_cli``.)

With no ``--bootstrap``, the address is ``serving.settings.local_bootstrap()``: what
``serve`` and ``bridge`` use too (``$KVWARM_KAFKA_BOOTSTRAP``, else the address ``kafka
up`` wrote, else 127.0.0.1:9092); the default topic is the one ``serve`` reads."""

from __future__ import annotations

from pathlib import Path

import click

from features.decoders import TIME_UNITS
from serving.settings import (
    BOOTSTRAP_ENV,
    DEFAULT_BOOTSTRAP,
    DEFAULT_EVENTS_TOPIC,
    local_bootstrap,
)


@click.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option(
    "--topic",
    "-t",
    default=DEFAULT_EVENTS_TOPIC,
    show_default=True,
    help="Topic to produce access events to (what `serve` reads by default).",
)
@click.option(
    "--bootstrap",
    default=None,
    show_default=f"${BOOTSTRAP_ENV}, else the address `kvwarm kafka up` wrote, else "
    f"{DEFAULT_BOOTSTRAP}",
    help="host:port[,host:port...] of the brokers.",
)
@click.option(
    "--restamp",
    is_flag=True,
    help="Stamp each event with the wall clock when it is sent (for `serve --clock wall`); "
    "by default events keep the trace's own time, which `serve` uses.",
)
@click.option(
    "--time-unit",
    type=click.Choice(TIME_UNITS),
    default="auto",
    show_default=True,
    help="Unit of the trace's timestamps (auto: by magnitude).",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Trace time x SPEED (1 = real time).",
)
@click.option(
    "--max-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="At most N events/s.",
)
@click.option(
    "--partitions",
    type=click.IntRange(1),
    default=None,
    help="Create the topic with N partitions if missing.",
)
@click.option(
    "--format", "fmt", type=click.Choice(["auto", "mooncake", "jsonl", "csv"]), default="auto"
)
@click.option("--limit", type=click.IntRange(1), default=None, help="Stop after N events.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def produce(
    trace: Path,
    topic: str,
    bootstrap: str | None,
    restamp: bool,
    time_unit: str,
    speed: float | None,
    max_rate: float | None,
    partitions: int | None,
    fmt: str,
    limit: int | None,
    no_progress: bool,
) -> None:
    """Replay TRACE into a Kafka topic, keyed by prefix root (first block hash).

    Without --speed or --max-rate, as fast as the broker takes it.
    """
    from features.decoders import TraceFormatError, check_trace_file
    from serving.kafka_io import KafkaSecurity, KafkaUnavailableError, ensure_topics, produce_trace

    if speed is not None and max_rate is not None:
        raise click.UsageError("give --speed or --max-rate, not both")
    try:
        check_trace_file(trace, fmt)
    except TraceFormatError as exc:
        raise click.UsageError(str(exc)) from None
    bootstrap = bootstrap or local_bootstrap()
    security = KafkaSecurity()
    try:
        if partitions is not None:
            ensure_topics(bootstrap, {topic: partitions}, security=security)
        report = produce_trace(
            trace, bootstrap, topic,
            speed=speed, max_rate_per_s=max_rate, fmt=fmt, limit=limit,
            progress=not no_progress, security=security, restamp=restamp, time_unit=time_unit,
        )  # fmt: skip
    except KafkaUnavailableError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"produced {report.num_events:,} events ({report.num_block_accesses:,} block accesses) "
        f"to {topic} at {bootstrap} in {report.elapsed_s:.1f} s "
        f"({report.events_per_s:,.0f} events/s), "
        f"{'restamped to the wall clock' if restamp else 'on the trace clock'}; "
        f"{report.rejects_summary or '0 rows rejected'}"
    )
    if report.num_events == 0:
        raise click.ClickException(
            f"{trace}: no valid events to produce; {report.rejects_summary or 'the file is empty'}"
        )
