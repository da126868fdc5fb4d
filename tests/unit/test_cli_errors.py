"""Every common mistake with the CLI ends in one line on stderr that says what is wrong
and what to do, with exit 2 for usage errors and 1 for runtime errors: no traceback,
no page of client logs, and not the catch-all line kept for unexpected exceptions.

The cases are the bad inputs new users actually hit (issue 16), across ``serve``,
``replay``, ``train``, ``produce``, ``bridge`` and ``stats``. Each runs the real command
(in process, through ``serving.cli.main``) against real files and real sockets.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from features.generator import generate_to_file, params_for
from serving.cli import main

CATCH_ALL = "run with -v for the traceback"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-errors")
    binary = root / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    empty = root / "empty.jsonl"
    empty.write_text("")
    bad_rows = root / "bad.jsonl"
    bad_rows.write_text('{"timestamp": "soon", "input_length": 1, "hash_ids": [1]}\n' * 5)
    typo = root / "sidecar.toml"
    typo.write_text("batch_sise = 64\nhttp_port = 0\n")
    trace = generate_to_file(params_for("chat", num_requests=40, seed=1), root / "t.jsonl")
    return {
        "binary": binary,
        "empty": empty,
        "bad_rows": bad_rows,
        "typo_config": typo,
        "trace": trace,
        "missing": root / "missing.jsonl",
        "root": root,
    }


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other process (here: this test) already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def run(args: list[str], **env: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, env=env or None)
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), f"{args}: escaped {result.exception!r}"
    return result.exit_code, result.stderr


def assert_one_line(code: int, stderr: str, expected_code: int, *needles: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == expected_code, stderr
    assert len(lines) == 1, stderr
    line = lines[0]
    assert "Traceback" not in stderr and CATCH_ALL not in line, line
    assert ": error: " in line, line
    for needle in needles:
        assert needle in line, line
    return line


# -- serve ---------------------------------------------------------------------------


def test_serve_missing_and_binary_files(files):
    code, err = run(["serve", "--source", f"file:{files['missing']}", "--http-port", "0"])
    assert_one_line(code, err, 1, "no such trace file", "missing.jsonl")
    code, err = run(["serve", "--source", f"file:{files['binary']}", "--http-port", "0"])
    assert_one_line(code, err, 1, "binary data", "JSONL or CSV")


def test_serve_missing_sim_profile(files):
    code, err = run(
        ["serve", "--source", f"file:{files['trace']}", "--executor", "sim:nope.toml",
         "--http-port", "0"]
    )  # fmt: skip
    assert_one_line(code, err, 1, "sim:nope.toml", "sim:default")


def test_serve_http_port_in_use_names_the_port(files, busy_port):
    code, err = run(["serve", "--source", f"file:{files['trace']}", "--http-port", str(busy_port)])
    assert_one_line(code, err, 1, f"127.0.0.1:{busy_port}", "--http-port 0")


def test_serve_unknown_model_fails_unless_fallback(files):
    args = ["serve", "--source", f"file:{files['trace']}", "--model", "lgbm", "--http-port", "0"]
    code, err = run(args)
    assert_one_line(code, err, 1, "'lgbm'", "lightgbm", "--fallback lru")
    code, err = run([*args, "--fallback", "lru"])
    assert code == 0, err
    assert "degraded" in err


def test_serve_unknown_config_key_and_bad_values(files):
    code, err = run(["serve", "--config", str(files["typo_config"])])
    assert_one_line(code, err, 2, "batch_sise", "batch_size")
    code, err = run(["serve", "--source", "http://x"])
    assert_one_line(code, err, 2, "kafka:TOPIC", "file:PATH")
    code, err = run(["serve", "--http-port", "-1"])
    assert_one_line(code, err, 2, "--http-port")


def test_serve_unreachable_broker_is_one_line():
    address = f"127.0.0.1:{free_port()}"
    code, err = run(["serve", "--source", f"kafka://{address}/kv-events", "--http-port", "0"])
    assert_one_line(code, err, 1, f"no Kafka broker at {address}", "kvwarm kafka up")


# -- replay, train, stats ---------------------------------------------------------------


def test_replay_missing_profile_unknown_model_and_modes(files, tmp_path, monkeypatch):
    trace = str(files["trace"])
    code, err = run(["replay", "--trace", trace, "--profile", "nope.toml"])
    assert_one_line(code, err, 2, "nope.toml", "--profile")
    code, err = run(["replay", "--trace", trace, "--modes", "both"])
    assert_one_line(code, err, 2, "single,tiered")

    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    code, err = run(
        ["replay", "--trace", trace, "--model", "lightgbm=models:/nope@champion"],
        MLFLOW_TRACKING_URI=f"sqlite:///{store / 'mlflow.db'}",
    )
    assert_one_line(code, err, 1, "models:/nope@champion", "kvwarm train")
    assert list(tmp_path.iterdir()) == []  # a failed lookup creates no store, no folder


def test_replay_and_stats_on_traces_without_valid_rows(files):
    code, err = run(["replay", "--trace", str(files["empty"]), "--experiment", ""])
    line = assert_one_line(code, err, 1, "no valid requests")
    assert "--train-fraction" not in line
    code, err = run(["stats", str(files["bad_rows"])])
    assert_one_line(code, err, 1, "5 rows rejected", "bad_type", "bad.jsonl:1")


def test_train_refuses_blank_experiment_and_unitless_horizon(files):
    base = ["train", "--trace", str(files["trace"]), "--model", "lightgbm"]
    code, err = run([*base, "--experiment", ""])
    assert_one_line(code, err, 2, "--experiment")
    code, err = run([*base, "--horizon", "60"])
    assert_one_line(code, err, 2, "60s")


# -- produce, bridge ---------------------------------------------------------------------


def test_produce_missing_trace_and_unreachable_broker(files):
    code, err = run(["produce", str(files["missing"])])
    assert_one_line(code, err, 2, "no such trace file")
    address = f"127.0.0.1:{free_port()}"
    code, err = run(["produce", str(files["trace"]), "--bootstrap", address, "--no-progress"])
    assert_one_line(code, err, 1, f"no Kafka broker at {address}")


def test_bridge_bad_target_and_unreachable_broker():
    engine = "zmq://127.0.0.1:5557"
    code, err = run(["bridge", "--from", engine, "--to", "kafka://nohost"])
    assert_one_line(code, err, 2, "kafka:TOPIC")
    address = f"127.0.0.1:{free_port()}"
    code, err = run(["bridge", "--from", engine, "--to", f"kafka://{address}/kv-events"])
    assert_one_line(code, err, 1, f"no Kafka broker at {address}")
