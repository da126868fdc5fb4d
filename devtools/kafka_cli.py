"""``kvwarm kafka up|down|status|fetch``: a local broker for tests, demos and benchmarks
(``devtools.kafka_broker``). Production points ``kvwarm serve`` at its own brokers."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from devtools.kafka_broker import (
    DEFAULT_HEAP_MB,
    KAFKA_VERSION,
    KafkaBroker,
    KafkaBrokerError,
    default_state_dir,
    fetch_jars,
)

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
