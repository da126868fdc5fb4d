"""``kvwarm serve``: the sidecar process, assembled from settings.

``Service(settings)`` wires the pieces; ``run()`` drives them until the source ends or
``stop()`` (SIGTERM/SIGINT in the CLI) is called:

    source (file | kafka | zmq) -> MeteredSource -> Sidecar (policy from ModelManager,
    Planner, Placement) -> DecisionMaker -> sink (executor, file, kafka: fan-out)

At-least-once: ``Sidecar.run`` calls ``flush`` (every sink delivers) before the
source's ``commit``. SIGTERM sets the stop flag; the batch in hand is finished, its
decisions flushed, offsets committed, and the process exits 0. SIGTERM always works:
``ShutdownWatchdog`` notices the signal on a thread of its own (the main thread may be
stuck in a model's native code, where Python signal handlers do not run) and, if the
process has not exited ``SHUTDOWN_GRACE_S`` later, dumps every thread's stack and
exits 1 (what was not committed is delivered again on restart). A crash (SIGKILL)
loses nothing: uncommitted events are delivered again on restart and yield the same
decision ids, which the executor applies once.

Backpressure: the loop takes at most ``batch_size`` events per poll and does not poll
again before they are handled, flushed and committed, so memory is bounded by one
batch; when scoring falls behind, the source (Kafka) simply holds more, and the lag
shows in ``kvwarm_lag_seconds`` and ``kvwarm_source_backlog_events``.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import tomllib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from executor.protocol import Executor
from features.block_hash import load_tokenizer
from features.decoders import TIME_UNITS, TraceFormatError
from features.events import Event
from predictor.base import Policy
from serving.decisions import (
    APPLY_HEADROOM_BLOCKS,
    CacheLayerSink,
    DecisionMaker,
    DecisionSink,
    ExecutorSink,
    FanOutSink,
    NullSink,
    open_sink,
)
from serving.gc_pacer import GcPacer
from serving.http import HealthServer, HealthServerError, SidecarMetrics
from serving.loop import LoopStats, Sidecar, StreamHaltError
from serving.model_lifecycle import ModelManager, ModelStartError
from serving.placement import Placement
from serving.planner import Planner
from serving.request_intake import (
    MAX_REQUEST_BODY_BYTES,
    REQUESTS_PATH,
    IntakeSource,
    RequestIntake,
)
from serving.settings import Endpoint, SidecarSettings, load_settings, mask_credentials
from serving.shards import ShardedState
from serving.sources import EventSource, FileSource, ReportsReadiness

if TYPE_CHECKING:
    from executor.core import Executor as LocalExecutor

log = logging.getLogger(__name__)


SHUTDOWN_GRACE_S = 4.0
"""After SIGTERM/SIGINT, the longest the process waits for the loop to finish its batch
before it is ended regardless (within the 5 s a supervisor is promised)."""


class ShutdownWatchdog:
    """Makes SIGTERM and SIGINT end the process within ``grace_s`` in every state.

    ``install()`` (main thread) routes both signals to ``stop`` twice over: the Python
    handler (runs when the main thread executes Python) and a wakeup fd read by a daemon
    thread (runs even while the main thread is stuck in native scoring code). Either
    path arms ``faulthandler.dump_traceback_later(grace_s, exit=True)``, a C timer that
    needs no interpreter lock, as the last resort.
    """

    def __init__(self, stop: Callable[[], None], grace_s: float = SHUTDOWN_GRACE_S) -> None:
        self.stop = stop
        self.grace_s = grace_s
        self.signum: int | None = None
        self._lock = threading.Lock()

    def install(self) -> ShutdownWatchdog:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)  # kept alive with the watchdog
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

        def watch() -> None:
            while True:
                try:
                    data = reader.recv(64)
                except OSError:
                    return
                if not data:
                    return
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self.trigger(signum)

        threading.Thread(target=watch, name="kvwarm-shutdown-watchdog", daemon=True).start()
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.trigger(signum)

    def trigger(self, signum: int) -> None:
        """Ask the loop to stop; arm the forced exit. Idempotent; any thread."""
        with self._lock:
            if self.signum is not None:
                return
            self.signum = signum
        log.info(
            "signal %d: finishing the batch in hand, then exiting (forced after %g s)",
            signum,
            self.grace_s,
        )
        faulthandler.dump_traceback_later(self.grace_s, exit=True)
        self.stop()

    def disarm(self) -> None:
        """The process is exiting on its own: cancel the forced exit."""
        faulthandler.cancel_dump_traceback_later()


def wall_ms() -> int:
    return int(time.time() * 1000)


class MeteredSource:
    """Wraps an ``EventSource``: remembers when the current batch was polled (for the
    event-to-decision latency), how many events it held, and the newest event time.

    It also sizes batches: each poll asks for at most ``cap`` events, where ``cap`` is
    the number of events the measured cost per event (handling, smoothed) fits in
    ``target_batch_latency_ms``, between 1 and the loop's ``batch_size``. A slower
    model gives smaller batches, so latency stays near the target while the backlog
    waits at the source (Kafka), not in memory here. The sink's flush is paid once per
    batch whatever its size, so it is not counted per event (``delivered(flush_s)``):
    counted, a batch of one or two events (what a poll holds at a moderate rate)
    charged each event a whole flush (2-3 ms through Kafka) and the cap fell to 1-4
    for LightGBM, so a backlog drained a few events per flush.

    Behind, a batch grows past the cap: a poll that came back full (``cap`` events,
    so more are likely waiting) doubles what the next one asks for, up to
    ``MAX_CATCH_UP`` times the cap (and ``batch_size``), until one comes back short.
    Events waiting at the source gain nothing from small batches (they wait there
    instead), while each batch pays the sink's flush and the commit (~5 ms through
    Kafka), so a backlog drains in fewer, larger batches (``bench serve`` open loop
    through Kafka, LightGBM at 170 events/s: p99 48-85 ms, 94-460 ms without). Bounded,
    so a source that is always behind (a file at saturation) gets batches of at most
    4x the target (its poll-to-delivery p50 went from ~20 to ~80 ms).
    """

    MAX_CATCH_UP = 4

    def __init__(
        self,
        inner: EventSource,
        metrics: SidecarMetrics,
        target_batch_latency_ms: float = 20.0,
        *,
        wall_clock_lag: bool = True,
    ) -> None:
        self.inner = inner
        self.metrics = metrics
        self.target_s = target_batch_latency_ms / 1000
        # Lag = wall clock - newest event ts: meaningful when producers stamp events with
        # wall-clock ms; on the event clock (replaying a trace) there is no lag by definition.
        self.wall_clock_lag = wall_clock_lag
        self.cap = 16
        self._max_events = 1
        self.cost_per_event_s = 0.0
        self.polled_at_s = 0.0
        self.num_unflushed = 0
        self.newest_ts_ms = 0
        self.num_polls = 0
        self.catch_up = 1
        """Factor on ``cap`` while polls come back full (a backlog), else 1."""
        self.latencies: deque[tuple[float, int]] = deque(maxlen=100_000)
        """(seconds, events) per delivered batch, newest last (benchmarks read it)."""

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted

    def poll(self, max_events: int, timeout_ms: int) -> list[Event]:
        self._max_events = max(1, max_events)
        asked = min(self._max_events, self.cap * self.catch_up)
        events = self.inner.poll(asked, timeout_ms)
        self.num_polls += 1
        if len(events) >= asked and asked < self._max_events:
            self.catch_up = min(2 * self.catch_up, self.MAX_CATCH_UP)
        elif len(events) < asked:
            self.catch_up = 1
        if events:
            if not self.num_unflushed:
                self.polled_at_s = time.perf_counter()
            self.num_unflushed += len(events)
            self.newest_ts_ms = max(self.newest_ts_ms, events[-1].ts_ms)
            if self.wall_clock_lag:
                self.metrics.lag_seconds = max(0.0, (wall_ms() - self.newest_ts_ms) / 1000)
        return events

    def delivered(self, flush_s: float = 0.0) -> float:
        """The batch's decisions are delivered (the sink's flush took ``flush_s`` of it):
        observe its latency, return it (s)."""
        latency = time.perf_counter() - self.polled_at_s
        n = self.num_unflushed
        if n:
            self.metrics.observe_batch_latency(latency, n)
            self.latencies.append((latency, n))
            cost = max(latency - flush_s, 0.0) / n
            self.cost_per_event_s = (
                cost if not self.cost_per_event_s else 0.8 * self.cost_per_event_s + 0.2 * cost
            )
            fit = int(self.target_s / self.cost_per_event_s) if self.cost_per_event_s else self.cap
            self.cap = max(1, min(fit, self._max_events))
        self.num_unflushed = 0
        return latency

    @property
    def ready(self) -> bool:
        """The inner source's readiness when it reports one, else True."""
        return self.inner.ready if isinstance(self.inner, ReportsReadiness) else True

    def commit(self) -> None:
        self.inner.commit()

    def dead_letter(self, event: Event, reason: str, error: str) -> None:
        self.inner.dead_letter(event, reason, error)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()


class MeteredSidecar(Sidecar):
    """The sidecar with each ``score`` call observed in the scoring histogram."""

    observe_score: Callable[[float], None] | None = None
    """Called with the seconds each score call took (the scoring histogram)."""

    wrap_policy: Callable[[Policy], Policy] | None = None
    """Applied to every policy swapped in (the online guard around a learned model)."""

    def swap_policy(self, policy: Policy) -> None:
        super().swap_policy(self.wrap_policy(policy) if self.wrap_policy else policy)

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = super().score(block_hashes, now_ms)
        if self.observe_score is not None:
            self.observe_score(time.perf_counter() - t0)
        return out


def open_source(settings: SidecarSettings) -> EventSource:
    ep = settings.source_endpoint
    if ep.scheme == "file":
        return FileSource(
            ep.target, rejects_path=settings.rejects_path, time_unit=settings.time_unit
        )
    if ep.scheme == "kafka":
        from serving.kafka_io import KafkaEventSource

        return KafkaEventSource(
            ep.target,
            ep.topic,
            group_id=settings.kafka_group_id,
            group_instance_id=settings.kafka_group_instance_id,
            dead_letter_topic=settings.kafka_dead_letter_topic,
            commit_interval_ms=settings.kafka_commit_interval_ms,
        )
    if ep.scheme == "zmq":
        from serving.zmq_source import ZmqEventSource

        return ZmqEventSource.from_url(ep.target, rejects_path=settings.rejects_path)
    raise click.UsageError(f"unsupported source {settings.source!r}")


def load_local_executor(path: str | Path, clock_ms: Callable[[], float]) -> LocalExecutor:
    """The real executor from a TOML file::

        [executor]            # ExecutorParams fields (state_dir, fsync_journal, ...)
        state_dir = "state"
        [[tiers]]             # fastest first; kind + name + the tier's Params fields
        kind = "memory"
        name = "hbm"
        capacity_bytes = 1048576

    Relative paths (``state_dir``, a tier's ``root``) are relative to the file.
    """
    from executor.core import Executor as LocalExecutor
    from executor.core import ExecutorParams
    from executor.tiers import make_tier

    path = Path(path)
    try:
        config = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.UsageError(f"executor config {path}: {exc}") from exc
    base = path.parent

    def rel(value: Any) -> Any:
        return (
            str(base / value) if isinstance(value, str) and not Path(value).is_absolute() else value
        )

    tiers = []
    for entry in config.get("tiers", []):
        entry = dict(entry)
        kind, name = entry.pop("kind", None), entry.pop("name", None)
        if not kind or not name:
            raise click.UsageError(f"executor config {path}: every [[tiers]] needs kind and name")
        if "root" in entry:
            entry["root"] = rel(entry["root"])
        tiers.append(make_tier(kind, name, entry))
    if not tiers:
        raise click.UsageError(f"executor config {path}: no [[tiers]] given")
    params = dict(config.get("executor", {}))
    if "state_dir" in params:
        params["state_dir"] = rel(params["state_dir"])
    known = set(ExecutorParams.__dataclass_fields__)
    unknown = sorted(set(params) - known)
    if unknown:
        raise click.UsageError(
            f"executor config {path}: unknown [executor] key {unknown[0]!r}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    return LocalExecutor(tiers, ExecutorParams(**params), clock_ms=clock_ms)


MAX_WALL_CLOCK_SKEW_MS = 24 * 3_600_000
"""With ``--clock wall``, events stamped further than this from the wall clock are
refused: their features would be out of any range the model was trained on."""


class ServeError(RuntimeError):
    """The sidecar cannot start or go on; the message says what is wrong and what to
    do (the CLI prints it as one line and exits 1)."""


class ClockMismatchError(ServeError, StreamHaltError):
    """``--clock wall`` with events stamped far from the wall clock: the whole stream is
    on another clock, so serving stops (no event is dead-lettered for it)."""


class Service:
    """The assembled sidecar. Build, ``start()`` (HTTP, model polling), ``run()``,
    ``close()``. ``stop()`` is safe from a signal handler or another thread."""

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        source: EventSource | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        self.gc_pacer = GcPacer(
            idle_interval_s=min(2.0, settings.gc_max_interval_s),
            max_interval_s=settings.gc_max_interval_s,
        )
        self._stop = stop or threading.Event()
        self._ready = False
        self.now_ms = 0
        self.clock: Callable[[], int] | None = wall_ms if settings.clock == "wall" else None
        if settings.mlflow_tracking_token is not None:
            # MLflow's client reads its bearer token from this variable only.
            os.environ["MLFLOW_TRACKING_TOKEN"] = settings.mlflow_tracking_token.get_secret_value()

        self.models = ModelManager(
            settings.model,
            tracking_uri=settings.mlflow_tracking_uri,
            score_max_age_ms=settings.score_max_age_ms,
        )
        try:
            policy = self.models.load_initial(fallback=settings.model_fallback == "lru")
        except ModelStartError as exc:
            raise ServeError(str(exc)) from None

        self.executor: Executor | None = None
        self.cache_layer: Any = None
        """An executor over a real cache layer (``--executor lmcache:...``)."""
        self._store_bytes = settings.block_size_bytes
        self._profile: Any = None
        """The simulated executor's timing profile (``sim:``), None otherwise."""
        self._wall_checked = False
        tier_names, capacities = self._tiers()
        self.placement = Placement(list(tier_names), list(capacities))
        self.sidecar = MeteredSidecar(
            self._guarded(policy),
            Planner(settings.planner),
            self.placement,
            prefetch_interval_ms=settings.prefetch_interval_ms,
            recent_requests=settings.recent_requests,
            prefetch=settings.prefetch,
            # Per-partition state switches shards between events: a round runs inline.
            prefetch_split=settings.prefetch_split and settings.state_topic is None,
        )
        self.sidecar.observe_score = self.metrics.scoring_seconds.observe
        if settings.executor_endpoint.scheme == "sim":
            # The simulated links' prefetch budget, asked by the planner (as in replay).
            from executor.sim import SimulatedExecutor

            assert isinstance(self.executor, SimulatedExecutor)
            self.sidecar.prefetch_admit = self.executor.admit_prefetch
        self.sidecar.wrap_policy = self._guarded
        self.models.attach(self.sidecar)

        sinks: list[DecisionSink] = []
        self.executor_sink: ExecutorSink | None = None
        if self.executor is not None:
            self.executor_sink = ExecutorSink(self.executor, block_size_bytes=self._store_bytes)
            sinks.append(self.executor_sink)
        if self.cache_layer is not None:
            sinks.append(CacheLayerSink(self.cache_layer))
        for endpoint in settings.decision_endpoints:
            sinks.append(
                open_sink(
                    endpoint,
                    decision_format=settings.decisions_format,
                    ack_topic=settings.decisions_ack_topic,
                )
            )
        self._ack_sinks = [s for s in sinks if hasattr(s, "acks")]
        self.sink: DecisionSink = (
            NullSink() if not sinks else sinks[0] if len(sinks) == 1 else FanOutSink(sinks)
        )
        self.decisions = DecisionMaker(
            tier_names,
            self.sink,
            self.models.model_info,
            deadline_ms=settings.decision_deadline_ms,
            # An executor here stands in for the engine: it stores computed blocks too.
            on_store=self.executor_sink.place_store if self.executor_sink is not None else None,
            placement=self.placement,
        )
        self.sidecar.hooks.append(self._track_now)
        self.sidecar.hooks.append(self._index_tokens)
        self.sidecar.hooks.append(self.decisions)

        self.intake: RequestIntake | None = None
        inner = source or open_source(settings)
        known = getattr(inner, "engine_ids", None)  # a ZMQ source names its engines
        if settings.engine_id is not None and known and settings.engine_id not in known:
            inner.close()
            raise click.UsageError(
                f"--engine-id {settings.engine_id} names no engine of the source "
                f"({', '.join(known)}); add engine={settings.engine_id} to the zmq:// URL"
            )
        if settings.http_enabled and settings.request_intake and settings.state_topic is None:
            # (With --state-topic every event belongs to a partition's shard; requests
            # posted over HTTP would belong to none, so the intake is off.)
            self.intake = RequestIntake(
                tokenize=load_tokenizer(settings.tokenizer_path)
                if settings.tokenizer_path
                else None
            )
        if self.intake is not None or settings.engine_id is not None:
            inner = IntakeSource(
                self.intake or RequestIntake(max_pending=0), inner, engine_id=settings.engine_id
            )
        self.source = MeteredSource(
            inner,
            self.metrics,
            settings.target_batch_latency_ms,
            wall_clock_lag=settings.clock == "wall",
        )
        self.metrics.bind(
            sidecar=self.sidecar,
            source=self.source,
            decision_maker=self.decisions,
            executor_sink=self.executor_sink,
            model_manager=self.models,
            acks=self.acks,
            gc_pacer=self.gc_pacer if self.gc_pacer.paced else None,
        )
        self.http: HealthServer | None = None
        self._wall_checked = False
        self.shards: ShardedState | None = None
        self._kafka: Any = None
        if settings.state_topic is not None:
            self._shard_state(inner)

    # -- state per partition -----------------------------------------------------------------
    def _shard_state(self, inner: EventSource) -> None:
        """``--state-topic``: one shard of state per Kafka partition, checkpointed to a
        compacted topic and restored on restart or rebalance (``serving.shards``)."""
        from serving.checkpoint import (
            NotCheckpointableError,
            check_checkpointable,
            policy_signature,
        )
        from serving.kafka_io import KafkaChangelog, KafkaEventSource
        from serving.state_store import StateStore

        s = self.settings
        if not isinstance(inner, KafkaEventSource):
            inner.close()
            raise ServeError(
                f"--state-topic {s.state_topic}: state is kept per Kafka partition, so it needs "
                "a kafka: source (and no --engine-id filter or request intake in front of it); "
                "drop --state-topic for a file or ZMQ source"
            )
        try:
            check_checkpointable(self.sidecar.policy)
        except NotCheckpointableError as exc:
            inner.close()
            raise ServeError(f"--state-topic: policy {self.sidecar.policy.name}: {exc}") from None
        assert s.state_topic is not None
        store = StateStore(KafkaChangelog(inner.bootstrap, s.state_topic))
        fingerprint = {
            "tiers": list(self.placement.tier_names),
            "capacities": list(self.placement.capacities),
            "planner": s.planner.model_dump(mode="json"),
            "recent_requests": s.recent_requests,
            "prefetch": [s.prefetch, s.prefetch_interval_ms],
            "policy": policy_signature(self.sidecar.policy),
        }
        self.shards = ShardedState(
            self.sidecar,
            self.decisions,
            store,
            planner_params=s.planner,
            fingerprint=fingerprint,
            interval_s=s.state_checkpoint_interval_s,
        )
        # Hot swaps now reach every shard (the warm-up hook ModelManager.attach added
        # to the sidecar stays: shards share the sidecar's hooks).
        self.models.sidecar = self.shards
        group = inner.group_id
        self._kafka = inner

        def key(tp: Any) -> str:
            return f"{group}/{tp.topic}/{tp.partition}"

        def positions() -> dict[str, tuple[int, int]]:
            return {key(tp): pos for tp, pos in inner.positions().items()}

        def revoked(tps: set[Any]) -> None:
            assert self.shards is not None
            self.shards.on_revoked([key(tp) for tp in tps], positions())

        def assigned(tps: set[Any]) -> dict[Any, tuple[int, int]]:
            assert self.shards is not None
            by_key = {key(tp): tp for tp in tps}
            seek = self.shards.on_assigned(sorted(by_key))
            return {by_key[k]: pos for k, pos in seek.items()}

        inner.on_revoked, inner.on_assigned = revoked, assigned
        self._positions = positions
        self._partition_key = key

    def _route(self, i: int) -> None:
        """Switch the shard of the ``i``-th event of the batch in hand into the sidecar."""
        assert self.shards is not None
        self.shards.activate(self._partition_key(self._kafka.polled_partitions[i]))

    # -- assembly ------------------------------------------------------------------------
    def _tiers(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        s = self.settings
        ep: Endpoint = s.executor_endpoint
        if ep.scheme == "sim":
            from executor.sim import SimulatedExecutor, load_profile
            from executor.sim.profile import ProfileError

            try:
                profile = load_profile(None if ep.target == "default" else ep.target)
            except (OSError, UnicodeDecodeError, ProfileError) as exc:
                raise ServeError(
                    f"--executor sim:{ep.target}: cannot read the profile "
                    f"({getattr(exc, 'strerror', None) or exc}); pass sim:default for the "
                    "bundled profile or sim:PATH.toml of an existing profile"
                ) from None
            caps = s.tier_capacities_blocks
            # The planner alone picks victims (on_full="refuse"); the executor's tiers
            # get the headroom that lets every round's moves be ordered to fit.
            sim = SimulatedExecutor(
                profile,
                tiers=s.tier_names,
                capacity_blocks={
                    name: cap + APPLY_HEADROOM_BLOCKS
                    for name, cap in zip(s.tier_names, caps, strict=True)
                },
            )
            self.executor, self._store_bytes = sim, sim.block_bytes
            self._profile = profile
            return s.tier_names, caps
        if ep.scheme == "local":
            local = load_local_executor(ep.target, self._now_for_executor)
            self.executor, self._store_bytes = local, s.block_size_bytes
            names = tuple(local.tier_names)
            caps = tuple(
                max(1, local.tier(n).capacity_bytes // s.block_size_bytes - APPLY_HEADROOM_BLOCKS)
                for n in names
            )
            return names, caps
        if ep.scheme == "lmcache":
            from executor.adapters.lmcache import LMCacheExecutor, params_from_url

            self.cache_layer = LMCacheExecutor(params_from_url(ep.target))
        return s.tier_names, s.tier_capacities_blocks

    def _index_tokens(self, event: Any, moves: Any, now_ms: int) -> None:
        """Sidecar hook (before the decisions hook): a request's token ids, for the
        cache layer that names blocks by tokens."""
        if self.cache_layer is not None and event is not None and event.token_ids:
            self.cache_layer.tokens.record(
                event.block_hashes, event.token_ids, event.block_size_tokens
            )

    def acks(self) -> dict[str, int]:
        """Acknowledgements counted by every sink that reads them, by status."""
        total: dict[str, int] = {}
        for sink in self._ack_sinks:
            for status, n in dict(sink.acks).items():
                total[status] = total.get(status, 0) + n
        return total

    def _guarded(self, policy: Policy) -> Policy:
        """A learned model behind the online guard, estimating at the fastest tier's
        size and at that of the memory tiers together (``predictor.guard.
        memory_capacity_blocks``), the two weighed by the load time a hit saves
        (``profile_outer_weight``: the simulated executor's profile, else the bundled
        one), when ``settings.guard``; baselines unchanged."""
        if not (self.settings.guard and policy.outputs_probability):
            return policy
        from predictor.guard import guarded, memory_capacity_blocks, profile_outer_weight

        placement = self.placement
        return guarded(
            policy,
            placement.capacities[0],
            outer_capacity_blocks=memory_capacity_blocks(
                placement.tier_names, placement.capacities
            ),
            outer_weight=profile_outer_weight(placement.tier_names, self._profile),
        )

    def _now_for_executor(self) -> float:
        return float(self.now_ms if self.clock is None else wall_ms())

    def _track_now(self, event: Any, moves: Any, now_ms: int) -> None:
        self.now_ms = now_ms

    def _flush(self) -> None:
        t0 = time.perf_counter()
        self.sink.flush()
        flush_s = time.perf_counter() - t0
        if self.shards is not None:  # decisions delivered, then state, then offsets
            self.shards.checkpoint(self._positions())
        self.source.delivered(flush_s)

    # -- health --------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        s = self.models.status
        return {
            "status": s.status,
            "reason": s.reason,
            "model": s.spec,
            "model_name": s.name,
            "model_alias": s.alias,
            "policy": s.policy,
            "model_version": s.version,
            "last_reload_error": s.last_error,
            **self.sidecar.policy.online_status(),
            **(
                {"prefetch_gate": self.sidecar.prefetch_gate.status()}
                if self.sidecar.prefetch_gate is not None
                else {}
            ),
            **({"gc": self.gc_pacer.status()} if self.gc_pacer.paced else {}),
        }

    def ready(self) -> bool:
        """/readyz: the loop runs and the source can deliver (a ZMQ source: an engine
        is connected)."""
        return self._ready and not self._stop.is_set() and self.source.ready

    # -- running -------------------------------------------------------------------------
    def start(self) -> Service:
        s = self.settings
        if s.http_enabled:
            posts = {REQUESTS_PATH: self.intake.submit} if self.intake is not None else {}
            self.http = HealthServer(
                self.metrics,
                self.health,
                self.ready,
                host=s.http_host,
                port=s.http_port,
                posts=posts,
                max_body_bytes=MAX_REQUEST_BODY_BYTES,
            ).start()
        self.models.start_polling(s.model_poll_interval_s)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _check_wall_clock(self, event: Any, moves: Any, now_ms: int) -> None:
        """First request on the wall clock: its timestamp must be near the wall clock."""
        if event is None or self._wall_checked:
            return
        self._wall_checked = True
        skew_ms = wall_ms() - event.ts_ms
        if abs(skew_ms) > MAX_WALL_CLOCK_SKEW_MS:
            self.stop()
            raise ClockMismatchError(
                f"--clock wall, but event {event.request_id!r} is stamped {event.ts_ms} ms, "
                f"{skew_ms / 86_400_000:,.1f} days from the wall clock: its features would be "
                "out of range; serve with --clock event (the default) or produce with --restamp"
            )

    def run(self, max_events: int | None = None) -> LoopStats:
        s = self.settings
        # What is alive once serving starts (imported libraries, the model, the
        # settings: ~48,000 objects) is frozen out of the collector's walks, and full
        # collections run between batches, at idle moments first (serving.gc_pacer):
        # left to CPython, each walked all of serving's state, 84-223 ms stalls.
        # Without pacing, the freeze alone (as before). ``close`` undoes both.
        self.gc_pacer.start()
        self._ready = True
        if s.clock == "wall" and self._check_wall_clock not in self.sidecar.hooks:
            self._wall_checked = False
            self.sidecar.hooks.insert(0, self._check_wall_clock)
        return self.sidecar.run(
            self.source,
            clock=self.clock,
            stop=self._stop,
            batch_size=s.batch_size,
            poll_timeout_ms=s.poll_timeout_ms,
            flush=self._flush,
            max_events=max_events,
            route=self._route if self.shards is not None else None,
            gc_pacer=self.gc_pacer,
        )

    def close(self) -> None:
        """Flush what is left, then release everything (safe to call twice)."""
        self._ready = False
        self.gc_pacer.stop()  # the collector as it was, frozen objects collectable
        self.models.stop()
        if self.shards is not None:
            self.shards.close()
        try:
            self.sink.close()
        finally:
            self.source.close()
            if self.http is not None:
                self.http.close()
                self.http = None


@click.command("serve")
@click.option(
    "--source",
    help="kafka:TOPIC (local broker) | kafka://HOST:PORT/TOPIC | file:PATH | zmq://HOST:PORT[?...] "
    "[default: kafka:kv-events]",
)
@click.option("--model", help="lru | saved policy dir or model file | models:/NAME@ALIAS")
@click.option(
    "--fallback",
    "model_fallback",
    type=click.Choice(["none", "lru"]),
    help="If the model cannot be loaded at start: none (exit 1, default) or lru (serve LRU, "
    "/healthz degraded).",
)
@click.option(
    "--executor",
    help="local:CONFIG.toml | sim:PROFILE | lmcache:http://HOST:PORT?instance=ID&model=NAME | none",
)
@click.option(
    "--decisions",
    multiple=True,
    help="Also publish decisions here: kafka:TOPIC | kafka://HOST:PORT/TOPIC | file:PATH "
    "(repeatable).",
)
@click.option(
    "--decisions-format",
    type=click.Choice(["native", "kvhints"]),
    help="Records on every decisions sink: native decision JSON or KV hint envelopes.",
)
@click.option("--engine-id", help="Serve this engine only (events naming others are dropped).")
@click.option(
    "--state-topic",
    help="Kafka source: keep state per partition and checkpoint it to this compacted topic, "
    "so restarts and rebalances resume with the same state and decision ids (default off).",
)
@click.option(
    "--state-checkpoint-s",
    "state_checkpoint_interval_s",
    type=click.FloatRange(0, 86_400),
    help="Least seconds between two checkpoints of one partition (default 30; 0: every commit).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="TOML/YAML settings file (also KVWARM_CONFIG). Flags > KVWARM_* env > file.",
)
@click.option(
    "--guard/--no-guard",
    default=None,
    help="Serve a learned model behind the online guard (default on; KVWARM_GUARD).",
)
@click.option("--http-host", help="Address of /healthz, /readyz, /metrics (default 127.0.0.1).")
@click.option(
    "--http-port",
    type=click.IntRange(0, 65535),
    help="Port of the HTTP endpoints (default 9464; 0: any free port, printed at start).",
)
@click.option(
    "--clock",
    type=click.Choice(["event", "wall"]),
    help="Time for features and timers: event (default; the events' own timestamps) or "
    "wall (events must be stamped with the wall clock, e.g. produce --restamp).",
)
@click.option(
    "--time-unit",
    type=click.Choice(TIME_UNITS),
    help="Unit of a file source's timestamps (default auto: by magnitude).",
)
@click.option(
    "--batch-size", type=click.IntRange(1), help="Most events between two flush+commit points."
)
@click.option(
    "--model-poll-s", "model_poll_interval_s", type=click.FloatRange(0), help="Alias poll interval."
)
@click.option(
    "--max-events",
    type=click.IntRange(1),
    default=None,
    help="Exit 0 after handling this many events (default: until the source ends or SIGTERM).",
)
@click.option(
    "--print-settings", is_flag=True, help="Print the effective settings as JSON and exit."
)
def serve(
    config_path: str | None, print_settings: bool, max_events: int | None, **flags: Any
) -> None:
    """Run the sidecar: events in, promote/demote decisions out.

    Every setting can also come from KVWARM_<NAME> variables or a config file; see
    serving/settings.py. SIGTERM finishes the batch in hand, delivers its decisions,
    commits the source's offsets and exits 0.
    """
    from pydantic import ValidationError

    flags["decisions"] = tuple(flags["decisions"]) or None
    try:
        settings = load_settings(config_path, **flags)
    except ValidationError as exc:
        raise click.UsageError(_validation_message(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if print_settings:  # secrets print as '**********', URI credentials as '***@'
        click.echo(json.dumps(mask_credentials(settings.model_dump(mode="json")), indent=2))
        return
    # Signals first: a SIGTERM while the model loads or the broker connects must count.
    stop_requested = threading.Event()
    watchdog = ShutdownWatchdog(stop_requested.set).install()
    try:
        service = Service(settings, stop=stop_requested)
    except (ServeError, TraceFormatError, ConnectionError, OSError) as exc:
        # ConnectionError: KafkaUnavailableError (a one-line message naming the address);
        # OSError: HealthServerError, a rejects file that cannot be written.
        watchdog.disarm()
        raise click.ClickException(_one_line(exc)) from None
    try:
        service.start()
    except HealthServerError as exc:
        service.close()
        watchdog.disarm()
        raise click.ClickException(str(exc)) from None
    service.models.start_watchdog()
    if service.http is not None:
        click.echo(f"kvwarm serve: health and metrics on {service.http.url}", err=True)
    status = service.models.status
    click.echo(
        f"kvwarm serve: model {status.policy} {status.version} ({status.status}"
        f"{': ' + status.reason if status.reason else ''}), {settings.clock} clock",
        err=True,
    )
    try:
        stats = service.run(max_events=max_events)
    except ServeError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        service.close()
        watchdog.disarm()
    click.echo(
        f"kvwarm serve: {stats.events} events, {stats.block_accesses} block accesses, "
        f"{service.decisions.num_decisions} decisions",
        err=True,
    )
    sys.stdout.flush()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        text = f"{exc.filename}: {exc.strerror}"
    return text.splitlines()[0] if text else type(exc).__name__


def _validation_message(exc: Any) -> str:
    """One line from a pydantic ``ValidationError``: the first error, its field and input."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "settings"
    message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"setting {where}: {message}" + (
        f" (got {err['input']!r:.80})"
        if "input" in err and not isinstance(err["input"], dict)
        else ""
    )
