"""``SidecarSettings``: the one frozen settings object of ``kvwarm serve``.

Where a value comes from, highest priority first:

1. keyword arguments (what ``kvwarm serve`` flags set),
2. environment variables ``KVWARM_<FIELD>`` (nested planner fields:
   ``KVWARM_PLANNER__EVICTION_SAMPLE``),
3. a config file (TOML or YAML, by suffix) named by ``load_settings(config_path=...)``
   or ``KVWARM_CONFIG``,
4. the defaults below.

Every field has a default, a constraint and a description. Secrets are ``SecretStr``:
never printed, never logged. Kafka security (SASL/TLS) is not repeated here: it is read
by ``serving.kafka_io.KafkaSecurity`` from ``KVWARM_KAFKA_*``.

Endpoint specs are validated here, so a typo fails at start with the list of valid forms:

- source: ``kafka://HOST:PORT/TOPIC`` | ``kafka:TOPIC`` (the local broker, see
  ``local_bootstrap``) | ``file:PATH`` | ``zmq://HOST:PORT[?...]``
- model: a policy name (``lru``, ``lfu``, ``prefix_lru``), a saved-policy directory or
  a model file inside one, or an MLflow URI (``models:/NAME@ALIAS``,
  ``models:/NAME/VERSION``, ``runs:/RUN_ID/model``)
- executor: ``local:CONFIG.toml`` | ``sim:PROFILE`` | ``none``
- decisions: ``kafka://HOST:PORT/TOPIC`` | ``kafka:TOPIC`` | ``file:PATH`` (any number)

Kafka defaults every command shares (``serve``, ``produce``, ``bridge``): the topics
``DEFAULT_EVENTS_TOPIC``, ``DEFAULT_DECISIONS_TOPIC`` and ``<topic>.dlq``, and the
bootstrap address ``local_bootstrap()`` when none is given.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from executor.adapters.lmcache import params_from_url
from serving import defaults
from serving.planner import PlannerParams

DEFAULT_EVENTS_TOPIC = "kv-events"
"""Topic of access and residency events: what ``produce`` and ``bridge`` write and
``serve`` reads unless told otherwise."""

DEFAULT_DECISIONS_TOPIC = "kv-decisions"
"""Topic the README's examples publish decisions to."""

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
"""Where a local broker listens when nothing else is said (``kvwarm kafka up`` takes
9092 when it is free)."""

BOOTSTRAP_ENV = "KVWARM_KAFKA_BOOTSTRAP"


def project_root() -> Path:
    """The repository root when running from a checkout, else the working directory."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def bootstrap_file() -> Path:
    """The file ``kvwarm kafka up`` writes the local broker's ``HOST:PORT`` to (and
    ``kafka down`` removes): ``$KVWARM_CACHE_DIR/kafka/bootstrap`` or
    ``<repo>/.cache/kafka/bootstrap``."""
    base = os.environ.get("KVWARM_CACHE_DIR")
    return (Path(base) if base else project_root() / ".cache") / "kafka" / "bootstrap"


def local_bootstrap() -> str:
    """The Kafka address used when a command is given none, called when an endpoint is
    parsed: ``$KVWARM_KAFKA_BOOTSTRAP``, else what ``kvwarm kafka up`` wrote to
    ``bootstrap_file()``, else ``DEFAULT_BOOTSTRAP``."""
    env = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if env:
        return env
    try:
        written = bootstrap_file().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        written = ""
    return written if re.fullmatch(r"[\w.\-]+:\d{1,5}", written) else DEFAULT_BOOTSTRAP


CONFIG_ENV = "KVWARM_CONFIG"
"""Environment variable naming a config file when none is passed explicitly."""

_CONFIG_PATH: ContextVar[Path | None] = ContextVar("kvwarm_config_path", default=None)


class SettingsError(ValueError):
    """A setting is malformed; the message names it and lists the valid forms."""


def mask_credentials(value: Any) -> Any:
    """``value`` (a settings dump: strings, lists, dicts) with the ``user:password@`` of
    every URI replaced by ``***@``, so settings can be printed or logged."""
    if isinstance(value, str):
        return re.sub(r"(://)[^/@\s]+@", r"\1***@", value)
    if isinstance(value, list):
        return [mask_credentials(v) for v in value]
    if isinstance(value, dict):
        return {k: mask_credentials(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint spec: ``scheme`` plus either a Kafka address and topic or a path."""

    scheme: Literal["kafka", "file", "zmq", "local", "sim", "lmcache", "none"]
    target: str
    """Path (file/local), profile (sim), full URL (zmq, lmcache), or ``HOST:PORT`` (kafka)."""
    topic: str = ""


SOURCE_FORMS = (
    "kafka://HOST:PORT/TOPIC, kafka:TOPIC (local broker), file:PATH or "
    "zmq://HOST:PORT[?topic=..&replay=..]"
)
SINK_FORMS = "kafka://HOST:PORT/TOPIC, kafka:TOPIC (local broker) or file:PATH"
EXECUTOR_FORMS = (
    "local:CONFIG.toml, sim:PROFILE, lmcache:http://HOST:PORT?instance=ID&model=NAME or none"
)


def _kafka(spec: str, what: str, forms: str) -> Endpoint:
    if not spec.startswith("kafka://"):  # kafka:TOPIC: the local broker
        topic = spec[len("kafka:") :]
        if not topic or "/" in topic or ":" in topic:
            raise SettingsError(f"{what} {spec!r} is not kafka:TOPIC; use {forms}")
        return Endpoint("kafka", local_bootstrap(), topic)
    rest = spec[len("kafka://") :]
    host_port, _, topic = rest.partition("/")
    if not host_port or ":" not in host_port or not topic or "/" in topic:
        raise SettingsError(f"{what} {spec!r} is not kafka://HOST:PORT/TOPIC; use {forms}")
    return Endpoint("kafka", host_port, topic)


def parse_source(spec: str) -> Endpoint:
    """Parse ``--source``; raises ``SettingsError`` naming the valid forms."""
    if spec.startswith("kafka:"):
        return _kafka(spec, "source", SOURCE_FORMS)
    if spec.startswith("file:") and len(spec) > 5:
        return Endpoint("file", spec[5:])
    if spec.startswith("zmq://") and len(spec) > 6:
        return Endpoint("zmq", spec)
    raise SettingsError(f"source {spec!r} is not understood; use {SOURCE_FORMS}")


def parse_sink(spec: str) -> Endpoint:
    """Parse one ``--decisions`` target."""
    if spec.startswith("kafka:"):
        return _kafka(spec, "decisions target", SINK_FORMS)
    if spec.startswith("file:") and len(spec) > 5:
        return Endpoint("file", spec[5:])
    raise SettingsError(f"decisions target {spec!r} is not understood; use {SINK_FORMS}")


def parse_executor(spec: str) -> Endpoint:
    """Parse ``--executor``."""
    if spec == "none":
        return Endpoint("none", "")
    for scheme in ("local", "sim"):
        prefix = scheme + ":"
        if spec.startswith(prefix) and len(spec) > len(prefix):
            return Endpoint(scheme, spec[len(prefix) :])  # type: ignore[arg-type]
    if spec.startswith("lmcache:"):
        url = spec[len("lmcache:") :]
        try:
            params_from_url(url)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        return Endpoint("lmcache", url)
    raise SettingsError(f"executor {spec!r} is not understood; use {EXECUTOR_FORMS}")


class SidecarSettings(BaseSettings):
    """Everything ``kvwarm serve`` can be told. Frozen: build a new one to change it."""

    model_config = SettingsConfigDict(
        env_prefix="KVWARM_",
        env_nested_delimiter="__",
        frozen=True,
        # Other KVWARM_* variables (KVWARM_KAFKA_*, KVWARM_LOG_LEVEL ...) belong to others.
        extra="ignore",
        validate_default=True,
    )

    # -- endpoints ---------------------------------------------------------------------
    source: str = Field(
        f"kafka:{DEFAULT_EVENTS_TOPIC}",
        description=f"Where access and residency events come from: {SOURCE_FORMS}.",
    )
    model_fallback: Literal["none", "lru"] = Field(
        "none",
        description="What to do when the model cannot be loaded at start: 'none' "
        "(default) exits with the reason; 'lru' serves LRU and /healthz reports degraded. "
        "A later reload that fails always keeps the model already serving.",
    )
    model: str = Field(
        "lru",
        description="The scoring policy: a baseline name (lru, lfu, lru2, lru_2hit, prefix_lru), a saved "
        "policy directory or a file in one, or an MLflow URI (models:/NAME@ALIAS). A model "
        "that fails to load, or whose feature version differs, is replaced by LRU and "
        "/healthz reports degraded.",
    )
    executor: str = Field(
        "none",
        description=f"Who applies decisions on this node: {EXECUTOR_FORMS}. 'none' only "
        "publishes them.",
    )
    # NoDecode: the env var is a comma-separated list, not JSON.
    decisions: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description=f"Where decisions are published besides the executor, any number of {SINK_FORMS}.",
    )
    decisions_format: Literal["native", "kvhints"] = Field(
        "native",
        description="Record format of every decisions sink: kvwarm's own decision JSON, or "
        "the KV hint envelope engines accept (executor/kvhints.py).",
    )
    decisions_ack_topic: str | None = Field(
        None,
        min_length=1,
        description="Kafka topic where executors/engines acknowledge hints; Kafka decision "
        "sinks read and count them (kvwarm_hint_acks_total).",
    )
    engine_id: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="The engine this sidecar serves: events naming another engine are "
        "dropped (counted), so one engine's residency and accesses meet in one view.",
    )
    rejects_path: Path | None = Field(
        None, description="File source and ZMQ: where malformed input is written (JSONL)."
    )
    kafka_group_id: str = Field(
        "kvwarm-sidecar",
        min_length=1,
        max_length=249,
        description="Consumer group of a Kafka source; sidecars of one group share partitions.",
    )
    kafka_group_instance_id: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        description="Static group membership (KIP-345): a stable id per sidecar lets a "
        "restarted process take its partitions back at once instead of after the session "
        "timeout.",
    )
    kafka_dead_letter_topic: str | None = Field(
        None, description="Dead-letter topic of a Kafka source (default: SOURCE_TOPIC.dlq)."
    )
    kafka_commit_interval_ms: int = Field(
        100,
        ge=0,
        le=60_000,
        description="Kafka source: send the consumed offsets to the broker at most this "
        "often (after the decisions of every event up to them are delivered; a quiet "
        "stream and shutdown send them too). A crash or a rebalance redelivers what was "
        "handled since (at least once). 0: after every batch "
        "(serving.kafka_io.KafkaEventSource).",
    )
    state_topic: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Kafka source: keep the sidecar's state per partition and checkpoint it "
        "to this compacted topic (on the source's broker), so a restarted sidecar, or the "
        "one a partition moves to, resumes with the same state and re-emits the same "
        "decision ids (serving/shards.py). Off by default.",
    )
    state_checkpoint_interval_s: float = Field(
        30.0,
        ge=0,
        le=86_400,
        description="Least time between two checkpoints of one partition's state (0: at "
        "every commit). A partition is also checkpointed at its first commit and when a "
        "rebalance takes it away; a restart re-handles the events after its last one.",
    )

    # -- tiers and planner ---------------------------------------------------------------
    tier_names: tuple[str, ...] = Field(
        ("hbm", "dram", "nvme"),
        min_length=1,
        max_length=4,
        description="Tiers the planner manages, fastest first (hbm, dram, nvme, remote). "
        "An executor with its own tier configuration overrides this.",
    )
    tier_capacities_blocks: tuple[int, ...] = Field(
        (4_096, 32_768, 262_144),
        min_length=1,
        max_length=4,
        description="Capacity of each tier in blocks, same order as tier_names. An executor "
        "configuration in bytes overrides this (capacity_bytes // block_size_bytes).",
    )
    block_size_bytes: int = Field(
        1 << 20,
        ge=1,
        description="Payload bytes of one KV block; converts executor capacities to blocks "
        "and sizes the payloads a local executor writes.",
    )
    planner: PlannerParams = Field(
        default_factory=PlannerParams,
        description="Eviction sample, admission veto, prefetch budget, hysteresis, batched "
        "eviction (serving.planner.PlannerParams).",
    )
    prefetch: bool = Field(True, description="Run speculative prefetch rounds.")
    guard: bool = Field(
        True,
        description="Serve a learned model behind the online guard: ghost caches estimate "
        "what the model, LRU, LFU and LRU-2 would hit on the live stream and the best one scores "
        "(predictor.guard). Baselines are served as they are.",
    )
    prefetch_interval_ms: int = Field(
        defaults.PREFETCH_INTERVAL_MS,
        ge=1,
        le=3_600_000,
        description="Time between speculative prefetch rounds.",
    )
    prefetch_split: bool = Field(
        True,
        description="Spread each prefetch round over the events after the one that starts "
        "it, one step per event (name the candidates, score them, fill each target tier), "
        "so no single event's latency carries a whole round. Off: the round runs inline, as "
        "replay runs it. Ignored with state_topic (a checkpoint holds no round under way).",
    )
    score_max_age_ms: int | None = Field(
        10_000,
        ge=0,
        le=3_600_000,
        description="Serving only: a learned model's score of a block (and its chain "
        "model's prediction of a chain) is kept and reused while the block is not accessed "
        "again (the chain not continued) and at most this old; 0 recomputes every score "
        "(exact, what replay evaluates), none keeps the saved model's own setting. Shared "
        "trace, 5%, single tier: 10 s halved the model rows per access at an unchanged hit "
        "ratio; in the sidecar it makes a prefetch round rescore only what changed.",
    )
    recent_requests: int = Field(
        defaults.RECENT_REQUESTS,
        ge=1,
        le=100_000,
        description="Prefetch candidates are the blocks of this many most recent requests; "
        "bounds the candidate set.",
    )
    decision_deadline_ms: int = Field(
        5_000,
        ge=1,
        description="A decision is useless this long after it is made (deadline_ms = ts_ms + this).",
    )

    # -- loop ----------------------------------------------------------------------------
    clock: Literal["wall", "event"] = Field(
        "event",
        description="What 'now' is for features, planner and timers. 'event' (default): "
        "the newest event's own timestamp, as in training and replay, so the same events "
        "give the same decisions from a file or from Kafka; the wall clock only measures "
        "lag. 'wall': the wall clock, for producers that stamp events with the wall clock "
        "and a model that should see idle time between events; events whose timestamps "
        "are far from the wall clock are then refused at start.",
    )
    time_unit: Literal["auto", "s", "ms", "us", "ns"] = Field(
        "auto",
        description="Unit of a file source's timestamps; 'auto' decides by magnitude "
        "(features.decoders.TIME_UNITS).",
    )
    batch_size: int = Field(
        1_024,
        ge=1,
        le=1_000_000,
        description="Most events handled between two flush+commit points. Bounds memory and "
        "the redelivery window after a crash.",
    )
    target_batch_latency_ms: float = Field(
        20.0,
        gt=0,
        le=60_000,
        description="Batches are sized so that handling one and delivering its decisions "
        "takes about this long (measured cost per event); batch_size is the upper bound.",
    )
    poll_timeout_ms: int = Field(
        100, ge=0, le=60_000, description="How long one poll waits for events."
    )
    gc_max_interval_s: float = Field(
        60.0,
        ge=0.0,
        le=600.0,
        description="Full garbage collections run between batches, when the source is idle "
        "or at least this often under load, instead of inside a batch when allocations "
        "trigger one (serving.gc_pacer: those walked all of serving's state, 84-223 ms "
        "stalls). 0: CPython's own schedule.",
    )

    # -- model lifecycle -------------------------------------------------------------------
    model_poll_interval_s: float = Field(
        30.0,
        ge=0.0,
        description="How often an MLflow alias is checked for a new version (0: never).",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking/registry URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory).",
    )
    mlflow_tracking_token: SecretStr | None = Field(
        None,
        description="Bearer token for a remote MLflow server; serve hands it to the MLflow "
        "client as MLFLOW_TRACKING_TOKEN.",
    )

    # -- HTTP ------------------------------------------------------------------------------
    http_enabled: bool = Field(True, description="Serve /healthz, /readyz and /metrics.")
    http_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the HTTP endpoints bind to; loopback unless exposed on purpose.",
    )
    http_port: int = Field(9464, ge=0, le=65535, description="HTTP port (0: any free port).")
    request_intake: bool = Field(
        True, description="Take request events on POST /v1/requests (needs http_enabled)."
    )
    tokenizer_path: Path | None = Field(
        None,
        description="The engine model's tokenizer.json: lets POST /v1/requests take text "
        "instead of token ids (needs the 'tokenizers' package).",
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        parse_source(value)
        return value

    @field_validator("executor")
    @classmethod
    def _check_executor(cls, value: str) -> str:
        parse_executor(value)
        return value

    @field_validator("decisions", mode="before")
    @classmethod
    def _split_decisions(cls, value: Any) -> Any:
        if isinstance(value, str):  # env var: comma-separated
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @field_validator("decisions")
    @classmethod
    def _check_decisions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for spec in value:
            parse_sink(spec)
        return value

    @field_validator("tier_names")
    @classmethod
    def _check_tiers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        order = ("hbm", "dram", "nvme", "remote")
        for name in value:
            if name not in order:
                raise SettingsError(f"unknown tier {name!r}; use {', '.join(order)}")
        ranks = [order.index(n) for n in value]
        if ranks != sorted(set(ranks)):
            raise SettingsError(f"tier_names must be distinct and fastest first, got {value}")
        return value

    @model_validator(mode="after")
    def _check_capacities(self) -> SidecarSettings:
        if len(self.tier_capacities_blocks) != len(self.tier_names):
            raise SettingsError(
                f"tier_capacities_blocks has {len(self.tier_capacities_blocks)} entries for "
                f"{len(self.tier_names)} tiers {self.tier_names}; give one per tier"
            )
        if any(c < 1 for c in self.tier_capacities_blocks):
            raise SettingsError("every tier capacity must be >= 1 block")
        return self

    @property
    def source_endpoint(self) -> Endpoint:
        return parse_source(self.source)

    @property
    def executor_endpoint(self) -> Endpoint:
        return parse_executor(self.executor)

    @property
    def decision_endpoints(self) -> list[Endpoint]:
        return [parse_sink(s) for s in self.decisions]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _CONFIG_PATH.get()
        if path is not None:
            if path.suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(
    config_path: str | os.PathLike[str] | None = None, **overrides: Any
) -> SidecarSettings:
    """Build the settings: ``overrides`` > ``KVWARM_*`` env > config file > defaults.

    ``config_path`` (or ``KVWARM_CONFIG``) names a ``.toml``, ``.yaml`` or ``.yml`` file
    whose keys are the field names. ``None`` overrides are ignored (unset CLI flags).
    """
    raw = config_path if config_path is not None else os.environ.get(CONFIG_ENV)
    path = Path(raw) if raw else None
    if path is not None:
        if path.suffix not in (".toml", ".yaml", ".yml"):
            raise SettingsError(f"config file {path} must end in .toml, .yaml or .yml")
        if not path.is_file():
            raise SettingsError(
                f"config file {path} does not exist; check {CONFIG_ENV} or --config"
            )
        _check_config_keys(path)
    token = _CONFIG_PATH.set(path)
    try:
        return SidecarSettings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _CONFIG_PATH.reset(token)


def _check_config_keys(path: Path) -> None:
    """Refuse a config file with a key that is no setting (a typo would otherwise be
    silently ignored); nested planner keys are checked by ``PlannerParams`` itself."""
    try:
        if path.suffix == ".toml":
            import tomllib

            data: Any = tomllib.loads(path.read_text(encoding="utf-8"))
        else:
            import yaml

            data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception as exc:  # tomllib, yaml and UnicodeDecodeError all land here
        raise SettingsError(f"config file {path} cannot be parsed: {exc}".splitlines()[0]) from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a table of settings")
    unknown = sorted(set(data) - set(SidecarSettings.model_fields))
    if unknown:
        raise SettingsError(
            f"config file {path}: unknown setting(s) {', '.join(unknown)}; valid: "
            f"{', '.join(sorted(SidecarSettings.model_fields))}"
        )
