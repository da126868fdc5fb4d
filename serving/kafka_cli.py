"""``kvwarm kafka up|down|status|fetch`` (a local broker) and ``kvwarm produce`` (replay a
trace into a topic). kafka-python is imported only when ``produce`` runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from serving.kafka_broker import (
    DEFAULT_HEAP_MB,
    KAFKA_VERSION,
    KafkaBroker,
    KafkaBrokerError,
    default_state_dir,
    fetch_jars,
)

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

_state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the broker keeps data, logs and its PID file [default: .cache/kafka/broker].",
)


@click.group()
def kafka() -> None:
    """A local Apache Kafka broker (KRaft, one node on 127.0.0.1) from Maven jars."""


@kafka.command()
def fetch() -> None:
    """Fetch the broker's jars with Maven (cached: a second run returns at once)."""
    try:
        jars = fetch_jars()
    except KafkaBrokerError as exc:
        raise click.ClickException(str(exc)) from None
    what = "fetched" if jars.fetched_now else "cached"
    click.echo(
        f"Kafka {KAFKA_VERSION}: {jars.num_jars} jars, {jars.size_bytes / 1e6:.1f} MB {what} "
        f"in {jars.lib_dir} ({jars.elapsed_s:.1f} s)"
    )


@kafka.command()
@_state_dir_option
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Broker port [default: a free one, kept].",
)
@click.option("--heap-mb", type=click.IntRange(128), default=DEFAULT_HEAP_MB, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the state dir first (all topics and offsets).")
@click.option("--timeout-s", type=float, default=120, show_default=True)
def up(
    state_dir: Path | None, port: int | None, heap_mb: int, fresh: bool, timeout_s: float
) -> None:
    """Start the broker in the background and wait until it accepts connections."""
    broker = KafkaBroker(state_dir, port=port, heap_mb=heap_mb)
    if fresh:
        broker.destroy()
        broker = KafkaBroker(state_dir, port=port, heap_mb=heap_mb)
    try:
        start_s = broker.start(timeout_s=timeout_s)
    except KafkaBrokerError as exc:
        raise click.ClickException(str(exc)) from None
    status = broker.status()
    note = "already running" if start_s == 0.0 else f"ready in {start_s:.1f} s"
    click.echo(f"Kafka {KAFKA_VERSION} {note}: pid {status.pid}, bootstrap {status.bootstrap}")
    click.echo(f"export KVWARM_KAFKA_BOOTSTRAP={status.bootstrap}")


@kafka.command()
@_state_dir_option
@click.option(
    "--grace-s", type=float, default=30, show_default=True, help="SIGKILL after this long."
)
@click.option("--delete-data", is_flag=True, help="Also delete the state dir.")
def down(state_dir: Path | None, grace_s: float, delete_data: bool) -> None:
    """Stop the broker started from this state dir (by its PID, never by name)."""
    broker = KafkaBroker(state_dir)
    was_running = broker.stop(grace_s=grace_s)
    if delete_data:
        broker.destroy()
    click.echo("stopped" if was_running else f"not running (state dir {broker.state_dir})")


@kafka.command()
@_state_dir_option
def status(state_dir: Path | None) -> None:
    """Say whether the broker runs; exit 0 if it accepts connections, 3 if not."""
    st = KafkaBroker(state_dir or default_state_dir()).status()
    click.echo(st.describe())
    sys.exit(0 if st.running and st.accepting else 3)


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
