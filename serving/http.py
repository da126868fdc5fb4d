"""Health and Prometheus metrics of the sidecar, over stdlib HTTP in a thread.

Endpoints (bound to 127.0.0.1 unless configured otherwise):

- ``GET /healthz``: 200 with ``{"status": "ok"|"degraded", "reason", "model",
  "policy", "model_version"}`` plus ``"guard"`` (choice, estimates) when a learned
  model is served behind the guard. Degraded (serving the LRU fallback) is still alive, so
  still 200: restarting would not fix a bad model, publishing a good one does.
- ``GET /readyz``: 200 once the source is connected and the first poll returned, 503
  before and while shutting down.
- ``GET /metrics``: Prometheus text from the sidecar's own ``CollectorRegistry``.
- ``POST`` routes given by the service (``posts``): ``/v1/requests`` takes request
  events (``serving.request_intake``). Bodies are bounded (``max_body_bytes``: 413
  above it, 411 without a length) and a slow client times out instead of holding a
  thread.

Metrics (``SidecarMetrics``): counters are read from the live objects at scrape time
(the loop keeps plain ints and Counters and pays nothing per event for Prometheus);
the two histograms are observed as things happen.

======================================  =========================================
kvwarm_events_consumed_total{type}      access / residency events handled
kvwarm_block_accesses_total             blocks read by access events
kvwarm_rejects_total{reason}            malformed input, by reason
kvwarm_decisions_total{action,tier}     decisions emitted (tier: to_tier, or
                                        from_tier for evict)
kvwarm_moves_total{kind}                planner moves (store, demand, ...)
kvwarm_loop_seconds_total{phase}        loop wall time: poll (waiting included),
                                        handle, deliver (sinks' flush), commit
kvwarm_loop_batches_total               polls that returned events
kvwarm_executor_outcomes_total{...}     decisions by outcome status (applied, refused_full, ...)
kvwarm_hint_acks_total{status}          acknowledgements read back from sinks
                                        (accepted, clipped, deferred, rejected,
                                        missing; malformed)
kvwarm_scoring_seconds                  histogram of one policy.score call
kvwarm_event_to_decision_seconds        histogram: poll -> decisions delivered
kvwarm_lag_seconds                      wall clock - newest event's ts_ms
kvwarm_source_backlog_events            events known to wait (when the source says)
kvwarm_model_info{...} / _degraded      what is scoring, and whether it is LRU
kvwarm_model_swaps_total                hot swaps since start
kvwarm_tier_occupancy_blocks{tier}      blocks per tier (planner's view)
kvwarm_tier_capacity_blocks{tier}
kvwarm_guard_choice{policy}             1 for the candidate the guard serves
kvwarm_guard_estimated_hit_ratio{...}   ghost-cache hit ratio per candidate
kvwarm_guard_switches_total             guard changes of candidate
kvwarm_guard_served_requests_total{...} requests each candidate served
======================================  =========================================
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"

SCORING_BUCKETS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
PostHandler = Callable[[bytes], tuple[int, dict[str, Any]]]
"""A POST route: request body -> (HTTP status, JSON reply)."""

DEFAULT_MAX_BODY_BYTES = 16 << 20

LATENCY_BUCKETS_S = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


def _copy(mapping: Mapping[Any, float] | None) -> dict[Any, float]:
    """Copy a dict another thread may be growing (a resize mid-copy raises; retry)."""
    if not mapping:
        return {}
    for _ in range(5):
        try:
            return dict(mapping)
        except RuntimeError:
            continue
    return {}


class SidecarMetrics:
    """The sidecar's registry. ``bind`` the live objects once they exist; metrics of
    objects not bound (no executor, say) are simply absent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.scoring_seconds = Histogram(
            "kvwarm_scoring_seconds",
            "Seconds one policy.score call takes (one request or one prefetch round).",
            buckets=SCORING_BUCKETS_S,
            registry=self.registry,
        )
        self.event_to_decision_seconds = Histogram(
            "kvwarm_event_to_decision_seconds",
            "Seconds from an event leaving the source to its decisions being delivered.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.lag_seconds = 0.0
        self.parts: dict[str, Any] = {}
        self.registry.register(_LiveCollector(self))

    def bind(self, **parts: Any) -> None:
        """sidecar=, source=, decision_maker=, executor_sink=, model_manager=, acks= (a
        callable returning status -> count), gc_pacer=."""
        self.parts.update({k: v for k, v in parts.items() if v is not None})

    def observe_batch_latency(self, seconds: float, num_events: int) -> None:
        """Every event of a batch waited ``seconds`` (they are delivered together)."""
        observe = self.event_to_decision_seconds.observe
        for _ in range(num_events):
            observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    def __init__(self, metrics: SidecarMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        parts = self.metrics.parts
        sidecar = parts.get("sidecar")
        if sidecar is not None:
            stats = sidecar.stats
            events = CounterMetricFamily(
                "kvwarm_events_consumed", "Events handled by the loop.", labels=["type"]
            )
            events.add_metric(["access"], stats.requests)
            events.add_metric(["residency"], stats.events - stats.requests)
            yield events
            yield CounterMetricFamily(
                "kvwarm_block_accesses", "Blocks read by access events.", value=stats.block_accesses
            )
            moves = CounterMetricFamily("kvwarm_moves", "Planner moves by kind.", labels=["kind"])
            for kind, n in sorted(_copy(stats.moves_by_kind).items()):
                moves.add_metric([kind], n)
            yield moves
            phases = CounterMetricFamily(
                "kvwarm_loop_seconds",
                "Wall time of the loop by phase: poll, handle, deliver, commit.",
                labels=["phase"],
            )
            for phase, seconds in _copy(stats.seconds_by_phase).items():
                phases.add_metric([phase], seconds)
            yield phases
            yield CounterMetricFamily(
                "kvwarm_loop_batches", "Polls that returned events.", value=stats.batches
            )
            placement = sidecar.placement
            occ = GaugeMetricFamily(
                "kvwarm_tier_occupancy_blocks", "Blocks per tier.", labels=["tier"]
            )
            cap = GaugeMetricFamily(
                "kvwarm_tier_capacity_blocks", "Capacity per tier.", labels=["tier"]
            )
            for i, name in enumerate(placement.tier_names):
                occ.add_metric([name], placement.count(i))
                cap.add_metric([name], placement.capacities[i])
            yield occ
            yield cap
            guard = sidecar.policy.online_status().get("guard")
            if guard:
                yield from self._guard(guard)
        source = parts.get("source")
        if source is not None:
            yield from self._source(source)
        maker = parts.get("decision_maker")
        if maker is not None:
            dec = CounterMetricFamily(
                "kvwarm_decisions", "Decisions emitted.", labels=["action", "tier"]
            )
            for (action, tier), n in sorted(_copy(maker.by_action_tier).items()):
                dec.add_metric([action, tier], n)
            yield dec
        sink = parts.get("executor_sink")
        if sink is not None:
            out = CounterMetricFamily(
                "kvwarm_executor_outcomes",
                "Decisions by executor outcome status (executor.protocol.OUTCOME_STATUSES).",
                labels=["action", "status"],
            )
            for (action, status), n in sorted(_copy(sink.outcomes).items()):
                out.add_metric([action, status], n)
            yield out
        acks = parts.get("acks")
        if acks is not None:
            family = CounterMetricFamily(
                "kvwarm_hint_acks",
                "Acknowledgements of emitted decisions, by status.",
                labels=["status"],
            )
            for status, n in sorted(_copy(acks()).items()):
                family.add_metric([status], n)
            yield family
        pacer = parts.get("gc_pacer")
        if pacer is not None:
            yield CounterMetricFamily(
                "kvwarm_gc_paced_collections",
                "Full garbage collections run between batches (serving.gc_pacer).",
                value=pacer.num_collections,
            )
            yield CounterMetricFamily(
                "kvwarm_gc_paced_pause_seconds",
                "Time spent in those collections.",
                value=pacer.total_pause_ms / 1e3,
            )
            yield GaugeMetricFamily(
                "kvwarm_gc_paced_pause_max_seconds",
                "Longest of those collections.",
                value=pacer.max_pause_ms / 1e3,
            )
        manager = parts.get("model_manager")
        if manager is not None:
            s = manager.status
            info = GaugeMetricFamily(
                "kvwarm_model_info",
                "The model scoring now (value 1).",
                labels=["spec", "name", "alias", "version", "policy", "status"],
            )
            info.add_metric([s.spec, s.name, s.alias, s.version, s.policy, s.status], 1)
            yield info
            yield GaugeMetricFamily(
                "kvwarm_model_degraded",
                "1 while serving the LRU fallback instead of the asked-for model.",
                value=1 if s.degraded else 0,
            )
            yield CounterMetricFamily(
                "kvwarm_model_swaps", "Hot swaps since start.", value=manager.num_swaps
            )
        yield GaugeMetricFamily(
            "kvwarm_lag_seconds",
            "Wall clock minus the newest handled event's timestamp.",
            value=self.metrics.lag_seconds,
        )

    @staticmethod
    def _guard(guard: dict[str, Any]) -> Iterator[Metric]:
        choice = GaugeMetricFamily(
            "kvwarm_guard_choice", "1 for the candidate the guard serves.", labels=["policy"]
        )
        estimate = GaugeMetricFamily(
            "kvwarm_guard_estimated_hit_ratio",
            "Decayed ghost-cache hit ratio of each guard candidate.",
            labels=["policy"],
        )
        for name, value in guard["estimated_hit_ratio"].items():
            choice.add_metric([name], 1 if name == guard["chosen"] else 0)
            estimate.add_metric([name], value)
        yield choice
        yield estimate
        yield CounterMetricFamily(
            "kvwarm_guard_switches", "Guard changes of candidate.", value=guard["switches"]
        )
        served = CounterMetricFamily(
            "kvwarm_guard_served_requests",
            "Requests each guard candidate served since the guard was assembled (start or model swap).",
            labels=["policy"],
        )
        for name, count in guard.get("served_requests", {}).items():
            served.add_metric([name], count)
        yield served

    @staticmethod
    def _source(source: Any) -> Iterator[Metric]:
        try:
            stats = source.stats()
        except Exception:  # a scrape must not fail because a source is closing
            return
        by_reason = stats.get("rejects_by_reason") or stats.get("dead_letters_by_reason") or {}
        rejects = CounterMetricFamily(
            "kvwarm_rejects", "Malformed input, by reason.", labels=["reason"]
        )
        for reason, n in sorted(_copy(by_reason).items()):
            rejects.add_metric([str(reason)], n)
        yield rejects
        backlog = stats.get("lag") or stats.get("backlog_events") or stats.get("num_pending")
        if isinstance(backlog, int):
            yield GaugeMetricFamily(
                "kvwarm_source_backlog_events", "Events known to wait at the source.", value=backlog
            )


class HealthServerError(OSError):
    """The HTTP endpoints cannot listen where asked; the message names the address and
    what to pass instead."""


class _BoundedHTTPServer(HTTPServer):
    """An ``HTTPServer`` whose requests run on a fixed pool of ``num_workers`` threads,
    with at most ``max_pending`` connections accepted and not yet answered; more are
    closed at once (counted in ``num_refused``). With the handler's socket timeout, a
    client that connects and sends nothing holds a worker for ``timeout_s`` at most,
    and 300 such clients hold ``num_workers`` threads, not 300."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        num_workers: int,
        max_pending: int,
    ) -> None:
        # Before binding: a failed bind calls server_close, which shuts the pool down.
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="kvwarm-http-worker")
        self._slots = threading.BoundedSemaphore(max_pending)
        self.num_refused = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Called by ``serve_forever`` for each accepted connection."""
        if not self._slots.acquire(blocking=False):
            self.num_refused += 1
            self.shutdown_request(request)
            return
        self._pool.submit(self._work, request, client_address)

    def _work(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class HealthServer:
    """``/healthz``, ``/readyz``, ``/metrics`` in a daemon thread.

    ``health()`` returns the JSON body of /healthz; ``ready()`` says whether /readyz is
    200. Port 0 picks a free port (``port`` tells which). Bounded: ``num_workers``
    threads answer, ``max_pending`` connections wait at most, and a connection that
    sends no complete request within ``timeout_s`` is dropped.
    """

    def __init__(
        self,
        metrics: SidecarMetrics,
        health: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
        *,
        host: str = "127.0.0.1",
        port: int = 9464,
        posts: Mapping[str, PostHandler] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        timeout_s: float = 5.0,
        num_workers: int = 4,
        max_pending: int = 64,
    ) -> None:
        if not timeout_s > 0 or num_workers < 1 or max_pending < num_workers:
            raise ValueError(
                f"need timeout_s > 0, num_workers >= 1, max_pending >= num_workers; got "
                f"{timeout_s}, {num_workers}, {max_pending}"
            )
        self.metrics = metrics
        handler = _handler(metrics, health, ready, dict(posts or {}), max_body_bytes, timeout_s)
        try:
            self._server = _BoundedHTTPServer(
                (host, port), handler, num_workers=num_workers, max_pending=max_pending
            )
        except OSError as exc:
            raise HealthServerError(
                f"cannot listen for /healthz and /metrics on {host}:{port} ({exc.strerror or exc}); "
                "another process (a second kvwarm serve?) may hold it: pass --http-port N, "
                "--http-port 0 for any free port, or KVWARM_HTTP_ENABLED=false"
            ) from None
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvwarm-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health and metrics on %s", self.url)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(
    metrics: SidecarMetrics,
    health: Callable[[], dict[str, Any]],
    ready: Callable[[], bool],
    posts: dict[str, PostHandler],
    max_body_bytes: int,
    timeout_s: float,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # socket timeout for reading the request and writing the answer

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            route = posts.get(self.path.split("?", 1)[0])
            if route is None:
                self.close_connection = True
                self._json(404, {"error": f"no POST route; try {', '.join(posts) or 'none'}"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self.close_connection = True
                self._json(411, {"error": "Content-Length required (no chunked bodies)"})
                return
            if not 0 <= length <= max_body_bytes:
                self.close_connection = True  # the body is not read: drop the connection
                self._json(413, {"error": f"body of {length} bytes; at most {max_body_bytes}"})
                return
            code, reply = route(self.rfile.read(length))
            self._json(code, reply)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, metrics.text(), CONTENT_TYPE_METRICS)
            elif path == "/healthz":
                self._json(200, health())
            elif path == "/readyz":
                ok = ready()
                self._json(200 if ok else 503, {"ready": ok})
            else:
                self._json(404, {"error": "not found; try /healthz, /readyz or /metrics"})

        def _json(self, code: int, body: dict[str, Any]) -> None:
            self._send(code, json.dumps(body).encode(), "application/json")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("http: " + format, *args)

    return Handler
