"""Where benchmarks find their trace: the shared Mooncake conversation trace when it is
present, else a generated workload of the same size (said so in the output).

The shared trace is never copied into the repository; it sits at
``../shared/traces/mooncake_conversation_trace.jsonl.gz`` next to the checkout, or
wherever ``$KVWARM_SHARED_TRACE`` points (the test fixture honours the same variable).
"""

from __future__ import annotations

import os
from pathlib import Path

from features.decoders import decode_mooncake, read_trace
from features.events import BlocksAccessed

SHARED_TRACE_NAME = "mooncake_conversation_trace.jsonl.gz"
SHARED_TRACE_REQUESTS = 12_031
"""Requests in the shared trace; the generated stand-in has as many."""


def shared_trace_path() -> Path | None:
    """The shared trace if it exists: ``$KVWARM_SHARED_TRACE``, else ``../shared/traces``
    beside the repository, else beside the working directory."""
    explicit = os.environ.get("KVWARM_SHARED_TRACE")
    candidates = (
        [Path(explicit)]
        if explicit
        else [
            Path(__file__).resolve().parents[2] / "shared" / "traces" / SHARED_TRACE_NAME,
            Path.cwd().parent / "shared" / "traces" / SHARED_TRACE_NAME,
        ]
    )
    return next((p for p in candidates if p.is_file()), None)


def generated_events(
    num_requests: int = SHARED_TRACE_REQUESTS, seed: int = 0, prefix: str = ""
) -> list[BlocksAccessed]:
    """A generated mixed workload (``features.generator``), decoded like a trace; request
    ids are ``prefix`` + row number."""
    from features.generator import generate, params_for

    rows = generate(params_for("mixed", num_requests=num_requests, seed=seed))
    return [decode_mooncake(row, f"{prefix}{i}") for i, row in enumerate(rows)]


def load_events(trace: Path | None = None) -> tuple[list[BlocksAccessed], str]:
    """The events of ``trace``, else of the shared trace, else of a generated stand-in,
    with a line saying which."""
    path = trace or shared_trace_path()
    if path is not None:
        return list(read_trace(path)), str(path)
    return (
        generated_events(),
        f"generated mixed workload, {SHARED_TRACE_REQUESTS:,} requests (shared trace not found)",
    )
