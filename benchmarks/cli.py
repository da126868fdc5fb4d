"""``kvwarm bench NAME``: benchmarks (not tests). Each prints ratios against a baseline
run in the same process, so figures compare across noisy shared machines.

One module per subcommand in this package (the shared-trace lookup is
``benchmarks.traces``). To add one, put a ``click.Command`` in a new module here and add
a line to ``BENCHES``. ``kvwarm bench all`` runs every one in turn.
"""

from __future__ import annotations

import importlib

import click

# name -> ("module:attribute", one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "chains": (
        "benchmarks.chain_signal:chain_signal_bench",
        "How well the chain return model tells returning conversations apart on the "
        "held-out part, against recency alone (ROC AUC, average precision, per feature).",
    ),
    "executor": (
        "benchmarks.executor_promote:bench_executor",
        "Executor promote GB/s, serial vs parallel vs raw read of the same files.",
    ),
    "executor-apply": (
        "benchmarks.executor_apply:bench_executor_apply",
        "Decisions/s the local executor applies in serve (journal on), group commit vs per record.",
    ),
    "features": (
        "benchmarks.feature_state:features",
        "Feature state: block accesses/s for update and update+extraction, bytes per block, dataset build time.",
    ),
    "guard": (
        "benchmarks.guard_cache:guard_bench",
        "The online guard vs each of its candidates alone, single tier, on a cold cache "
        "(as the suite) and a warm one.",
    ),
    "kafka": (
        "benchmarks.kafka_throughput:bench_kafka",
        "Kafka block accesses/s (produce, consume+decode; 1 and 4 partitions) and latency vs decode from memory.",
    ),
    "quality": (
        "benchmarks.quality:quality",
        "Workload suite (shared trace + 7 generator profiles) at 1/5/10%: kvwarm policies "
        "(learned ones guarded) vs exact LRU, Belady and the best libCacheSim peer.",
    ),
    "replay": (
        "benchmarks.replay_speed:replay_bench",
        "Single-tier replay block accesses/s per policy vs an exact LRU pass.",
    ),
    "seed": (
        "benchmarks.seed:bench_seed",
        "The seed's R1 and R2/R3 figures beside the simulation of the same setting.",
    ),
    "serve": (
        "benchmarks.sidecar:serve_bench",
        "Sidecar block accesses/s and event-to-decision latency vs LRU.",
    ),
    "soak": (
        "benchmarks.soak:soak",
        "RSS per policy over millions of distinct blocks (plateau), vs an uncapped LRU.",
    ),
    "zmq": (
        "benchmarks.zmq_events:bench_zmq",
        "KV events/s from ZMQ (and bridged into Kafka) vs decode from memory.",
    ),
}


def _load(name: str) -> click.Command:
    module_name, attr = BENCHES[name][0].split(":")
    command = getattr(importlib.import_module(module_name), attr)
    assert isinstance(command, click.Command)
    return command


class _BenchGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*sorted(BENCHES), "all"]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "all":
            return run_all
        return _load(cmd_name) if cmd_name in BENCHES else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(n, BENCHES[n][1]) for n in sorted(BENCHES)] + [("all", "Run every benchmark.")]
        with formatter.section("Benchmarks"):
            formatter.write_dl(rows)


@click.command("all")
@click.pass_context
def run_all(ctx: click.Context) -> None:
    """Run every benchmark with its defaults."""
    for name in sorted(BENCHES):
        click.echo(f"\n=== kvwarm bench {name}")
        ctx.invoke(_load(name))


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmarks: throughput and latency as ratios against same-process baselines."""
