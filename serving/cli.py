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
import sys
from typing import Any

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


class OneLineErrors(LazyGroup):
    """Every error a command raises ends as one line on stderr: ``kvwarm CMD: error:
    what is wrong; what to do``. Exit 2 for usage errors (bad flags or values), 1 for
    runtime errors. An unexpected exception also prints one line (its type and message,
    with a pointer to ``-v``); ``-v`` shows its traceback."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["standalone_mode"] = False
        kwargs.setdefault("prog_name", "kvwarm")
        argv = list(args[0] if args else kwargs.get("args") or sys.argv[1:])
        words = [a for a in argv if not a.startswith("-")]
        command_path = f"kvwarm {words[0]}" if words and words[0] in COMMANDS else "kvwarm"
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("kvwarm: aborted", err=True)
            sys.exit(1)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "kvwarm"
            hint = f"; see `{where} --help`" if "--help" not in exc.format_message() else ""
            click.echo(f"{where}: error: {_one_line(exc.format_message())}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"{command_path}: error: {_one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code if exc.exit_code != 0 else 1)
        except KeyboardInterrupt:
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(1)
        except Exception as exc:
            if _VERBOSE:
                raise
            click.echo(
                f"{command_path}: error: {type(exc).__name__}: {_one_line(str(exc))} "
                "(run with -v for the traceback)",
                err=True,
            )
            sys.exit(1)


_VERBOSE = 0


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return " ".join(lines)[:1000] if lines else "failed"


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="kvwarm")
def main(verbose: int) -> None:
    """kvwarm: learned access prediction and prewarming for tiered KV caches."""
    global _VERBOSE
    _VERBOSE = verbose
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(
        level=os.environ.get("KVWARM_LOG_LEVEL", logging.getLevelName(level)),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # kafka-python logs every failed connection attempt; our errors say it in one line.
        logging.getLogger("kafka").setLevel(logging.CRITICAL)


if __name__ == "__main__":
    main()
