from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.planner import DEFAULT_EVICT_AHEAD_VISITS, PlannerParams
from serving.settings import (
    SettingsError,
    SidecarSettings,
    load_settings,
    parse_executor,
    parse_sink,
    parse_source,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("KVWARM_"):
            monkeypatch.delenv(key)


def test_every_field_has_a_default_and_a_description():
    settings = SidecarSettings()
    for name, field in SidecarSettings.model_fields.items():
        assert field.description, f"{name} has no description"
        assert getattr(settings, name) is not None or field.default is None
    assert settings.http_host == "127.0.0.1"


def test_priority_is_flags_then_env_then_file(tmp_path, monkeypatch):
    config = tmp_path / "sidecar.toml"
    config.write_text(
        'source = "file:events.jsonl"\nbatch_size = 7\nhttp_port = 1111\n'
        "tier_names = ['hbm', 'dram']\ntier_capacities_blocks = [10, 20]\n"
        "[planner]\neviction_sample = 8\n"
    )
    monkeypatch.setenv("KVWARM_HTTP_PORT", "2222")
    monkeypatch.setenv("KVWARM_PLANNER__PREFETCH_BUDGET_BLOCKS", "5")
    settings = load_settings(config, batch_size=9, model=None)
    assert settings.batch_size == 9  # flag beats file
    assert settings.http_port == 2222  # env beats file
    assert settings.source == "file:events.jsonl"  # file beats default
    assert settings.tier_capacities_blocks == (10, 20)
    # Nested planner fields merge across file and env.
    assert settings.planner.eviction_sample == 8
    assert settings.planner.prefetch_budget_blocks == 5
    assert settings.planner.min_residency_ms == 2_000  # fields not given keep their defaults
    assert settings.planner.evict_ahead_visits == DEFAULT_EVICT_AHEAD_VISITS  # the sidecar's
    assert settings.model == "lru"  # a None flag is "not given"


def test_the_sidecar_batches_eviction_unless_told_otherwise(tmp_path, monkeypatch):
    # Replay and the sidecar batch alike; naming other planner keys (env, file) keeps it.
    assert PlannerParams().evict_ahead_visits == DEFAULT_EVICT_AHEAD_VISITS > 0
    assert SidecarSettings().planner.evict_ahead_visits == DEFAULT_EVICT_AHEAD_VISITS
    monkeypatch.setenv("KVWARM_PLANNER__EVICTION_SAMPLE", "32")
    settings = load_settings()
    assert settings.planner.eviction_sample == 32
    assert settings.planner.evict_ahead_visits == DEFAULT_EVICT_AHEAD_VISITS
    monkeypatch.setenv("KVWARM_PLANNER__EVICT_AHEAD_VISITS", "0")
    assert load_settings().planner.evict_ahead_visits == 0
    monkeypatch.delenv("KVWARM_PLANNER__EVICT_AHEAD_VISITS")
    config = tmp_path / "sidecar.toml"
    config.write_text("[planner]\nevict_ahead_visits = 3\n")
    assert load_settings(config).planner.evict_ahead_visits == 3
    # A PlannerParams given whole is taken as it is.
    given = PlannerParams(evict_ahead_visits=0)
    assert load_settings(planner=given).planner.evict_ahead_visits == 0


def test_yaml_config_and_kvwarm_config_env(tmp_path, monkeypatch):
    config = tmp_path / "sidecar.yaml"
    config.write_text("executor: sim:default\ndecisions: ['file:out.jsonl']\n")
    monkeypatch.setenv("KVWARM_CONFIG", str(config))
    settings = load_settings()
    assert settings.executor_endpoint.scheme == "sim"
    assert [e.target for e in settings.decision_endpoints] == ["out.jsonl"]


def test_decisions_from_env_are_comma_separated(monkeypatch):
    monkeypatch.setenv("KVWARM_DECISIONS", "file:a.jsonl, kafka://127.0.0.1:9092/decisions")
    settings = load_settings()
    assert [(e.scheme, e.target, e.topic) for e in settings.decision_endpoints] == [
        ("file", "a.jsonl", ""),
        ("kafka", "127.0.0.1:9092", "decisions"),
    ]


def test_frozen_and_secrets_hidden(monkeypatch):
    monkeypatch.setenv("KVWARM_MLFLOW_TRACKING_TOKEN", "s3cret-token")
    settings = load_settings()
    assert "s3cret-token" not in repr(settings) and "s3cret-token" not in str(settings.model_dump())
    assert settings.mlflow_tracking_token.get_secret_value() == "s3cret-token"
    with pytest.raises(ValidationError):
        settings.batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("source", "http://nope", "kafka://HOST:PORT/TOPIC"),
        ("source", "kafka://nohostport/topic", "kafka://HOST:PORT/TOPIC"),
        ("executor", "gpu:0", "local:CONFIG.toml"),
        ("decisions", ("zmq://x:1",), "file:PATH"),
        ("tier_names", ("dram", "hbm"), "fastest first"),
        ("tier_names", ("ssd",), "unknown tier"),
        ("tier_capacities_blocks", (1, 2, 3, 4), "one per tier"),
        ("batch_size", 0, "greater than or equal to 1"),
    ],
)
def test_bad_values_fail_with_what_to_do(field, value, hint):
    with pytest.raises(ValidationError, match=hint):
        load_settings(**{field: value})


def test_missing_or_unknown_config_file(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")
    bad = tmp_path / "sidecar.ini"
    bad.write_text("x")
    with pytest.raises(SettingsError, match=".toml, .yaml or .yml"):
        load_settings(bad)


def test_endpoint_parsers():
    assert parse_source("kafka://127.0.0.1:9092/events").topic == "events"
    assert parse_source("file:/x/y.jsonl").target == "/x/y.jsonl"
    assert parse_source("zmq://127.0.0.1:5557?topic=kv").target.startswith("zmq://")
    assert parse_sink("file:d.jsonl").scheme == "file"
    assert parse_executor("local:cfg.toml").target == "cfg.toml"
    assert parse_executor("none").scheme == "none"
    with pytest.raises(SettingsError, match="kafka:TOPIC .local broker. or file:PATH"):
        parse_sink("kafka://127.0.0.1:9092/")


def test_kafka_topic_shorthand_uses_the_local_broker(monkeypatch, tmp_path):
    from serving.settings import DEFAULT_BOOTSTRAP, bootstrap_file, local_bootstrap

    monkeypatch.delenv("KVWARM_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path))
    assert local_bootstrap() == DEFAULT_BOOTSTRAP
    assert parse_source("kafka:kv-events").target == DEFAULT_BOOTSTRAP
    bootstrap_file().parent.mkdir(parents=True)
    bootstrap_file().write_text("127.0.0.1:39092\n")  # what `kvwarm kafka up` writes
    assert parse_source("kafka:kv-events") == parse_source("kafka://127.0.0.1:39092/kv-events")
    monkeypatch.setenv("KVWARM_KAFKA_BOOTSTRAP", "broker:9093")
    assert parse_sink("kafka:kv-decisions").target == "broker:9093"
    # The default source is the default topic every command shares.
    assert load_settings(None).source_endpoint.topic == "kv-events"


def test_unknown_config_keys_are_refused(tmp_path):
    config = tmp_path / "sidecar.toml"
    config.write_text("batch_sise = 64\n")
    with pytest.raises(SettingsError, match="unknown setting.*batch_sise.*batch_size"):
        load_settings(config)
    config.write_text("[planner]\neviction_sampel = 3\n")
    with pytest.raises(ValueError, match="eviction_sampel"):
        load_settings(config)


def test_features_run_on_event_time_by_default():
    assert load_settings(None).clock == "event"
