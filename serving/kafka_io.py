"""Kafka at the edge of the sidecar: the only module of kvwarm that imports a Kafka client.

Two clients. The sidecar's hot path (the event consumer and every producer: decisions,
dead letters, events, the state changelog) runs on librdkafka (the ``confluent-kafka``
package): its fetcher, sender and group member are C threads that never take the
interpreter lock the sidecar's loop holds, where kafka-python's are Python threads that
do. In ``kvwarm bench serve``'s Kafka open loop, alternating the two clients in one
process, the p99 event-to-decision latency fell 2-5x and the p50 3-8x (figures in
``docs/benchmarks.md``, "sidecar"). kafka-python stays off the hot path: topic
administration (``ensure_topics``), reading a topic back (``read_topic``, the
changelog's replay) and the acknowledgement reader.

Primitives:

- ``KafkaEventSource``: the ``EventSource`` contract (``serving.sources``) over a
  consumer group. Offsets are committed in ``commit()`` and nowhere else (auto commit
  is off), so delivery is at-least-once and a restarted consumer resumes from what was
  committed. Payloads are decoded by ``features.decoders.decode_message``; a message
  that fails goes, unchanged, to a dead-letter topic with headers naming the reason
  and its source topic/partition/offset, and is counted.
- ``KafkaDecisionSink``: decisions out, idempotent producer, one record per flush
  (the decisions of one poll's requests and prefetch rounds; chunks of at most
  ``max_decisions_per_record``): value = a JSON array of decisions, key = the first
  decision's block hash. ``decode_decision_record`` reads one back (an array, or a
  single decision object as older kvwarm wrote). One record per decision cost
  ~150 us of kafka-python per decision, ~2 per block access.
- ``KafkaEventProducer`` / ``produce_trace``: access events in, keyed by prefix root
  (the first block hash) so a session's requests stay in one partition, in order.
- ``ensure_topics``: create topics with chosen partition counts (admin client).
- ``read_topic``: read a topic from the beginning without a group (dead letters).
- ``KafkaChangelog``: a compacted topic holding ``serving.state_store`` snapshots.
- ``KafkaSecurity``: SASL/TLS settings passed through to every client.

Every client connects with bounded retries; when no broker answers,
``KafkaUnavailableError`` names the address tried and what to check.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import confluent_kafka as rdk
import msgspec
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError
from kafka.structs import TopicPartition
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from executor.decision import Decision
from executor.kvhints import HintError, parse_ack
from executor.kvhints import decision_format as decision_format_named
from features.decoders import decode_message, read_trace
from features.events import BlocksAccessed, Event, EventValidationError
from serving.sources import dead_letter_payload

log = logging.getLogger(__name__)

DLQ_SUFFIX = ".dlq"
"""Default dead-letter topic of a source topic ``T``: ``T.dlq``."""

# Header names on dead letters (values are UTF-8 bytes).
HEADER_ENGINE = "kvwarm.engine"
"""Record header naming the engine a residency event came from (set by the ZMQ bridge);
the source decodes the event with that engine id, so it joins that engine's requests."""
HEADER_REASON = "kvwarm.dlq.reason"
HEADER_ERROR = "kvwarm.dlq.error"
HEADER_SOURCE_TOPIC = "kvwarm.dlq.source.topic"
HEADER_SOURCE_PARTITION = "kvwarm.dlq.source.partition"
HEADER_SOURCE_OFFSET = "kvwarm.dlq.source.offset"

DLQ_FLUSH_TIMEOUT_S = 30.0
"""How long ``commit`` waits for dead letters to be acknowledged before it fails."""
CLOSE_TIMEOUT_S = 1.0
"""How long ``KafkaEventSource.close`` waits for dead letters and for a broker."""
QUEUE_FULL_WAIT_S = 120.0
"""How long a send waits for room in a full producer queue (the records' own delivery
timeout, ``message.timeout.ms``)."""
IDEMPOTENCE_START_S = 0.6
"""librdkafka's retry timer for an idempotent producer's id (500 ms), and a margin."""

_T = TypeVar("_T")


class KafkaUnavailableError(ConnectionError):
    """No Kafka broker answered at the configured address (after bounded retries)."""


class KafkaDeliveryError(RuntimeError):
    """The broker did not acknowledge some produced records."""


class KafkaSecurity(BaseSettings):
    """SASL/TLS settings passed to every client (``client_config``: kafka-python's
    names; ``librdkafka_config``: librdkafka's).

    Read from ``KVWARM_KAFKA_*`` environment variables (for example
    ``KVWARM_KAFKA_SECURITY_PROTOCOL=SASL_SSL``); the defaults talk plain text to a
    local broker. Passwords are secrets: never printed, never logged.
    """

    model_config = SettingsConfigDict(env_prefix="KVWARM_KAFKA_", frozen=True, extra="ignore")

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="Listener protocol of the brokers."
    )
    sasl_mechanism: (
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"] | None
    ) = Field(default=None, description="SASL mechanism when the protocol is SASL_*.")
    sasl_username: str | None = Field(default=None, description="SASL PLAIN/SCRAM user name.")
    sasl_password: SecretStr | None = Field(default=None, description="SASL PLAIN/SCRAM password.")
    ssl_cafile: Path | None = Field(
        default=None, description="CA bundle that signed the brokers' certificates."
    )
    ssl_certfile: Path | None = Field(default=None, description="Client certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(default=None, description="Client private key (mutual TLS).")
    ssl_password: SecretStr | None = Field(default=None, description="Password of the client key.")
    ssl_check_hostname: bool = Field(default=True, description="Verify the broker's host name.")

    def librdkafka_config(self) -> dict[str, Any]:
        """librdkafka properties for these settings (the sidecar's consumer, producers)."""
        cfg: dict[str, Any] = {"security.protocol": self.security_protocol}
        for name, value in self.client_config().items():
            if name in _RDKAFKA_NAMES:
                cfg[_RDKAFKA_NAMES[name]] = value
        if self.security_protocol in ("SSL", "SASL_SSL"):
            cfg["ssl.endpoint.identification.algorithm"] = (
                "https" if self.ssl_check_hostname else "none"
            )
        return cfg

    def client_config(self) -> dict[str, Any]:
        """kafka-python keyword arguments for these settings."""
        cfg: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            if self.sasl_mechanism is None:
                raise ValueError(
                    f"security_protocol={self.security_protocol} needs KVWARM_KAFKA_SASL_MECHANISM "
                    "(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or GSSAPI)"
                )
            cfg["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_username is not None:
                cfg["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                cfg["sasl_plain_password"] = self.sasl_password.get_secret_value()
        if self.security_protocol in ("SSL", "SASL_SSL"):
            cfg["ssl_check_hostname"] = self.ssl_check_hostname
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                value = getattr(self, name)
                if value is not None:
                    cfg[name] = str(value)
            if self.ssl_password is not None:
                cfg["ssl_password"] = self.ssl_password.get_secret_value()
        return cfg


_RDKAFKA_NAMES = {
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
}
"""kafka-python's names of ``KafkaSecurity``'s settings -> librdkafka's."""


@dataclass(frozen=True)
class ConnectOptions:
    """How clients reach the brokers. Retries are bounded: ``attempts`` tries of
    ``attempt_timeout_ms`` each, ``backoff_s`` (doubling) between them."""

    attempts: int = 3
    attempt_timeout_ms: int = 5_000
    backoff_s: float = 0.5
    probe_s: float = 2.0
    """Before any client is built, the bootstrap addresses are tried over plain TCP for
    at most this long: a host where nothing listens fails in about this time with one
    line, instead of after every client retry (0: no probe)."""
    # Reconnect quickly after a broker restart (kafka-python's default cap is 30 s).
    reconnect_backoff_max_ms: int = 1_000


def _client_config(
    bootstrap: str, security: KafkaSecurity | None, options: ConnectOptions, client_id: str
) -> dict[str, Any]:
    return {
        "bootstrap_servers": bootstrap.split(","),
        "client_id": client_id,
        "bootstrap_timeout_ms": options.attempt_timeout_ms,
        "reconnect_backoff_ms": 50,
        "reconnect_backoff_max_ms": options.reconnect_backoff_max_ms,
        **(security or KafkaSecurity()).client_config(),
    }


class _LibrdkafkaLog:
    """librdkafka's log lines (syslog levels) into this module's logger at debug level,
    but for the critical ones (level 2 and below)."""

    def log(self, level: int, fmt: str, *args: object) -> None:
        log.log(logging.ERROR if level <= 2 else logging.DEBUG, "librdkafka: " + fmt, *args)


_LIBRDKAFKA_LOG = _LibrdkafkaLog()


_ERROR_REPEAT_S = 30.0
_last_errors: dict[str, float] = {}


def _client_error(error: rdk.KafkaError) -> None:
    """librdkafka's client errors as warnings; the same error again within
    ``_ERROR_REPEAT_S`` at debug level (a broker that is away is reported on every
    reconnect try, about once a second)."""
    text = str(error)
    now = time.monotonic()
    repeat = now - _last_errors.get(text, -_ERROR_REPEAT_S) < _ERROR_REPEAT_S
    if not repeat:
        if len(_last_errors) > 1_000:
            _last_errors.clear()
        _last_errors[text] = now
    log.log(logging.DEBUG if repeat else logging.WARNING, "Kafka client: %s", error)


def _rd_config(
    bootstrap: str, security: KafkaSecurity | None, options: ConnectOptions, client_id: str
) -> dict[str, Any]:
    """librdkafka's form of ``_client_config``. Its errors (all brokers down, a failed
    authentication: ``error_cb``) are logged as warnings, its own log lines at debug
    level (it retries a refused connection every second, each a line of its own); both
    are served from the client's poll, consume or flush calls."""
    return {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "socket.connection.setup.timeout.ms": max(1_000, options.attempt_timeout_ms),
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": options.reconnect_backoff_max_ms,
        "logger": _LIBRDKAFKA_LOG,
        "error_cb": _client_error,
        **(security or KafkaSecurity()).librdkafka_config(),
    }


def _rd_connect(
    what: str,
    bootstrap: str,
    options: ConnectOptions,
    client: rdk.Producer | rdk.Consumer,
    topic: str | None,
) -> None:
    """A librdkafka client connects in the background and builds without a broker: ask
    it for ``topic``'s metadata (every topic's when None) through ``_connect``'s bounded
    retries, so that a broker nobody can reach fails here with ``KafkaUnavailableError``
    as kafka-python's clients do, and the first send or fetch does not wait for the
    metadata."""
    _connect(
        what,
        bootstrap,
        options,
        lambda: client.list_topics(topic, timeout=options.attempt_timeout_ms / 1000),
        retry_on=(rdk.KafkaException,),
    )


def probe_bootstrap(bootstrap: str, within_s: float) -> None:
    """Raise ``KafkaUnavailableError`` unless some ``HOST:PORT`` of ``bootstrap``
    accepts a TCP connection within ``within_s`` (tried every 0.2 s)."""
    addresses: list[tuple[str, int]] = []
    for item in bootstrap.split(","):
        host, _, port_text = item.strip().rpartition(":")
        if not host or not port_text.isdigit():
            raise KafkaUnavailableError(
                f"Kafka address {item.strip()!r} is not HOST:PORT; pass --bootstrap HOST:PORT "
                "or set KVWARM_KAFKA_BOOTSTRAP"
            )
        addresses.append((host.strip("[]"), int(port_text)))
    deadline = time.monotonic() + within_s
    last: OSError | None = None
    while True:
        for host, port in addresses:
            try:
                with socket.create_connection((host, port), timeout=min(1.0, within_s)):
                    return
            except OSError as exc:
                last = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    why = (getattr(last, "strerror", None) or str(last) or "no answer").lower()
    raise KafkaUnavailableError(
        f"no Kafka broker at {bootstrap} ({why}); start one with `kvwarm kafka up` "
        "(or check `kvwarm kafka status`), or give the right address with "
        "kafka://HOST:PORT/TOPIC, --bootstrap or KVWARM_KAFKA_BOOTSTRAP"
    )


def _connect(
    what: str,
    bootstrap: str,
    options: ConnectOptions,
    factory: Callable[[], _T],
    *,
    retry_on: tuple[type[Exception], ...] = (KafkaTimeoutError,),
) -> _T:
    """Build a client (``factory``), retrying a bounded number of times while it raises
    ``retry_on`` (no broker answers)."""
    if options.probe_s > 0:
        probe_bootstrap(bootstrap, options.probe_s)
    delay_s = options.backoff_s
    for attempt in range(1, options.attempts + 1):
        try:
            return factory()
        except retry_on as exc:
            if attempt == options.attempts:
                total_s = options.attempts * options.attempt_timeout_ms / 1000
                raise KafkaUnavailableError(
                    f"no Kafka broker answered at {bootstrap} for the {what} after {attempt} tries "
                    f"(~{total_s:.0f} s; last error: {exc}). Check that a broker is running there "
                    "(`kvwarm kafka status`, or `kvwarm kafka up` for a local one), that the host "
                    "and port are right (KVWARM_KAFKA_BOOTSTRAP), and that the security settings "
                    "(KVWARM_KAFKA_SECURITY_PROTOCOL, SASL/SSL) match the broker's listener."
                ) from exc
            log.warning(
                "%s: no broker at %s (try %d/%d): %s",
                what,
                bootstrap,
                attempt,
                options.attempts,
                exc,
            )
            time.sleep(delay_s)
            delay_s *= 2
    raise AssertionError("unreachable")


# --- topics ---------------------------------------------------------------------------------


def ensure_topics(
    bootstrap: str,
    topics: Mapping[str, int],
    *,
    replication_factor: int = 1,
    configs: Mapping[str, Mapping[str, str]] | None = None,
    security: KafkaSecurity | None = None,
    options: ConnectOptions = ConnectOptions(),
) -> list[str]:
    """Create each missing topic with its partition count (and ``configs[topic]``, e.g.
    ``{"cleanup.policy": "compact"}``); returns the names created.

    Existing topics are left as they are (a warning if they have fewer partitions than
    asked: Kafka can add partitions but that moves keys, so kvwarm never does it).
    """
    cfg = _client_config(bootstrap, security, options, "kvwarm-admin")
    admin = _connect("admin client", bootstrap, options, lambda: KafkaAdminClient(**cfg))
    try:
        existing = {t["topic"] if "topic" in t else t["name"]: t for t in admin.describe_topics()}
        missing = {name: n for name, n in topics.items() if name not in existing}
        for name, want in topics.items():
            if name in existing:
                have = len(existing[name].get("partitions") or [])
                if have < want:
                    log.warning(
                        "topic %s exists with %d partitions (< %d asked); left as is",
                        name,
                        have,
                        want,
                    )
        created: list[str] = []
        for name, partitions in missing.items():
            try:
                admin.create_topics(
                    {
                        name: {
                            "num_partitions": partitions,
                            "replication_factor": replication_factor,
                            "configs": dict((configs or {}).get(name, {})),
                        }
                    },
                    wait_for_metadata=True,
                )
                created.append(name)
            except TopicAlreadyExistsError:
                pass  # created concurrently by another client
        return created
    finally:
        admin.close()


def topic_partitions(
    bootstrap: str,
    topic: str,
    *,
    security: KafkaSecurity | None = None,
    options: ConnectOptions = ConnectOptions(),
) -> int:
    """Number of partitions of ``topic`` (0 if it does not exist)."""
    cfg = _client_config(bootstrap, security, options, "kvwarm-admin")
    admin = _connect("admin client", bootstrap, options, lambda: KafkaAdminClient(**cfg))
    try:
        for t in admin.describe_topics([topic]):
            if t.get("error_code", 0) == 0:
                return len(t.get("partitions") or [])
        return 0
    finally:
        admin.close()


# --- the event source ----------------------------------------------------------------------


def heal_stalled_join(consumer: KafkaConsumer) -> bool:
    """Restart a group join that kafka-python 3.0 would leave unfinished; True if it did.

    A rejoin begun because the metadata changed (a subscribed topic first seen, or
    partitions added) ends when the group leader's assignment matches the new
    metadata. The leader records that match while the JoinGroup/SyncGroup round trip is
    still its own task. If the poll's timeout passes just as the round trip ends, the
    next poll sees nothing left to rejoin for and never takes the task's answer: no
    partitions are assigned, heartbeats stay off, the broker drops the member after its
    session timeout, and the consumer reads nothing, for good. Polls of 5 ms hit this
    on every new group whose first join came before the topic's metadata, and on the
    event source each time partitions were added to its topic: it then read nothing
    more, from the old partition either, 3 times of 3
    (``tests/integration/test_kafka_roundtrip.py``); the ack reader's 200 ms polls hit
    it under load (a fresh-clone CI run: no ack read in 120 s). Call this after each
    poll: a finished join task that no poll will take is the stalled state exactly, and
    a fresh rejoin (one more generation) ends it. Reads the coordinator's private
    fields, so it does nothing where a kafka-python release lacks them."""
    coordinator = getattr(consumer, "_coordinator", None)
    task = getattr(coordinator, "_join_task", None)
    if task is None or not getattr(task, "is_done", False):
        return False
    if coordinator.need_rejoin():  # type: ignore[union-attr]
        return False  # the next poll takes (or retries) it
    log.warning(
        "kafka-python left a group join unfinished; rejoining (%s)", consumer.config.get("group_id")
    )
    coordinator.request_rejoin()  # type: ignore[union-attr]
    return True


@dataclass(slots=True)
class _Fetched:
    """One fetched message and how many of its events have been handed out."""

    tp: TopicPartition
    offset: int
    events: list[Event]
    num_handed_out: int = 0


_REBALANCED = frozenset(
    {
        rdk.KafkaError.REBALANCE_IN_PROGRESS,
        rdk.KafkaError.ILLEGAL_GENERATION,
        rdk.KafkaError.UNKNOWN_MEMBER_ID,
        rdk.KafkaError.FENCED_INSTANCE_ID,
        rdk.KafkaError._ASSIGNMENT_LOST,  # noqa: SLF001 - librdkafka's own error code
    }
)
"""Commit errors that mean the partitions moved to another member (not a broker away)."""


class _Message:
    """A consumed message's fields, read once (``confluent_kafka.Message`` methods)."""

    __slots__ = ("topic", "partition", "offset", "key", "value", "headers")

    def __init__(self, message: rdk.Message) -> None:
        self.topic: str = message.topic() or ""
        self.partition: int = message.partition() or 0
        self.offset: int = message.offset() or 0
        self.key: bytes | None = message.key()
        self.value: bytes | None = message.value()
        # A list of (name, value or None) pairs, or None.
        headers: Any = message.headers()
        self.headers: list[tuple[str, bytes]] | None = (
            None if headers is None else [(k, v or b"") for k, v in headers]
        )


class KafkaEventSource:
    """Access and residency events from Kafka topics, as a consumer group member
    (librdkafka: see the module's docstring for why, with figures).

    When each method is called (the sidecar loop):

    - ``poll(max_events, timeout_ms)``: fetch, decode, dead-letter what fails, return up
      to ``max_events`` events. A message holding several events (a JSON list, a
      ``KVEventBatch``) may be split across polls; its offset becomes committable only
      once all of its events have been handed out. It returns what the client has
      fetched at once, and waits up to ``timeout_ms`` only when nothing is there (then
      for the first message, and takes what came with it).
    - ``commit()``: after the loop emitted the decisions for everything polled so far.
      Waits for dead letters to be acknowledged, then commits the next offset of every
      fully handed-out message, asynchronously (the broker's answer is taken in a later
      ``poll``: see ``_send_done``). A commit lost to a rebalance or to a broker that
      is away only means those events are delivered again.
    - ``commit_interval_ms`` > 0 (``kvwarm serve``: ``kafka_commit_interval_ms``, 100
      by default): ``commit()`` still marks everything handed out as done (its dead
      letters acknowledged), but sends the offsets to the broker at most once per
      interval, as Kafka Streams' ``commit.interval.ms``; offsets marked done and not
      yet sent go with the next ``commit()`` past the interval, from ``poll()`` once the
      interval has passed (a stream gone quiet), when partitions are revoked, and on
      ``close()``. A crash redelivers what was handled since the last commit sent, as it
      redelivers the batch in hand: at least once either way (with ``state_topic`` the
      new owner of a partition starts from its snapshot's positions instead). Measured
      with kafka-python (``kvwarm bench serve``'s Kafka open loop, half of each
      policy's maximum, 2026-12-05): each batch of ~4 events spent 1.2-1.5 ms in the
      commit's round trip; alternating 0 and 100 ms in one session, LightGBM's p99 was
      23.5-27.7 ms at 100 against 41.3-49.5 ms at 0. 0: every ``commit()`` goes to the
      broker.
    - ``close()``: sends the offsets marked done and not yet sent, then leaves the group,
      within a few seconds even when the broker is gone (see ``close``).

    Rebalances are handled on the loop's own thread, inside ``poll`` (librdkafka calls
    back from its consume call): the revoked partitions' offsets marked done are
    committed before they go, so their next owner does not redo them.

    ``group_instance_id`` (static membership, KIP-345): give each sidecar a stable id
    and a restarted process takes its partitions back at once, without waiting out
    the session timeout of the one that died or moving partitions around.

    Events without a ``request_id`` of their own (Mooncake rows) get
    ``"<topic>/<partition>/<offset>"``, so a redelivered event has the same id.

    For state kept per partition (``serving.shards``): ``polled_partitions`` names the
    partition of each event the last ``poll`` returned; ``positions()`` says where each
    partition stands (next offset, events of that message already handed out);
    ``on_revoked(tps)`` and ``on_assigned(tps) -> {tp: position}`` are called in a
    rebalance, and the consumer starts each partition at the position returned
    (skipping the events of a message the snapshot already holds).
    """

    def __init__(
        self,
        bootstrap: str,
        topics: str | Sequence[str],
        *,
        group_id: str = "kvwarm",
        group_instance_id: str | None = None,
        dead_letter_topic: str | None = None,
        client_id: str = "kvwarm-source",
        auto_offset_reset: Literal["earliest", "latest"] = "earliest",
        session_timeout_ms: int = 10_000,
        fetch_max_wait_ms: int = 100,
        commit_interval_ms: int = 0,
        metadata_max_age_ms: int = 10_000,
        security: KafkaSecurity | None = None,
        options: ConnectOptions = ConnectOptions(),
    ) -> None:
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        if not self.topics:
            raise ValueError("KafkaEventSource needs at least one topic")
        if commit_interval_ms < 0:
            raise ValueError(f"commit_interval_ms must be >= 0, got {commit_interval_ms}")
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.commit_interval_ms = commit_interval_ms
        self.dead_letter_topic = dead_letter_topic or self.topics[0] + DLQ_SUFFIX
        base = _rd_config(bootstrap, security, options, client_id)
        consumer_cfg = {
            **base,
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": auto_offset_reset,
            "session.timeout.ms": session_timeout_ms,
            "heartbeat.interval.ms": max(100, session_timeout_ms // 4),
            "fetch.wait.max.ms": fetch_max_wait_ms,
            # Partitions added to a topic (or a topic created after subscribing) are seen
            # within this long.
            "topic.metadata.refresh.interval.ms": metadata_max_age_ms,
            "on_commit": self._committed_cb,
        }
        if group_instance_id is not None:
            consumer_cfg["group.instance.id"] = group_instance_id
        self._consumer = rdk.Consumer(consumer_cfg)
        try:
            _rd_connect("event consumer", bootstrap, options, self._consumer, None)
        except BaseException:
            self._consumer.close()
            raise
        self._consumer.subscribe(
            self.topics,
            on_assign=self._assigned,
            on_revoke=self._revoked,
            on_lost=self._lost,
        )
        self._dlq_client = (client_id + "-dlq", security, options)
        self._dlq: _Producer | None = None  # created on the first dead letter
        self._pending: deque[_Fetched] = deque()
        self._committable: dict[TopicPartition, int] = {}
        """Next offset per partition of what was handed out (handled or not)."""
        self._done: dict[TopicPartition, int] = {}
        """``_committable`` as of the last ``commit()``: handled, decisions delivered."""
        self._committed: dict[TopicPartition, int] = {}
        """What the broker has, as far as this member sent it."""
        self._last_sent_s = -float("inf")
        self._position: dict[TopicPartition, tuple[int, int]] = {}
        self._skip: dict[TopicPartition, tuple[int, int]] = {}
        self.polled_partitions: list[TopicPartition] = []
        self.on_revoked: Callable[[set[TopicPartition]], None] | None = None
        self.on_assigned: (
            Callable[[set[TopicPartition]], dict[TopicPartition, tuple[int, int]]] | None
        ) = None
        self._closed = False
        self.num_messages = 0
        self.num_events = 0
        self.num_dead_letters = 0
        self.dead_letters_by_reason: Counter[str] = Counter()
        self.num_commits = 0
        self.num_commit_failures = 0
        self.num_fetch_errors = 0

    @property
    def exhausted(self) -> bool:
        """A topic never ends: more can always come."""
        return False

    def poll(self, max_events: int, timeout_ms: int = 100) -> list[Event]:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        if self.commit_interval_ms and self._interval_passed():
            self._send_done()  # offsets a quiet stream left waiting
        if not any(m.num_handed_out < len(m.events) for m in self._pending):
            # librdkafka's consume waits until it has ``num_messages`` or the timeout
            # passes: take what is fetched at once, and wait only for a first message.
            consume = self._consumer.consume
            messages = consume(max_events, 0)
            if not messages and timeout_ms > 0:
                messages = consume(1, timeout_ms / 1000)
                if messages and max_events > 1:
                    messages += consume(max_events - 1, 0)
            self._take(messages)
        out: list[Event] = []
        partitions: list[TopicPartition] = []
        while self._pending and len(out) < max_events:
            head = self._pending[0]
            take = head.events[head.num_handed_out : head.num_handed_out + max_events - len(out)]
            out.extend(take)
            partitions.extend([head.tp] * len(take))
            head.num_handed_out += len(take)
            if head.num_handed_out == len(head.events):
                self._committable[head.tp] = head.offset + 1
                self._position[head.tp] = (head.offset + 1, 0)
                self._pending.popleft()
            else:
                self._position[head.tp] = (head.offset, head.num_handed_out)
        # Dead-lettered messages right behind the last one handed out are done too.
        while self._pending and not self._pending[0].events:
            done = self._pending.popleft()
            self._committable[done.tp] = done.offset + 1
            self._position[done.tp] = (done.offset + 1, 0)
        self.num_events += len(out)
        self.polled_partitions = partitions
        return out

    def wait_assigned(self, timeout_s: float) -> bool:
        """Poll (keeping what comes) until this member holds partitions; False if it
        holds none after ``timeout_s``. For callers that start a clock after joining."""
        deadline = time.monotonic() + timeout_s
        while not self._consumer.assignment():
            if time.monotonic() >= deadline:
                return False
            self._take(self._consumer.consume(1, 0.05))
        return True

    def _take(self, messages: list[rdk.Message]) -> None:
        """Decode consumed messages into ``_pending``. A fetch or group error librdkafka
        reports in the stream (a topic not created yet, a broker away) is counted and
        logged, never raised: the client retries by itself."""
        for message in messages:
            error = message.error()
            if error is None:
                self._pending.append(self._decode(_Message(message)))
                continue
            self.num_fetch_errors += 1
            if error.fatal():
                log.error("Kafka consumer error (fatal; restart the sidecar): %s", error)
            else:
                log.warning("Kafka consumer: %s", error)

    def positions(self) -> dict[TopicPartition, tuple[int, int]]:
        """Where each partition handed out so far stands: (next offset, events of the
        message at that offset already handed out)."""
        return dict(self._position)

    # -- rebalances (librdkafka calls these from inside ``consume``, on this thread) --

    def _assigned(self, consumer: rdk.Consumer, assigned: list[rdk.TopicPartition]) -> None:
        tps = {TopicPartition(p.topic, p.partition) for p in assigned}
        log.info("assigned partitions: %s", sorted(tps))
        if self.on_assigned is not None:
            seek = self.on_assigned(tps)
            for p in assigned:
                at = seek.get(TopicPartition(p.topic, p.partition))
                if at is not None:
                    p.offset = at[0]
            self._resume(seek)
        consumer.assign(assigned)

    def _revoked(self, consumer: rdk.Consumer, revoked: list[rdk.TopicPartition]) -> None:
        # Still this member's: what was handled goes to the broker before they move
        # (waiting: the broker is there, it is running the rebalance). Not when
        # closing: ``close`` has sent them if a broker was there to take them.
        self._give_up(consumer, revoked, commit=not self._closed)

    def _lost(self, consumer: rdk.Consumer, lost: list[rdk.TopicPartition]) -> None:
        """Partitions taken without a revoke (the session expired): nothing can be
        committed for them any more."""
        log.warning("partitions lost (session expired?): %s", sorted((p.topic, p.partition) for p in lost))  # fmt: skip
        self._give_up(consumer, lost, commit=False)

    def _give_up(
        self, consumer: rdk.Consumer, partitions: list[rdk.TopicPartition], *, commit: bool
    ) -> None:
        tps = {TopicPartition(p.topic, p.partition) for p in partitions}
        if self.on_revoked is not None:
            self.on_revoked(tps)
        if commit:
            self._send_done(only=tps, wait=True)
        self._forget(tps)
        consumer.unassign()

    def _resume(self, seek: dict[TopicPartition, tuple[int, int]]) -> None:
        """Note the positions kept in a snapshot (the partitions start there)."""
        for tp, (offset, skip) in seek.items():
            self._position[tp] = (offset, skip)
            if skip:
                self._skip[tp] = (offset, skip)

    def _decode(self, record: _Message) -> _Fetched:
        self.num_messages += 1
        tp = TopicPartition(record.topic, record.partition)
        request_id = f"{record.topic}/{record.partition}/{record.offset}"
        events: list[Event] = []
        try:
            if record.value is None:
                raise EventValidationError("<value>", "message has no value (tombstone)", "empty")
            engine = next((v for k, v in record.headers or () if k == HEADER_ENGINE), b"")
            events = decode_message(
                record.value, request_id=request_id, engine_id=engine.decode(errors="replace")
            )
        except EventValidationError as exc:
            self._dead_letter(record, exc.reason, str(exc))
        except Exception as exc:  # a decoder bug must not stop the stream either
            log.exception("unexpected error decoding %s", request_id)
            self._dead_letter(record, "decoder_error", f"{type(exc).__name__}: {exc}")
        fetched = _Fetched(tp, record.offset, events)
        skip = self._skip.pop(tp, None)
        if skip is not None and skip[0] == record.offset:
            # A restored snapshot already holds the first events of this message.
            fetched.num_handed_out = min(skip[1], len(events))
        return fetched

    def _dead_letter(self, record: _Message, reason: str, error: str) -> None:
        self.num_dead_letters += 1
        self.dead_letters_by_reason[reason] += 1
        headers = [
            *(record.headers or []),
            (HEADER_REASON, reason.encode()),
            (HEADER_ERROR, error[:500].encode()),
            (HEADER_SOURCE_TOPIC, record.topic.encode()),
            (HEADER_SOURCE_PARTITION, str(record.partition).encode()),
            (HEADER_SOURCE_OFFSET, str(record.offset).encode()),
        ]
        self._send_dead_letter(record.key, record.value, headers)
        log.debug("dead letter %s/%d/%d: %s", record.topic, record.partition, record.offset, reason)

    def _send_dead_letter(
        self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        if self._dlq is None:
            client_id, security, options = self._dlq_client
            self._dlq = _Producer(
                "dead-letter producer", self.bootstrap, self.dead_letter_topic,
                client_id=client_id, linger_ms=5, security=security, options=options,
            )  # fmt: skip
        self._dlq.send_record(value, key=key, headers=headers)

    def dead_letter(self, event: Event, reason: str, error: str) -> None:
        """The loop could not handle ``event`` (decoded from a message already handed
        out): its JSON form goes to the dead-letter topic and its offset is committed
        with the batch, so a poison pill never stops or crash-loops the consumer."""
        self.num_dead_letters += 1
        self.dead_letters_by_reason[reason] += 1
        headers = [(HEADER_REASON, reason.encode()), (HEADER_ERROR, error[:500].encode())]
        self._send_dead_letter(None, dead_letter_payload(event), headers)

    def _forget(self, revoked: set[TopicPartition]) -> None:
        """Partitions taken away in a rebalance: drop what was fetched but not committed;
        the new owner starts from the committed offset."""
        self._pending = deque(m for m in self._pending if m.tp not in revoked)
        for tp in revoked:
            self._committable.pop(tp, None)
            self._done.pop(tp, None)
            self._committed.pop(tp, None)
            self._position.pop(tp, None)
            self._skip.pop(tp, None)

    def commit(self) -> None:
        if self._dlq is not None:
            # Raises KafkaDeliveryError for dead letters not acknowledged: not committing
            # then, the failed messages will be read (and dead-lettered) again.
            self._dlq.flush(DLQ_FLUSH_TIMEOUT_S)
        self._done = dict(self._committable)  # everything handed out is handled now
        if self.commit_interval_ms and not self._interval_passed():
            return  # sent with a later commit or poll, or at close
        self._send_done()

    def _interval_passed(self) -> bool:
        return (time.monotonic() - self._last_sent_s) * 1000 >= self.commit_interval_ms

    def _send_done(self, only: set[TopicPartition] | None = None, *, wait: bool = False) -> None:
        """Commit the offsets marked done that the broker does not have yet (of the
        partitions ``only``, when given). Asynchronously unless ``wait``: the broker's
        answer comes back through ``_committed_cb`` from a later poll. librdkafka's
        synchronous commit waits for a group coordinator for as long as the session
        timeout when the broker is away, with the loop stopped; an asynchronous one
        costs the loop nothing either way."""
        offsets = {
            tp: offset
            for tp, offset in self._done.items()
            if self._committed.get(tp) != offset and (only is None or tp in only)
        }
        if not offsets:
            return
        self._last_sent_s = time.monotonic()
        partitions = [rdk.TopicPartition(tp.topic, tp.partition, o) for tp, o in offsets.items()]
        try:
            if wait:
                self._committed_cb(
                    None, self._consumer.commit(offsets=partitions, asynchronous=False)
                )
            else:
                self._consumer.commit(offsets=partitions, asynchronous=True)
        except rdk.KafkaException as exc:
            self._commit_failed(exc.args[0] if exc.args else exc)

    def _committed_cb(self, error: rdk.KafkaError | None, partitions: list[Any]) -> None:
        """librdkafka's answer to a commit (``on_commit``, served from ``consume``)."""
        failed = error or next((p.error for p in partitions if p.error is not None), None)
        if failed is not None:
            self._commit_failed(failed)
            return
        self.num_commits += 1
        for p in partitions:
            self._committed[TopicPartition(p.topic, p.partition)] = p.offset

    def _commit_failed(self, error: object) -> None:
        self.num_commit_failures += 1
        if isinstance(error, rdk.KafkaError) and error.code() in _REBALANCED:
            log.warning("commit lost to a rebalance; those events will be delivered again: %s", error)  # fmt: skip
        else:
            # The broker is away (restarting?). Offsets stay committable: the next
            # commit() covers them, and if this process dies first they come again.
            log.warning("commit to %s failed, will retry with the next one: %s", self.bootstrap, error)  # fmt: skip

    def close(self) -> None:
        """Send the offsets marked done and leave the group. Bounded when the broker is
        away: no commit is sent then (those events are delivered again), and librdkafka's
        close, which waits up to a session timeout for a commit still in flight, runs on
        a thread of its own that ``close`` waits for only ``CLOSE_TIMEOUT_S`` (it
        finishes in the background)."""
        if self._closed:
            return
        self._closed = True
        broker_there = True
        try:
            if self._dlq is not None:
                try:
                    self._dlq.flush(CLOSE_TIMEOUT_S)
                except KafkaDeliveryError as exc:
                    log.warning("closing the event source: %s", exc)
                self._dlq.release()
            probe_bootstrap(self.bootstrap, CLOSE_TIMEOUT_S)
            self._send_done(wait=True)
        except KafkaUnavailableError as exc:
            broker_there = False
            log.warning("offsets not committed at close (they are delivered again): %s", exc)
        except Exception as exc:  # noqa: BLE001 - leaving anyway: the events come again
            log.warning("offsets not committed at close (they are delivered again): %s", exc)
        closer = threading.Thread(
            target=self._consumer.close, name="kvwarm-consumer-close", daemon=True
        )
        closer.start()
        closer.join(CLOSE_TIMEOUT_S * (3 if broker_there else 0.2))
        if closer.is_alive():
            log.warning(
                "the event consumer is still leaving its group (a commit waits for a broker "
                "at %s); not waiting for it",
                self.bootstrap,
            )

    def stats(self) -> dict[str, Any]:
        return {
            "messages": self.num_messages,
            "events": self.num_events,
            "dead_letters": self.num_dead_letters,
            "dead_letters_by_reason": dict(self.dead_letters_by_reason),
            "commits": self.num_commits,
            "commit_failures": self.num_commit_failures,
            "fetch_errors": self.num_fetch_errors,
        }

    def __enter__(self) -> KafkaEventSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- producers ------------------------------------------------------------------------------


class _Producer:
    """An idempotent producer (acks=all, librdkafka) that remembers delivery failures
    until ``flush``."""

    def __init__(
        self,
        what: str,
        bootstrap: str,
        topic: str,
        *,
        client_id: str,
        linger_ms: int,
        security: KafkaSecurity | None,
        options: ConnectOptions,
        batch_size_bytes: int = 16_384,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        cfg = {
            **_rd_config(bootstrap, security, options, client_id),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
            "batch.size": batch_size_bytes,
            "message.timeout.ms": int(QUEUE_FULL_WAIT_S * 1000),
        }
        self._producer = rdk.Producer(cfg)
        self._built_s = time.monotonic()
        self._errors: list[str] = []
        self._closed = False
        self.num_sent = 0
        self._warm_metadata(what, options)

    def _warm_metadata(self, what: str, options: ConnectOptions) -> None:
        """Learn the topic's partitions now (the first send would wait for them
        otherwise, with every record behind it), and fail here with
        ``KafkaUnavailableError`` when no broker answers (``_rd_connect``)."""
        _rd_connect(what, self.bootstrap, options, self._producer, self.topic)

    def warm_up(self) -> None:
        """Return once the first record would not wait for the producer's id.

        An idempotent librdkafka producer asks the broker for its producer id when it
        starts; with no broker connection up yet (it is built before it connects), it
        asks again on a 500 ms timer, and its first record waits for that: 498 ms
        against 0.3-0.6 ms for the records after it (a local broker, 2026-12-07). A
        sidecar's first decisions come after its consumer joined its group, later than
        that; a caller that sends at once and times it (``kvwarm bench serve``'s
        producer) calls this first."""
        wait_s = IDEMPOTENCE_START_S - (time.monotonic() - self._built_s)
        if wait_s > 0:
            time.sleep(wait_s)

    def _send(self, key: bytes | None, value: bytes | None) -> None:
        self.send_record(value, key=key)

    def _delivered(self, error: rdk.KafkaError | None, _message: rdk.Message) -> None:
        if error is not None:
            self._errors.append(str(error))

    def send_record(
        self,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        topic: str | None = None,
        partition: int | None = None,
    ) -> None:
        """Any payload with a key and headers, to ``topic`` (default: this producer's) and,
        when given, one ``partition``. Failures surface in ``flush`` like every other
        record. The ZMQ bridge forwards engine events and their dead letters through it.

        When librdkafka's queue is full (the broker away for a while), delivery reports
        are served until there is room, for at most the records' own delivery timeout,
        then ``KafkaDeliveryError``; reports of earlier records are served at each send
        (``poll(0)``), so failures surface before ``flush``."""
        topic = topic or self.topic
        kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": self._delivered}
        if headers:
            kwargs["headers"] = list(headers)
        if partition is not None:
            kwargs["partition"] = partition
        deadline = time.monotonic() + QUEUE_FULL_WAIT_S
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError as exc:
                if time.monotonic() >= deadline:
                    raise KafkaDeliveryError(
                        f"the producer's queue for topic {topic} stayed full for "
                        f"{QUEUE_FULL_WAIT_S:.0f} s: is the broker reachable?"
                    ) from exc
                self._producer.poll(0.1)
        self._producer.poll(0)
        self.num_sent += 1

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every record sent so far is acknowledged (or ``timeout_s`` passes);
        raise if any failed or is still unacknowledged."""
        left = self._producer.flush(-1 if timeout_s is None else timeout_s)
        if self._errors or left:
            errors, self._errors = self._errors, []
            first = errors[0] if errors else f"none acknowledged within {timeout_s} s"
            raise KafkaDeliveryError(
                f"{len(errors) + left} records to topic {self.topic} at {self.bootstrap} were "
                f"not acknowledged; first error: {first}"
            )

    def close(self, timeout_s: float = 30) -> None:
        """Deliver what is queued (raising ``KafkaDeliveryError`` for what could not be),
        within ``timeout_s``, or ``CLOSE_TIMEOUT_S`` when the broker does not accept a
        connection; what is left is dropped, since librdkafka's close would otherwise
        wait the records' whole delivery timeout (120 s) for a broker that is gone."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                probe_bootstrap(self.bootstrap, CLOSE_TIMEOUT_S)
            except KafkaUnavailableError:
                timeout_s = min(timeout_s, CLOSE_TIMEOUT_S)
            self.flush(timeout_s)
        finally:
            self.release()

    def release(self) -> None:
        """Drop what is still queued (after a ``flush`` that said what was lost) and free
        the client."""
        self._closed = True
        self._producer.purge()
        self._producer.close()


class KafkaChangelog(_Producer):
    """A ``serving.state_store.Changelog`` over a compacted topic (one partition, so
    records replay in the order they were written). ``append`` returns once the broker
    acknowledged every record; ``replay`` reads the topic from its beginning."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        security: KafkaSecurity | None = None,
        options: ConnectOptions = ConnectOptions(),
    ) -> None:
        ensure_topics(
            bootstrap,
            {topic: 1},
            configs={topic: {"cleanup.policy": "compact"}},
            security=security,
            options=options,
        )
        super().__init__(
            "changelog producer",
            bootstrap,
            topic,
            client_id="kvwarm-changelog",
            linger_ms=0,
            security=security,
            options=options,
        )
        self._security = security
        self._options = options

    def append(self, records: Iterable[tuple[bytes, bytes | None]]) -> None:
        for key, value in records:
            self.send_record(value, key=key, partition=0)
        self.flush()

    def replay(self) -> Iterator[tuple[bytes, bytes | None]]:
        for record in read_topic(
            self.bootstrap, self.topic, security=self._security, options=self._options
        ):
            if record.key is not None:
                yield record.key, record.value


class SupportsToDict(Protocol):
    def to_dict(self) -> Mapping[str, Any]: ...


class KafkaDecisionSink(_Producer):
    """Decisions to a Kafka topic. ``decision_format`` ``native``: batched, one record
    per flush (the loop flushes once per poll, before committing its offsets), value =
    JSON array of the decisions in emit order, key = the first one's block hash
    (decimal); every ``max_decisions_per_record`` decisions start a new record (each
    stays far below the broker's 1 MB message limit: a decision is ~250 bytes of JSON).
    One record per poll instead of per request: with kafka-python each record woke its
    sender thread, and that hand-off, not the bytes, was what a record cost.
    ``kvhints``: key = message id, value = a hint envelope (``executor.kvhints``).

    Accepts dicts or objects with ``to_dict()``. ``emit`` only queues; ``flush`` is
    where a lost record surfaces, so the loop calls it before ``source.commit()``.
    Producer: linger 5 ms (``flush`` sends at once) and 256 KiB batches (a 16 KiB
    batch holds ~60 decisions), no compression (CPU, not bytes, is what a sidecar
    runs out of).

    With ``ack_topic``, a thread reads the acknowledgements executors or engines publish
    there (``{message_id, results: [{action_id, status}]}``) and counts them in ``acks``
    by status; a malformed one counts as ``malformed``.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        client_id: str = "kvwarm-decisions",
        linger_ms: int = 5,
        batch_size_bytes: int = 262_144,
        max_decisions_per_record: int = 1_000,
        security: KafkaSecurity | None = None,
        options: ConnectOptions = ConnectOptions(),
        decision_format: str = "native",
        ack_topic: str | None = None,
        ack_group_id: str = "kvwarm-acks",
    ) -> None:
        self.format = decision_format_named(decision_format)  # fails before connecting on a typo
        if max_decisions_per_record < 1:
            raise ValueError("max_decisions_per_record must be >= 1")
        super().__init__(
            "decision producer", bootstrap, topic,
            client_id=client_id, linger_ms=linger_ms, security=security, options=options,
            batch_size_bytes=batch_size_bytes,
        )  # fmt: skip
        self.acks: Counter[str] = Counter()
        self._ack_stop = threading.Event()
        self._ack_thread: threading.Thread | None = None
        if ack_topic is not None:
            cfg = {
                **_client_config(bootstrap, security, options, client_id + "-acks"),
                "group_id": ack_group_id,
                "auto_offset_reset": "earliest",
                "enable_auto_commit": True,
                "metadata_max_age_ms": 5_000,
            }
            consumer = _connect("ack consumer", bootstrap, options, lambda: KafkaConsumer(**cfg))
            consumer.partitions_for_topic(ack_topic)  # known before joining (see the source)
            consumer.subscribe([ack_topic])
            # Acks arrive whether or not events do: a thread of its own reads them (the
            # consumer is used by that thread only; counts are plain Counter updates).
            self._ack_thread = threading.Thread(
                target=self._read_acks, args=(consumer,), name="kvwarm-acks", daemon=True
            )
            self._ack_thread.start()
        self.max_decisions_per_record = max_decisions_per_record
        self.num_decisions = 0
        self._pending: list[Mapping[str, Any] | Decision] = []
        self._pending_key: object = None

    def emit(self, decisions: Iterable[Mapping[str, Any] | SupportsToDict]) -> int:
        """Queue decisions; native: sent at ``flush`` (or as soon as a record's worth,
        ``max_decisions_per_record``, is queued). Returns how many."""
        if self.format.name != "native":
            typed = [
                d if isinstance(d, Decision) else Decision.from_dict(dict(d))  # type: ignore[arg-type]
                for d in decisions
            ]
            for key, value in self.format.records(typed):
                self._send(key, value)
            self.num_decisions += len(typed)
            return len(typed)
        batch = self._pending
        count = 0
        for decision in decisions:
            block: object
            if isinstance(decision, Decision):  # msgspec encodes it as its to_dict()
                block = decision.block_hash
                record: Mapping[str, Any] | Decision = decision
            else:
                record = decision if isinstance(decision, Mapping) else decision.to_dict()
                block = record.get("block_hash")
                if block is None:
                    raise ValueError(
                        f"a decision needs a block_hash to key it by, got {dict(record)!r:.200}"
                    )
            if not batch:
                self._pending_key = block
            batch.append(record)
            count += 1
            if len(batch) >= self.max_decisions_per_record:
                self._send_pending()
                batch = self._pending
        self.num_decisions += count
        return count

    def flush(self, timeout_s: float | None = None) -> None:
        """Send the decisions queued since the last flush (one record per
        ``max_decisions_per_record``), then wait until every record is delivered."""
        if self._pending:
            self._send_pending()
        super().flush(timeout_s)

    def _read_acks(self, consumer: KafkaConsumer) -> None:
        """Count acknowledgements until ``close``; a malformed one counts as malformed."""
        try:
            while not self._ack_stop.is_set():
                batch = consumer.poll(timeout_ms=200)
                heal_stalled_join(consumer)
                for records in batch.values():
                    for record in records:
                        try:
                            pairs = parse_ack(msgspec.json.decode(record.value or b""))
                        except (HintError, msgspec.DecodeError) as exc:
                            log.warning("malformed ack at offset %s: %s", record.offset, exc)
                            self.acks["malformed"] += 1
                            continue
                        for _, status in pairs:
                            self.acks[status] += 1
        except Exception:  # a broken ack stream must not take the sink down
            log.exception("ack consumer stopped")
        finally:
            consumer.close()

    def close(self, timeout_s: float = 30) -> None:
        try:
            super().close(timeout_s)
        finally:
            if self._ack_thread is not None:
                self._ack_stop.set()
                self._ack_thread.join(timeout=timeout_s)
                self._ack_thread = None

    def _send_pending(self) -> None:
        batch, self._pending = self._pending, []
        self._send(str(self._pending_key).encode(), msgspec.json.encode(batch))

    def __enter__(self) -> KafkaDecisionSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_decision_record(value: bytes) -> list[dict[str, Any]]:
    """The decisions in one record of a decisions topic: a JSON array (this kvwarm) or
    one decision object (older kvwarm). Raises ``ValueError`` for anything else."""
    try:
        data = msgspec.json.decode(value)
    except msgspec.DecodeError as exc:
        raise ValueError(f"a decision record must be JSON ({exc})") from exc
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list) and all(isinstance(d, dict) for d in data):
        return data
    raise ValueError("a decision record is a JSON array of decision objects")


def prefix_root_key(event: BlocksAccessed) -> bytes:
    """The partition key of an access event: its first block hash (the prefix root), so
    every turn of a conversation lands in the same partition, in order."""
    if event.block_hashes:
        return str(event.block_hashes[0]).encode()
    return event.request_id.encode()


class KafkaEventProducer(_Producer):
    """Access events to a topic as canonical JSON, keyed by prefix root."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        client_id: str = "kvwarm-events",
        linger_ms: int = 5,
        security: KafkaSecurity | None = None,
        options: ConnectOptions = ConnectOptions(),
    ) -> None:
        super().__init__(
            "event producer", bootstrap, topic,
            client_id=client_id, linger_ms=linger_ms, security=security, options=options,
        )  # fmt: skip

    def send_event(self, event: BlocksAccessed) -> None:
        self._send(prefix_root_key(event), msgspec.json.encode(event.to_dict()))

    def send_raw(self, value: bytes | None, key: bytes | None = None) -> None:
        """Any payload, unvalidated (a vLLM KVEventBatch, or test input)."""
        self._send(key, value)

    def __enter__(self) -> KafkaEventProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ProduceReport:
    num_events: int
    num_block_accesses: int
    num_rejected_rows: int
    elapsed_s: float
    rejects_summary: str = ""
    """``RejectLog.summary()``: the most common reject reason with an example."""

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.elapsed_s if self.elapsed_s > 0 else 0.0


def pacing_delay_s(
    index: int,
    ts_ms: int,
    first_ts_ms: int,
    elapsed_s: float,
    *,
    speed: float | None,
    max_rate_per_s: float | None,
) -> float:
    """How long to wait before sending event ``index`` (0 = send now).

    ``speed``: replay trace time scaled (1.0 = real time, 10 = ten times faster);
    ``max_rate_per_s``: at most that many events per second; neither: no waiting.
    """
    if speed is not None:
        due_s = (ts_ms - first_ts_ms) / 1000 / speed
    elif max_rate_per_s is not None:
        due_s = index / max_rate_per_s
    else:
        return 0.0
    return max(0.0, due_s - elapsed_s)


def produce_trace(
    path: str | Path,
    bootstrap: str,
    topic: str,
    *,
    speed: float | None = None,
    max_rate_per_s: float | None = None,
    fmt: str = "auto",
    limit: int | None = None,
    progress: bool = True,
    security: KafkaSecurity | None = None,
    options: ConnectOptions = ConnectOptions(),
    restamp: bool = False,
    time_unit: str = "auto",
) -> ProduceReport:
    """Replay a trace file into ``topic``: real time (``speed=1``), scaled (``speed=X``),
    capped (``max_rate_per_s=N``) or as fast as possible (neither). Rows the decoders
    reject are counted and skipped, as in every file source.

    Events keep the trace's timestamps (event time, what ``serve`` uses by default);
    ``restamp`` stamps each with the wall clock (ms, never decreasing) when it is sent."""
    from tqdm import tqdm

    from features.decoders import RejectLog

    if speed is not None and max_rate_per_s is not None:
        raise ValueError("give either speed or max_rate_per_s, not both")
    if speed is not None and speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if max_rate_per_s is not None and max_rate_per_s <= 0:
        raise ValueError(f"max_rate_per_s must be > 0, got {max_rate_per_s}")
    rejects = RejectLog()
    num_events = num_blocks = 0
    first_ts_ms: int | None = None
    with KafkaEventProducer(bootstrap, topic, security=security, options=options) as producer:
        started = time.monotonic()
        bar = tqdm(total=limit, unit="ev", desc=f"produce {topic}", disable=not progress)
        last_stamp_ms = 0
        for event in read_trace(path, fmt=fmt, rejects=rejects, time_unit=time_unit):
            if limit is not None and num_events >= limit:
                break
            if first_ts_ms is None:
                first_ts_ms = event.ts_ms
            wait_s = pacing_delay_s(
                num_events, event.ts_ms, first_ts_ms, time.monotonic() - started,
                speed=speed, max_rate_per_s=max_rate_per_s,
            )  # fmt: skip
            if wait_s > 0.001:
                time.sleep(wait_s)
            if restamp:
                last_stamp_ms = max(last_stamp_ms, int(time.time() * 1000))
                event = replace(event, ts_ms=last_stamp_ms)
            producer.send_event(event)
            num_events += 1
            num_blocks += len(event.block_hashes)
            bar.update(1)
        producer.flush()
        bar.close()
        elapsed_s = time.monotonic() - started
    return ProduceReport(num_events, num_blocks, rejects.total, elapsed_s, rejects.summary())


# --- reading a topic without a group ------------------------------------------------------


@dataclass(frozen=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp_ms: int


def read_topic(
    bootstrap: str,
    topic: str,
    *,
    timeout_s: float = 30,
    security: KafkaSecurity | None = None,
    options: ConnectOptions = ConnectOptions(),
) -> list[RawRecord]:
    """Every record in ``topic`` now (beginning to the current end of each partition),
    read without joining a group: for inspecting dead letters and for tests."""
    cfg = {**_client_config(bootstrap, security, options, "kvwarm-reader"), "group_id": None}
    consumer = _connect("topic reader", bootstrap, options, lambda: KafkaConsumer(**cfg))
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return []
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: list[RawRecord] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise KafkaError(
                    f"reading {topic} at {bootstrap} did not reach its end in {timeout_s} s"
                )
            for records in consumer.poll(timeout_ms=200).values():
                out.extend(
                    RawRecord(
                        r.topic,
                        r.partition,
                        r.offset,
                        r.key,
                        r.value,
                        dict(r.headers or []),
                        r.timestamp,
                    )  # fmt: skip
                    for r in records
                )
        return out
    finally:
        consumer.close(autocommit=False)
