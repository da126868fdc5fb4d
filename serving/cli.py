"""The ``kvwarm`` command line: one group, subcommands loaded lazily.

Each subcommand lives in the module that owns its job and is imported only when it
runs, so ``kvwarm --help`` and ``kvwarm stats`` never import torch, LightGBM,
MLflow or kafka-python. To add one, put a ``click.Command`` in its module and add a
line to ``COMMANDS``.

This table is the one place where ``serving`` names the packages above it (``training``,
``benchmarks``, ``devtools``): by string, imported only when their command runs.
"""

from __future__ import annotations

import importlib
import logging
import os

import click

# name -> ("module:attribute", one-line help shown by ``kvwarm --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "features.generator_cli:generate",
        "Write a synthetic serving trace (Mooncake JSONL).",
    ),
    "stats": ("features.stats_cli:stats", "Print a trace's statistics and LRU/Belady hit ratios."),
    "bench": ("benchmarks.cli:bench", "Run benchmarks (ratios against same-process baselines)."),
    "train": (
        "training.train_cli:train",
        "Train a LightGBM/LSTM policy, compare with baselines, log to MLflow.",
    ),
    "kafka": ("devtools.kafka_cli:kafka", "Run a local Kafka broker: up, down, status, fetch."),
    "produce": (
        "serving.kafka_cli:produce",
        "Replay a trace into a Kafka topic (real time, scaled, capped).",
    ),
    "serve": (
        "serving.serve_cli:serve",
        "Run the sidecar: events in, promote/demote decisions out.",
    ),
    "bridge": ("serving.bridge:bridge", "Forward vLLM/SGLang KV events from ZMQ into Kafka."),
    "replay": (
        "training.replay_cli:replay",
        "Replay a trace: every policy vs baselines and the oracle.",
    ),
    "demo": (
        "training.replay_cli:demo",
        "The main job on a generated workload: train, replay, report.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attr = entry[0].split(":")
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # One line each without importing the modules.
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="kvwarm")
def main(verbose: int) -> None:
    """kvwarm: learned access prediction and prewarming for tiered KV caches."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(
        level=os.environ.get("KVWARM_LOG_LEVEL", logging.getLevelName(level)),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


if __name__ == "__main__":
    main()
