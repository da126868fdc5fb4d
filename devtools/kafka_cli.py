"""``kvwarm kafka up|down|status|fetch``: a local broker for tests, demos and benchmarks
(``devtools.kafka_broker``). Production points ``kvwarm serve`` at its own brokers.

``kafka up`` listens on 9092 when that port is free (else on a free port, and says so)
and writes its address to ``serving.settings.bootstrap_file()``, which ``serve``,
``produce`` and ``bridge`` read when given no address; ``kafka down`` removes it."""

from __future__ import annotations

import socket
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
from serving.settings import BOOTSTRAP_ENV, DEFAULT_BOOTSTRAP, bootstrap_file

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
    help="Broker port [default: 9092 if free, else a free one; kept for later starts].",
)
@click.option("--heap-mb", type=click.IntRange(128), default=DEFAULT_HEAP_MB, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the state dir first (all topics and offsets).")
@click.option("--timeout-s", type=float, default=120, show_default=True)
def up(
    state_dir: Path | None, port: int | None, heap_mb: int, fresh: bool, timeout_s: float
) -> None:
    """Start the broker in the background and wait until it accepts connections.

    It listens on 127.0.0.1:9092 when that port is free; otherwise on a free port, said
    here. Either way its address is written where `serve`, `produce` and `bridge` look
    when given none, so the README's commands work unchanged.
    """
    default_port = int(DEFAULT_BOOTSTRAP.rsplit(":", 1)[1])
    if fresh:
        KafkaBroker(state_dir).destroy()
    broker = KafkaBroker(state_dir, port=port, heap_mb=heap_mb)
    if port is None and not broker.status().running and _port_free(default_port):
        # Only a broker not yet configured takes the request; a configured one keeps its port.
        broker = KafkaBroker(state_dir, port=default_port, heap_mb=heap_mb)
    try:
        start_s = broker.start(timeout_s=timeout_s)
    except KafkaBrokerError as exc:
        raise click.ClickException(str(exc)) from None
    status = broker.status()
    note = "already running" if start_s == 0.0 else f"ready in {start_s:.1f} s"
    click.echo(f"Kafka {KAFKA_VERSION} {note}: pid {status.pid}, bootstrap {status.bootstrap}")
    path = bootstrap_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(status.bootstrap + "\n", encoding="utf-8")
    if status.bootstrap != DEFAULT_BOOTSTRAP:
        click.echo(
            f"port {default_port} was taken: the broker listens on {status.bootstrap}; "
            f"serve, produce and bridge find it through {path} (or {BOOTSTRAP_ENV})"
        )


def _port_free(port: int) -> bool:
    """Nothing on 127.0.0.1 accepts connections on ``port`` and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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
    if state_dir is None:
        bootstrap_file().unlink(missing_ok=True)
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
