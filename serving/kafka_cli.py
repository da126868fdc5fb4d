"""``kvwarm produce``: replay a trace into a Kafka topic. kafka-python is imported only
when it runs. (The local broker, ``kvwarm kafka up``, is a devtool: ``devtools.kafka_cli``.)"""

from __future__ import annotations

import os
from pathlib import Path

import click

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--topic", "-t", required=True, help="Topic to produce access events to.")
@click.option(
    "--bootstrap",
    default=lambda: os.environ.get("KVWARM_KAFKA_BOOTSTRAP", DEFAULT_BOOTSTRAP),
    show_default=f"$KVWARM_KAFKA_BOOTSTRAP or {DEFAULT_BOOTSTRAP}",
    help="host:port[,host:port...] of the brokers.",
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
    bootstrap: str,
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
    from serving.kafka_io import KafkaSecurity, KafkaUnavailableError, ensure_topics, produce_trace

    if speed is not None and max_rate is not None:
        raise click.UsageError("give --speed or --max-rate, not both")
    security = KafkaSecurity()
    try:
        if partitions is not None:
            ensure_topics(bootstrap, {topic: partitions}, security=security)
        report = produce_trace(
            trace, bootstrap, topic,
            speed=speed, max_rate_per_s=max_rate, fmt=fmt, limit=limit,
            progress=not no_progress, security=security,
        )  # fmt: skip
    except KafkaUnavailableError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"produced {report.num_events:,} events ({report.num_block_accesses:,} block accesses) "
        f"to {topic} in {report.elapsed_s:.1f} s ({report.events_per_s:,.0f} events/s); "
        f"{report.num_rejected_rows} rows rejected"
    )
