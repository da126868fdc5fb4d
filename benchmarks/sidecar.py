"""``kvwarm bench serve``: sidecar throughput and event-to-decision latency.

Runs the whole ``kvwarm serve`` assembly (``serving.serve_cli.Service``) in this
process over a generated trace, once with LRU, once with the learned model as
``kvwarm serve`` runs it (behind the online guard) and once with the model alone
(``kvwarm serve --no-guard``: every request scored by the model), and prints block
accesses per second plus p50/p99 event-to-decision latency (poll -> decisions
delivered by the sink), each run as a ratio of the LRU run. Under the table: how many
requests each guard candidate served. On the default workload the guard serves LRU
nearly throughout, so the "learned" run measures the guard's ghosts around LRU, and
"model (no guard)" the model's own path (2026-12-07, from a file, a saved model of
this bench, alone: the model alone 16,463 block accesses/s, 0.39x LRU's 42,274; behind
the guard 32,982, 0.78x, the guard serving LRU for all 5,000 requests).
Then the same through Kafka when a broker answers (``--kafka HOST:PORT``, default
``$KVWARM_KAFKA_BOOTSTRAP``): events are produced into a fresh topic first, then
consumed by the sidecar, which publishes its decisions to a second topic.

Without ``--model`` a LightGBM model is trained here on the first third of the trace
(``training.train``, imported lazily: this is a benchmark, not the serving path).
``--profile-out FILE`` writes a cProfile of the learned file-source run.

Open loop (``--rates``): saturation says nothing about latency, since at saturation
every event waits for the backlog ahead of it. So each policy is also driven from the
same events released at offered rates (fractions of that policy's maximum as a live
stream, by wall clock, ``PacedSource``), and each event's latency is counted from its
arrival (when it became available at the source) to the commit after its decisions
were delivered: queueing, batching, scoring and the sink's flush included. Through
Kafka the offsets themselves reach the broker at most every ``kafka_commit_interval_ms``
(100 ms by default, as ``kvwarm serve`` runs; ``serving.kafka_io.KafkaEventSource``): an
event's decisions are delivered at that commit, its offset may go with a later one.

A live stream's event time passes as its events arrive, so the open loop's events are
paced (``paced``): their timestamps are rescaled, order and relative spacing kept, so
that event time passes at the offered rate, and the sidecar's event-time timers fire as
often per event as they would live (a prefetch round every second, a stored score kept
10 s). Released faster than they were stamped, the bench trace's events (5,000 requests
over 29 minutes) put a prefetch round on every third event at half LightGBM's maximum,
78 times as many per event as at that rate live: from a file, 59-66% busy and p99
26.4-30.5 ms against 34-44% and 8.6-12.8 ms paced (two runs each, 2026-12-04). The
maximum the rates are fractions of is that of a live stream too: the same events paced
to the saturated run's rate, handled as fast as they come (``live_maximum``; through
Kafka, produced to a topic of their own first). The saturated runs themselves (the
throughput rows) serve the trace file on its own time, as ``kvwarm serve --source
file:`` replays a log.

Each open loop row also says where the loop's time went (``serving.loop.LOOP_PHASES``):
how busy it was (wall time outside the source's poll), events per batch, and
milliseconds per batch handling the events against delivering the decisions and
committing the offsets. The saturated runs poll full batches, which spread a batch's
delivery and commit (a broker round trip each through Kafka) over ~1,000 events; at
half that rate a batch holds a few events, so the open loop is busier than half. The
commit interval takes the commit's round trip off most batches (1.2-1.5 ms of the
2.6-3.2 ms a batch spent delivering and committing, 2026-12-05).

Each open-loop rate runs ``--repeat`` times (3 by default) and prints the run whose p99
is the median, with the range of the runs' p99s beside it: one run says little. What
makes the tail (2026-12-04, each event's handling timed, events unpaced at half
LightGBM's maximum from a file): the 13-17% of events handled in over 5 ms are the big
requests (77 blocks on average against 29, 208 moves against 63), which also carry most
eviction rounds (0.49 of the fastest tier's and 0.32 of the next one's per event,
against 0.13 and 0.005) and prefetch steps; a few of them in a row queue the events
behind them. Sampled stacks of those events show no other work: no garbage collection,
no thread of the process. Two runs of the same code gave p99 70.7 and 22.8 ms.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
import numpy as np

from serving.loop import LoopStats
from serving.serve_cli import Service
from serving.settings import load_settings


@dataclass
class RunResult:
    label: str
    block_accesses: int
    events: int
    decisions: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    score_s: float
    served: dict[str, int] | None = None
    """Requests each guard candidate served (None: no guard): a learned run's figures
    are the model's only as far as the model served."""

    @property
    def accesses_per_s(self) -> float:
        return self.block_accesses / self.elapsed_s if self.elapsed_s > 0 else 0.0


def weighted_percentiles(samples: list[tuple[float, int]], qs: tuple[float, ...]) -> list[float]:
    """Percentiles of values each repeated ``count`` times (batch latencies)."""
    if not samples:
        return [float("nan")] * len(qs)
    values = np.array([v for v, _ in samples])
    counts = np.array([c for _, c in samples], dtype=np.int64)
    order = np.argsort(values)
    values, cum = values[order], np.cumsum(counts[order])
    return [float(values[np.searchsorted(cum, q / 100 * cum[-1])]) for q in qs]


def train_model(trace: Path, out_dir: Path, num_requests: int) -> Path:
    """A LightGBM policy fitted (full training parameters, early stopping) on the first
    third of ``trace`` by ``training.train``, saved to ``out_dir``."""
    from features.decoders import read_trace
    from training.train import fit_policy_on_events

    events = list(read_trace(trace))[: max(300, num_requests // 3)]
    policy = fit_policy_on_events("lightgbm", events, seed=0, quick=False)  # type: ignore[arg-type]
    return policy.save(out_dir)


STALL_S = 120.0
"""A run that handles no event for this long is stopped (a consumer that never got
its partitions would otherwise hang the benchmark)."""


def _watchdog(service: Service, stall_s: float) -> threading.Event:
    done = threading.Event()

    def watch() -> None:
        last = -1
        while not done.wait(stall_s):
            now = service.sidecar.stats.events
            if now == last:
                service.stop()
                return
            last = now

    threading.Thread(target=watch, name="bench-watchdog", daemon=True).start()
    return done


def run_once(
    label: str, settings_kwargs: dict[str, Any], profile_to: Path | None = None
) -> RunResult:
    settings_kwargs = dict(settings_kwargs)
    max_events = settings_kwargs.pop("_max_events", None)
    settings = load_settings(None, **settings_kwargs)
    service = Service(settings)
    stop_watchdog = _watchdog(service, STALL_S)
    try:
        t0 = time.perf_counter()
        if profile_to is not None:
            profiler = cProfile.Profile()
            profiler.enable()
        stats = service.run(max_events=max_events)
        if profile_to is not None:
            profiler.disable()
            profiler.dump_stats(str(profile_to))
        elapsed = time.perf_counter() - t0
    finally:
        stop_watchdog.set()
        service.close()
    if max_events is not None and stats.events < max_events:
        click.echo(f"{label}: stalled after {stats.events} of {max_events} events (no progress "
                   f"for {STALL_S:.0f} s); figures cover what was handled", err=True)  # fmt: skip
    p50, p99 = weighted_percentiles(list(service.source.latencies), (50, 99))
    guard = service.health().get("guard") or {}
    return RunResult(
        label,
        stats.block_accesses,
        stats.events,
        service.decisions.num_decisions,
        elapsed,
        p50 * 1000,
        p99 * 1000,
        stats.score_seconds,
        guard.get("served_requests"),
    )


def paced(events: list[Any], rate_events_per_s: float) -> list[Any]:
    """``events`` with their timestamps rescaled (``training.replay.rescale_time``: order
    and relative spacing kept) so that event time passes at ``rate_events_per_s`` events
    a second on average, as a live stream arriving at that rate is stamped."""
    from training.replay import rescale_time

    if rate_events_per_s <= 0:
        raise ValueError(f"rate must be positive, got {rate_events_per_s}")
    span_ms = events[-1].ts_ms - events[0].ts_ms if events else 0
    if len(events) < 2 or span_ms <= 0:
        return list(events)
    return rescale_time(events, (len(events) - 1) * 1000 / rate_events_per_s / span_ms)


AS_FAST_AS_POLLED = 1e9
"""A ``PacedSource`` rate at which every event has arrived by the first poll."""


def live_maximum(settings_kwargs: dict[str, Any], events: list[Any], pace: float) -> float:
    """Events per second the sidecar handles, from memory, ``events`` paced to ``pace``
    events/s (``paced``) and all available at once: the maximum of a live stream
    arriving at about that rate, whose event-time work comes as often per event."""
    return open_loop("max", settings_kwargs, paced(events, pace), AS_FAST_AS_POLLED).achieved_per_s


def _live_line(label: str, maximum: float, blocks_per_event: float, run: str, pace: float) -> str:
    """The line that states a policy's live maximum (events/s and block accesses/s)."""
    return (
        f"{label}: live maximum {maximum:,.0f} events/s, "
        f"{maximum * blocks_per_event:,.0f} block accesses/s (paced to the {run}'s {pace:,.0f}/s)"
    )


def write_events(events: list[Any], path: Path) -> Path:
    """``events`` as canonical JSON lines (what ``read_trace`` and ``produce_trace`` read)."""
    import msgspec

    path.write_bytes(b"".join(msgspec.json.encode(e.to_dict()) + b"\n" for e in events))
    return path


class PacedSource:
    """Open-loop ``EventSource`` over events in memory: event ``i`` arrives at
    ``start + i / rate`` (wall clock) and can be polled from then on. ``commit`` (which
    the loop calls once the decisions of everything polled were delivered) records
    each committed event's latency from its arrival."""

    def __init__(self, events: list[Any], rate_events_per_s: float) -> None:
        self.events = events
        self.interval_s = 1.0 / rate_events_per_s
        self.next_index = 0
        self.start_s: float | None = None
        self.pending_arrivals_s: list[float] = []
        self.latencies_s: list[float] = []
        self.num_dead_lettered = 0

    @property
    def exhausted(self) -> bool:
        return self.next_index >= len(self.events) and not self.pending_arrivals_s

    def poll(self, max_events: int, timeout_ms: int) -> list[Any]:
        now = time.perf_counter()
        if self.start_s is None:
            self.start_s = now
        if self.next_index >= len(self.events):
            return []
        next_arrival = self.start_s + self.next_index * self.interval_s
        if next_arrival > now:  # idle until the next arrival, at most the poll timeout
            time.sleep(min(next_arrival - now, timeout_ms / 1000))
            now = time.perf_counter()
        arrived = min(len(self.events), int((now - self.start_s) / self.interval_s) + 1)
        take = max(0, min(arrived - self.next_index, max_events))
        first = self.next_index
        self.next_index += take
        self.pending_arrivals_s.extend(
            self.start_s + i * self.interval_s for i in range(first, first + take)
        )
        return self.events[first : first + take]

    def commit(self) -> None:
        now = time.perf_counter()
        self.latencies_s.extend(now - a for a in self.pending_arrivals_s)
        self.pending_arrivals_s.clear()

    def dead_letter(self, event: Any, reason: str, error: str) -> None:
        """An event the sidecar could not handle: counted (a benchmark keeps no file)."""
        self.num_dead_lettered += 1

    def close(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"events": self.next_index, "dead_lettered": self.num_dead_lettered}


@dataclass
class OpenLoopResult:
    """One open-loop run: the rate reached, latency percentiles, and where the loop's
    time went (``serving.loop.LOOP_PHASES``)."""

    achieved_per_s: float
    p50_ms: float
    p99_ms: float
    stats: LoopStats
    elapsed_s: float
    """The loop's own run (what ``busy`` divides by)."""
    p99_range_ms: tuple[float, float] | None = None
    """Lowest and highest p99 of the repeated runs this one is the median of
    (``median_run``); None for a single run."""

    @classmethod
    def of(
        cls,
        num_events: int,
        span_s: float,
        latencies_s: list[float],
        stats: LoopStats,
        elapsed_s: float,
    ) -> OpenLoopResult:
        """``num_events`` over ``span_s`` seconds, with each event's latency."""
        lat = np.array(latencies_s or [0.0]) * 1000
        p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
        return cls(num_events / span_s, float(p50), float(p99), stats, elapsed_s)

    @property
    def busy(self) -> float:
        """Share of the run's wall time the loop spent outside ``poll``."""
        phase = self.stats.seconds_by_phase
        busy_s = sum(phase.values()) - phase["poll"]
        return busy_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def per_batch_ms(self, *phases: str) -> float:
        """Mean milliseconds per batch spent in ``phases``."""
        total = sum(self.stats.seconds_by_phase[p] for p in phases)
        return 1000 * total / max(1, self.stats.batches)

    def row(self, label: str, offered_per_s: float) -> str:
        s = self.stats
        return (
            f"{label:<26}{offered_per_s:>11,.0f}{self.achieved_per_s:>12,.0f}"
            f"{self.p50_ms:>9.2f}{self.p99_ms:>9.2f}{100 * self.busy:>7.0f}%"
            f"{s.events / max(1, s.batches):>10.1f}{self.per_batch_ms('handle'):>10.2f}"
            f"{self.per_batch_ms('deliver', 'commit'):>10.2f}"
            + (
                f"{f'{self.p99_range_ms[0]:.1f}-{self.p99_range_ms[1]:.1f}':>16}"
                if self.p99_range_ms
                else ""
            )
        )


def median_run(runs: list[OpenLoopResult]) -> OpenLoopResult:
    """The run whose p99 is the median of ``runs`` (the lower middle one for an even
    count), with every run's p99 range attached."""
    if not runs:
        raise ValueError("no open-loop runs to take the median of")
    ranked = sorted(runs, key=lambda r: r.p99_ms)
    middle = ranked[(len(ranked) - 1) // 2]
    if len(runs) == 1:
        return middle
    return replace(middle, p99_range_ms=(ranked[0].p99_ms, ranked[-1].p99_ms))


OPEN_LOOP_HEADER = (
    f"{'run':<26}{'offered/s':>11}{'achieved/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'busy':>8}"
    f"{'ev/batch':>10}{'handle':>10}{'dlv+cmt':>10}"
)
"""busy: share of wall time outside the source's poll; handle and dlv+cmt: ms per batch
handling its events, and delivering its decisions plus committing its offsets; with
``--repeat`` > 1, the run with the median p99 and, last, the p99 range of the runs."""


def open_loop(
    label: str, settings_kwargs: dict[str, Any], events: list[Any], rate_events_per_s: float
) -> OpenLoopResult:
    """One open-loop run of the file events at ``rate_events_per_s``."""
    settings = load_settings(None, **settings_kwargs)
    source = PacedSource(events, rate_events_per_s)
    service = Service(settings, source=source)
    stop_watchdog = _watchdog(service, STALL_S)
    try:
        t0 = time.perf_counter()
        stats = service.run(max_events=len(events))
        elapsed = time.perf_counter() - t0
    finally:
        stop_watchdog.set()
        service.close()
    return OpenLoopResult.of(len(events), elapsed, source.latencies_s, stats, elapsed)


class _ArrivalTimedSource:
    """Wraps a ``KafkaEventSource``: at each commit, notes for every event handled since
    the last one when its decisions' commit returned (``time.monotonic``, which is
    system-wide, so it compares with the send times the producer process reports)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pending: list[str] = []
        self.committed_at: dict[str, float] = {}

    def poll(self, max_events: int, timeout_ms: int) -> list[Any]:
        events = self.inner.poll(max_events, timeout_ms)
        self.pending += [getattr(e, "request_id", "") for e in events]
        return events

    def commit(self) -> None:
        self.inner.commit()
        now = time.monotonic()
        for r in self.pending:
            self.committed_at.setdefault(r, now)
        self.pending.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _produce_paced(
    bootstrap: str, topic: str, events: list[Any], rate_events_per_s: float, out: Any
) -> None:
    """The open loop's producer, in a process of its own (as the ZMQ bridge or any
    upstream producer is): a producer thread and its sender thread inside the
    sidecar's process shared the loop's GIL, which no deployment does. Sends
    ``events`` at ``rate_events_per_s`` (linger 0: each event goes out when it is due;
    the 5 ms linger was 5 of the ~6 ms from send to broker append) and sends back
    ``{request_id: time.monotonic() at send}``."""
    from serving.kafka_io import KafkaEventProducer

    sent: dict[str, float] = {}
    # Built (connected, the topic's metadata fetched) before the first event's clock.
    with KafkaEventProducer(
        bootstrap, topic, client_id="kvwarm-bench-open", linger_ms=0
    ) as producer:
        producer.warm_up()  # its producer id (librdkafka's idempotence) before the clock
        start = time.monotonic()
        for i, event in enumerate(events):
            delay = start + i / rate_events_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sent[event.request_id] = time.monotonic()
            producer.send_event(event)
        producer.flush()
    out.send(sent)
    out.close()


def kafka_open_loop(
    settings_kwargs: dict[str, Any],
    events: list[Any],
    rate_events_per_s: float,
    bootstrap: str,
    topic: str,
) -> OpenLoopResult:
    """A producer process sends ``events`` into a one-partition ``topic`` at
    ``rate_events_per_s`` while the sidecar consumes it; latency per event from its
    send to the loop's commit after its decisions were delivered (the offsets go to the
    broker at most every ``kafka_commit_interval_ms``, as ``kvwarm serve`` runs)."""
    import multiprocessing

    from serving.kafka_io import KafkaEventSource, ensure_topics

    ensure_topics(bootstrap, {topic: 1})
    settings = load_settings(None, **settings_kwargs)
    source = _ArrivalTimedSource(
        KafkaEventSource(
            bootstrap,
            topic,
            group_id=topic + ".g",
            commit_interval_ms=settings.kafka_commit_interval_ms,
        )
    )
    source.inner.wait_assigned(10)  # join the group before the clock starts
    service = Service(settings, source=source)  # type: ignore[arg-type]
    # spawn, not fork: this process runs kafka-python's network threads.
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    producer = ctx.Process(
        target=_produce_paced,
        args=(bootstrap, topic, events, rate_events_per_s, send),
        name="bench-open-producer",
        daemon=True,
    )
    stop_watchdog = _watchdog(service, STALL_S)

    def stop_if_producer_fails() -> None:
        producer.join()
        if producer.exitcode:
            service.stop()

    try:
        producer.start()
        send.close()
        threading.Thread(target=stop_if_producer_fails, daemon=True).start()
        t0 = time.perf_counter()
        stats = service.run(max_events=len(events))
        elapsed = loop_elapsed = time.perf_counter() - t0
        sent: dict[str, float] = receive.recv() if receive.poll(60) else {}
    finally:
        stop_watchdog.set()
        producer.join(timeout=60)
        service.close()
    # The sidecar's clock started before the producer process was up: achieved rate
    # from the first send to the last commit.
    if sent and source.committed_at:
        elapsed = max(source.committed_at.values()) - min(sent.values())
    latencies_s = [source.committed_at[r] - t for r, t in sent.items() if r in source.committed_at]
    return OpenLoopResult.of(len(events), elapsed, latencies_s, stats, loop_elapsed)


def _print(results: list[RunResult], baseline: RunResult) -> None:
    click.echo(
        f"{'run':<26}{'accesses/s':>12}{'x LRU':>7}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'decisions':>11}{'score s':>9}{'wall s':>8}"
    )
    for r in results:
        ratio = r.accesses_per_s / baseline.accesses_per_s if baseline.accesses_per_s else 0.0
        click.echo(
            f"{r.label:<26}{r.accesses_per_s:>12,.0f}{ratio:>7.2f}{r.p50_ms:>9.2f}"
            f"{r.p99_ms:>9.2f}{r.decisions:>11,}{r.score_s:>9.2f}{r.elapsed_s:>8.2f}"
        )
    for r in results:
        if r.served:
            total = sum(r.served.values()) or 1
            shares = ", ".join(
                f"{name} {count:,} ({count / total:.0%})"
                for name, count in sorted(r.served.items(), key=lambda kv: -kv[1])
            )
            click.echo(f"{r.label.strip()}: the guard served {shares} of the requests")


def _kafka_up(bootstrap: str) -> bool:
    from devtools.kafka_broker import port_accepts

    host, _, port = bootstrap.rpartition(":")
    try:
        return port_accepts(int(port), host=host or "127.0.0.1")
    except ValueError:
        return False


@click.command("serve")
@click.option("--requests", "num_requests", default=5_000, show_default=True, type=int)
@click.option("--workload", default="mixed", show_default=True, help="Generator profile.")
@click.option("--model", default=None, help="Saved policy dir or MLflow URI (default: train one).")
@click.option("--batch-size", default=1024, show_default=True, type=int)
@click.option(
    "--kafka",
    "kafka_bootstrap",
    default=lambda: os.environ.get("KVWARM_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
    show_default="$KVWARM_KAFKA_BOOTSTRAP or 127.0.0.1:9092",
)
@click.option("--profile-out", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--rates",
    default="0.25,0.5,0.75",
    show_default=True,
    help="Open-loop offered rates as fractions of each policy's maximum ('' to skip).",
)
@click.option(
    "--repeat",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs per open-loop rate; the one with the median p99 is printed, with the range.",
)
def serve_bench(
    num_requests: int,
    workload: str,
    model: str | None,
    batch_size: int,
    kafka_bootstrap: str,
    profile_out: str | None,
    rates: str,
    repeat: int,
) -> None:
    """Sidecar throughput (block accesses/s) and event-to-decision latency, learned vs LRU."""
    from features.generator import generate_to_file, params_for

    with tempfile.TemporaryDirectory(prefix="kvwarm-bench-serve-") as tmp_name:
        tmp = Path(tmp_name)
        trace = generate_to_file(
            params_for(workload, num_requests=num_requests, seed=0), tmp / "t.jsonl"
        )
        if model is None:
            t0 = time.perf_counter()
            model = str(train_model(trace, tmp / "model", num_requests))
            click.echo(f"trained a LightGBM model in {time.perf_counter() - t0:.1f} s ({model})")
        common: dict[str, Any] = {
            "executor": "none",
            "http_enabled": False,
            "clock": "event",
            "batch_size": batch_size,
            "model_poll_interval_s": 0,
        }
        # "learned" is what `kvwarm serve` runs: the model behind the guard, which serves
        # whichever candidate its ghosts rank first (on this workload LRU: the lines under
        # the table say how many requests each served); "model" is the model alone, every
        # request scored by it: the learned path's own speed.
        configs: list[tuple[str, str, str, dict[str, Any]]] = [  # name, row title, model
            ("lru", "lru", "lru", {}),
            ("learned", "learned", model, {}),
            ("model", "model (no guard)", model, {"guard": False}),
        ]
        file_runs = []
        for name, title, spec, extra in configs:
            kwargs = {
                **common,
                **extra,
                "source": f"file:{trace}",
                "model": spec,
                "decisions": (f"file:{tmp / (name + '.jsonl')}",),
            }
            file_runs.append(run_once(f"file  {title}", kwargs))
        _print(file_runs, file_runs[0])
        fractions = [float(f) for f in rates.split(",") if f.strip()]
        if fractions:
            from features.decoders import read_trace

            events = list(read_trace(trace))
            blocks_per_event = sum(len(e.block_hashes) for e in events) / max(1, len(events))
            click.echo(
                "\nopen loop, the file's events paced and released at offered rates, from "
                "memory (latency per event from its arrival to its decisions' commit):"
            )
            maxima = []
            for (name, _, spec, extra), saturated in zip(configs, file_runs, strict=True):
                label = f"open  {name}"
                kwargs = {
                    **common,
                    **extra,
                    "model": spec,
                    "decisions": (f"file:{tmp / ('open-' + name + '.jsonl')}",),
                }
                pace = saturated.events / saturated.elapsed_s
                maximum = live_maximum(kwargs, events, pace)
                maxima.append((label, kwargs, maximum))
                click.echo(_live_line(label, maximum, blocks_per_event, "file run", pace))
            click.echo(OPEN_LOOP_HEADER + (f"{'p99 range':>16}" if repeat > 1 else ""))
            for label, kwargs, max_rate in maxima:
                for fraction in fractions:
                    rate = fraction * max_rate
                    result = median_run(
                        [open_loop(label, kwargs, paced(events, rate), rate) for _ in range(repeat)]
                    )
                    click.echo(result.row(f"{label} @{fraction:g}x max", rate))
        if profile_out:
            # A separate run: the measured ones above carry no profiler overhead.
            kwargs = {
                **common,
                "source": f"file:{trace}",
                "model": model,
                "decisions": (f"file:{tmp / 'profiled.jsonl'}",),
                "_max_events": min(num_requests, 2_000),
            }
            run_once("profiled", kwargs, Path(profile_out))
            click.echo(f"\nprofile of a learned run ({profile_out}), top by internal time:")
            pstats.Stats(profile_out).sort_stats("tottime").print_stats(20)

        if not _kafka_up(kafka_bootstrap):
            click.echo(
                f"\nno Kafka broker at {kafka_bootstrap}: Kafka runs skipped (kvwarm kafka up)"
            )
            return
        from serving.kafka_io import ensure_topics, produce_trace

        kafka_runs = []
        tag = f"{os.getpid()}-{int(time.time())}"

        def saturated_kafka(
            label: str, spec: str, extra: dict[str, Any], path: Path, topic: str
        ) -> RunResult:
            """``path``'s events produced into ``topic`` first, then served from it."""
            ensure_topics(kafka_bootstrap, {topic: 1})
            report = produce_trace(path, kafka_bootstrap, topic, progress=False)
            kwargs = {
                **common,
                **extra,
                "source": f"kafka://{kafka_bootstrap}/{topic}",
                "model": spec,
                "decisions": (f"kafka://{kafka_bootstrap}/kvwarm.bench.decisions.{tag}",),
                "kafka_group_id": f"bench-{topic}",
                "_max_events": report.num_events,
            }
            return run_once(label, kwargs)

        for name, title, spec, extra in configs:
            kafka_runs.append(
                saturated_kafka(
                    f"kafka {title}", spec, extra, trace, f"kvwarm.bench.events.{name}.{tag}"
                )
            )
        click.echo("")
        _print(kafka_runs, kafka_runs[0])
        if fractions:
            click.echo(
                "\nopen loop through Kafka (1 partition): a producer sends the events, "
                "paced, at offered rates (latency per event from its send to the commit "
                "after its decisions were delivered; offsets to the broker at most every "
                f"{load_settings(None, **common).kafka_commit_interval_ms} ms):"
            )
            kafka_maxima = []
            for (name, _, spec, extra), saturated in zip(configs, kafka_runs, strict=True):
                label = f"kafka open  {name}"
                pace = saturated.events / saturated.elapsed_s
                live = saturated_kafka(
                    label,
                    spec,
                    extra,
                    write_events(paced(events, pace), tmp / f"paced-{name}.jsonl"),
                    f"kvwarm.bench.events.paced.{name}.{tag}",
                )
                maximum = live.events / live.elapsed_s
                kafka_maxima.append((label, name, spec, extra, maximum))
                click.echo(_live_line(label, maximum, blocks_per_event, "saturated run", pace))
            click.echo(OPEN_LOOP_HEADER + (f"{'p99 range':>16}" if repeat > 1 else ""))
            for label, name, spec, extra, max_rate in kafka_maxima:
                open_kwargs = {
                    **common,
                    **extra,
                    "model": spec,
                    "decisions": (f"kafka://{kafka_bootstrap}/kvwarm.bench.decisions.open.{tag}",),
                }
                for fraction in fractions:
                    rate = fraction * max_rate
                    result = median_run(
                        [
                            kafka_open_loop(
                                open_kwargs,
                                paced(events, rate),
                                rate,
                                kafka_bootstrap,
                                f"kvwarm.bench.events.open.{name}.{fraction:g}.{tag}.{run}",
                            )
                            for run in range(repeat)
                        ]
                    )
                    click.echo(result.row(f"{label} @{fraction:g}x", rate))
