"""Event sources of the sidecar loop.

Contract (every source, file, Kafka or ZMQ):

- ``poll(max_events, timeout_ms)`` returns up to ``max_events`` decoded events
  (``BlocksAccessed`` or residency events), oldest first. Malformed input never
  reaches the caller: the source has already counted it and sent it to its
  dead-letter topic or rejects file. An empty list means nothing arrived within
  ``timeout_ms``; ``exhausted`` says whether more can ever come.
- ``commit()`` is called by the loop after every event returned so far has been
  fully handled (its decisions emitted). Sources with offsets (Kafka) commit them
  here and only here: that is what makes delivery at-least-once.
- ``close()`` releases resources; safe to call twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from features.decoders import RejectLog, read_trace
from features.events import Event


@runtime_checkable
class EventSource(Protocol):
    @property
    def exhausted(self) -> bool: ...

    def poll(self, max_events: int, timeout_ms: int) -> list[Event]: ...

    def commit(self) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class ReportsReadiness(Protocol):
    """A source that can be up yet unable to deliver (a ZMQ source with no engine
    connected) declares it: ``ready`` is read by ``/readyz`` from the HTTP thread."""

    @property
    def ready(self) -> bool: ...


class FileSource:
    """Streams a trace file (any format ``read_trace`` knows) as a source.

    Rejected rows go to ``rejects_path`` when given and are always counted. Timestamps
    are read in ``time_unit`` (``features.decoders.TIME_UNITS``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fmt: str = "auto",
        rejects_path: str | os.PathLike[str] | None = None,
        time_unit: str = "auto",
    ) -> None:
        self.path = Path(path)
        self.rejects = RejectLog(path=Path(rejects_path) if rejects_path else None)
        # Raises TraceFormatError here, at start, for a missing or binary file.
        self._events: Iterator[Event] = read_trace(
            self.path, fmt=fmt, rejects=self.rejects, time_unit=time_unit
        )
        self._exhausted = False
        self.num_events = 0

    @property
    def exhausted(self) -> bool:
        return self._exhausted

    def poll(self, max_events: int, timeout_ms: int = 0) -> list[Event]:
        out: list[Event] = []
        if self._exhausted:
            return out
        for event in self._events:
            out.append(event)
            if len(out) >= max_events:
                break
        else:
            self._exhausted = True
        self.num_events += len(out)
        return out

    def commit(self) -> None:
        """A file has no offsets to commit."""

    def close(self) -> None:
        self.rejects.close()

    def stats(self) -> dict[str, Any]:
        return {
            "events": self.num_events,
            "rejects": self.rejects.total,
            "rejects_by_reason": dict(self.rejects.counts),
        }
