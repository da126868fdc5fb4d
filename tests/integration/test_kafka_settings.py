"""The broker-free parts of serving.kafka_io: security pass-through and replay pacing.
(Kept beside the broker tests so that every test importing kafka_io is in one place;
these need no broker and are not marked integration.)"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.kafka_io import KafkaSecurity, pacing_delay_s


def test_plaintext_by_default_and_sasl_ssl_passed_through(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KafkaSecurity().client_config() == {"security_protocol": "PLAINTEXT"}
    monkeypatch.setenv("KVWARM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KVWARM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("KVWARM_KAFKA_SASL_USERNAME", "kvwarm")
    monkeypatch.setenv("KVWARM_KAFKA_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("KVWARM_KAFKA_SSL_CAFILE", "/etc/ssl/ca.pem")
    security = KafkaSecurity()
    assert security.client_config() == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "kvwarm",
        "sasl_plain_password": "s3cret",
        "ssl_check_hostname": True,
        "ssl_cafile": "/etc/ssl/ca.pem",
    }
    assert "s3cret" not in repr(security) and "s3cret" not in str(security.model_dump())


def test_sasl_without_a_mechanism_says_what_to_set() -> None:
    with pytest.raises(ValueError, match="KVWARM_KAFKA_SASL_MECHANISM"):
        KafkaSecurity(security_protocol="SASL_PLAINTEXT").client_config()
    with pytest.raises(ValidationError):
        KafkaSecurity(security_protocol="TLS")  # type: ignore[arg-type]


def test_pacing_real_time_scaled_capped_and_unpaced() -> None:
    # Event 3 s of trace time after the first, 1 s into the replay.
    args = {"index": 10, "ts_ms": 13_000, "first_ts_ms": 10_000, "elapsed_s": 1.0}
    assert pacing_delay_s(**args, speed=1.0, max_rate_per_s=None) == pytest.approx(2.0)
    assert pacing_delay_s(**args, speed=10.0, max_rate_per_s=None) == 0.0  # due at 0.3 s: late
    assert pacing_delay_s(**args, speed=2.0, max_rate_per_s=None) == pytest.approx(0.5)
    assert pacing_delay_s(**args, speed=None, max_rate_per_s=5.0) == pytest.approx(
        1.0
    )  # 10th at 2 s
    assert pacing_delay_s(**args, speed=None, max_rate_per_s=None) == 0.0
