"""Request events into the sidecar: ``POST /v1/requests`` and the engine join.

Where accesses come from next to a real engine: the router (or gateway) sees each
prompt's token ids before the engine schedules it, and posts them here (or publishes
the same JSON to the Kafka events topic, where ``features.decoders`` hashes it too).
kvwarm hashes the tokens exactly as the engine will (``features.block_hash``), so the
access names the blocks the engine's own ``BlockStored``/``BlockRemoved`` events name.

Primitives:

- ``RequestIntake``: validates and hashes one request body, queues the resulting
  ``BlocksAccessed`` (bounded: a full queue answers 503, the router retries or drops;
  nothing is buffered without limit). Called by the HTTP server's thread.
- ``IntakeSource``: an ``EventSource`` that merges the intake queue with the sidecar's
  main source (Kafka, ZMQ, file), and keeps one engine's stream of truth: events that
  name another engine (``engine_id`` set and different) are counted and dropped, so
  residency and accesses of the same engine meet in one placement mirror. The loop
  calls ``poll``/``commit`` as with any source. Requests taken over HTTP are not
  durable (at-most-once); the Kafka topic is the durable path.

HTTP answers: 202 ``{request_id, num_blocks, block_hashes}``; 400 with a one-line error
naming the field and the fix; 413 for a body over ``MAX_REQUEST_BODY_BYTES``; 503 when
the queue is full.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter, deque
from typing import Any

from features.block_hash import Tokenize, decode_request_event
from features.events import BlocksAccessed, Event, EventValidationError
from serving.sources import EventSource, ReportsReadiness

log = logging.getLogger(__name__)

REQUESTS_PATH = "/v1/requests"

MAX_REQUEST_BODY_BYTES = 16 << 20
"""Largest request body: a million tokens as JSON digits fits with room to spare."""

DEFAULT_MAX_PENDING = 10_000
"""Requests queued between two polls of the loop before new ones get 503."""


class RequestIntake:
    """Hashes request bodies into access events and queues them for the loop."""

    def __init__(
        self, *, max_pending: int = DEFAULT_MAX_PENDING, tokenize: Tokenize | None = None
    ) -> None:
        """``tokenize`` (``features.block_hash.load_tokenizer``) lets requests send
        ``text`` instead of ``token_ids``."""
        self.max_pending = max_pending
        self.tokenize = tokenize
        self._queue: deque[BlocksAccessed] = deque()
        self._lock = threading.Lock()
        self.num_accepted = 0
        self.num_full = 0
        self.rejects_by_reason: Counter[str] = Counter()

    def submit(self, body: bytes, now_ms: int | None = None) -> tuple[int, dict[str, Any]]:
        """One ``POST /v1/requests`` body -> (HTTP status, JSON reply)."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        try:
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise EventValidationError("<body>", f"not JSON: {exc}", "bad_json") from None
            event = decode_request_event(
                obj,
                default_request_id=f"http-{uuid.uuid4().hex}",
                default_ts_ms=now,
                tokenize=self.tokenize,
            )
        except EventValidationError as exc:
            self.rejects_by_reason[exc.reason] += 1
            return 400, {"error": str(exc), "reason": exc.reason}
        with self._lock:
            if len(self._queue) >= self.max_pending:
                self.num_full += 1
                return 503, {
                    "error": f"{self.max_pending} requests already queued; retry later",
                    "reason": "queue_full",
                }
            self._queue.append(event)
            self.num_accepted += 1
        return 202, {
            "request_id": event.request_id,
            "num_blocks": len(event.block_hashes),
            "block_hashes": list(event.block_hashes),
        }

    def take(self, max_events: int) -> list[BlocksAccessed]:
        """Up to ``max_events`` queued events, oldest first (the loop's thread)."""
        with self._lock:
            n = min(max_events, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    @property
    def num_pending(self) -> int:
        return len(self._queue)


class IntakeSource:
    """``EventSource``: the intake queue first, then ``inner`` (None: intake only, a
    source that never ends). ``engine_id`` keeps only this engine's events (and those
    naming no engine)."""

    def __init__(
        self,
        intake: RequestIntake,
        inner: EventSource | None = None,
        *,
        engine_id: str | None = None,
    ) -> None:
        self.intake = intake
        self.inner = inner
        self.engine_id = engine_id
        self.num_other_engine = 0
        self._warned: set[str] = set()

    @property
    def exhausted(self) -> bool:
        return self.inner is not None and self.inner.exhausted and not self.intake.num_pending

    @property
    def ready(self) -> bool:
        """The inner source's readiness (``/readyz``) when it reports one, else True."""
        return self.inner.ready if isinstance(self.inner, ReportsReadiness) else True

    def dead_letter(self, event: Event, reason: str, error: str) -> None:
        """An event whose handling failed: to the inner source's dead letters (rejects
        file or dead-letter topic), or only logged when there is no inner source."""
        if self.inner is not None:
            self.inner.dead_letter(event, reason, error)
        else:
            log.warning("request event dead-lettered (%s): %s", reason, error)

    def _ours(self, event: Event) -> bool:
        other = getattr(event, "engine_id", None)
        if self.engine_id is None or not other or other == self.engine_id:
            return True
        self.num_other_engine += 1
        if len(self._warned) < 100 and other not in self._warned:
            self._warned.add(other)
            log.warning(
                "dropping events of engine %r: this sidecar serves engine %r (--engine-id)",
                other,
                self.engine_id,
            )
        return False

    def poll(self, max_events: int, timeout_ms: int = 0) -> list[Event]:
        events: list[Event] = list(self.intake.take(max_events))
        if self.inner is not None and len(events) < max_events:
            # Do not wait on the inner source while requests are in hand.
            wait_ms = 0 if events else timeout_ms
            events += self.inner.poll(max_events - len(events), wait_ms)
        elif not events and timeout_ms:
            time.sleep(min(timeout_ms, 50) / 1000)
        return [e for e in events if self._ours(e)]

    def commit(self) -> None:
        if self.inner is not None:
            self.inner.commit()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def stats(self) -> dict[str, Any]:
        out = dict(self.inner.stats()) if self.inner is not None else {}
        by_reason = dict(out.get("rejects_by_reason") or out.get("dead_letters_by_reason") or {})
        for reason, n in self.intake.rejects_by_reason.items():
            by_reason[f"request_{reason}"] = by_reason.get(f"request_{reason}", 0) + n
        out["rejects_by_reason"] = by_reason
        out["requests_accepted"] = self.intake.num_accepted
        out["requests_queue_full"] = self.intake.num_full
        out["events_other_engine"] = self.num_other_engine
        return out
