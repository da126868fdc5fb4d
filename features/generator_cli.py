"""``kvwarm generate``: write a synthetic trace in the Mooncake JSONL format."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from features.generator import PROFILES, generate_to_file, params_for, write_trace


@click.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output file (default: stdout).",
)
@click.option(
    "--requests", "num_requests", type=click.IntRange(min=1), default=20_000, show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    default="mixed",
    show_default=True,
    help="Named workload mix (see features/generator.py).",
)
@click.option(
    "--session-ids",
    is_flag=True,
    help="Add a session_id field to each row (not in real Mooncake traces).",
)
def generate(
    output: Path | None, num_requests: int, seed: int, profile: str, session_ids: bool
) -> None:
    """Write a seeded synthetic serving trace: multi-turn chat, shared system prompts,
    RAG documents, agent loops, scans, bursty diurnal arrivals. Same seed, same bytes."""
    params = params_for(profile, num_requests=num_requests, seed=seed)
    if output is None:
        write_trace(params, sys.stdout, session_ids=session_ids)
    else:
        generate_to_file(params, output, session_ids=session_ids)
        click.echo(
            f"wrote {num_requests:,} requests ({profile}, seed {seed}) to {output}", err=True
        )
