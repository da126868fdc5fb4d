"""A real, local Apache Kafka broker assembled from Maven Central jars.

Used by ``make test`` (through the pytest session fixture), by ``kvwarm kafka
up|down|status`` and by ``kvwarm bench kafka``. Docker and the Apache download
mirrors are not needed: Maven resolves ``org.apache.kafka:kafka_2.13`` and its
runtime dependencies plus the SLF4J->Log4j2 binding that the binary
distribution adds (without it the broker logs nothing, so readiness could not
be seen).

Primitives:

- ``fetch_jars()``: resolve the jars into ``.cache/kafka/lib-<version>/`` (git
  ignored); a second call finds the completed folder and returns at once.
- ``KafkaBroker(state_dir)``: one combined broker+controller (KRaft) on
  127.0.0.1. ``start()`` formats storage on first use, launches the JVM with a
  small heap, waits for ``Kafka Server started`` and an accepting port;
  ``stop()`` signals the PID it started (checked against ``/proc`` so a reused
  PID is never killed); ``status()`` reads the PID file. Ports and the cluster id
  are kept in the state dir, so a stop/start on the same dir is a broker restart
  that clients survive.

This module does not import kafka-python (only ``serving.kafka_io`` does).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KAFKA_VERSION = os.environ.get("KVWARM_KAFKA_VERSION", "4.4.0")
"""Newest Apache Kafka 4.x on Maven Central when this was written (4.0.0 .. 4.4.0 resolve)."""

LOG4J2_VERSION = "2.25.5"
"""The Log4j2 version ``kafka-server`` 4.4.0 depends on; the SLF4J binding must match it."""

DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
"""Fully qualified: Maven 3.8's implicit dependency plugin (2.8) is too old to rely on."""

DEFAULT_HEAP_MB = 512
READY_PATTERN = re.compile(rb"\[KafkaRaftServer nodeId=\d+\] Kafka Server started")
BROKER_MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL_CLASS = "kafka.tools.StorageTool"


class KafkaBrokerError(RuntimeError):
    """The local broker could not be fetched, started or stopped; the message says why
    and what to do."""


def _repo_root() -> Path:
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def default_cache_dir() -> Path:
    """``$KVWARM_CACHE_DIR/kafka`` or ``<repo>/.cache/kafka`` (ignored by git)."""
    base = os.environ.get("KVWARM_CACHE_DIR")
    return (Path(base) if base else _repo_root() / ".cache") / "kafka"


def default_state_dir() -> Path:
    """Where ``kvwarm kafka up`` keeps its broker (data, logs, PID file)."""
    return default_cache_dir() / "broker"


# --- pure helpers (unit tested) ---------------------------------------------------------


def render_pom(version: str = KAFKA_VERSION, log4j2_version: str = LOG4J2_VERSION) -> str:
    """A POM whose runtime dependencies are exactly the jars a broker needs."""
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.kvwarm</groupId>
  <artifactId>kafka-broker-libs</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{version}</version>
    </dependency>
    <!-- What the binary distribution adds and the POM lacks: the SLF4J 1.7 binding
         (Kafka 4.x uses slf4j-api 1.7.36, so not log4j-slf4j2-impl). -->
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j2_version}</version>
      <scope>runtime</scope>
    </dependency>
  </dependencies>
</project>
"""


LOG4J2_PROPERTIES = """\
status = warn
name = KvwarmKafka
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
"""


@dataclass(frozen=True)
class BrokerConfig:
    """What makes one broker: its ports, its data dir and its cluster id."""

    port: int
    controller_port: int
    data_dir: Path
    cluster_id: str
    node_id: int = 1


def render_server_properties(cfg: BrokerConfig) -> str:
    """Combined broker+controller on 127.0.0.1 (never ``localhost``, which may be ::1).

    Dynamic quorum (``controller.quorum.bootstrap.servers`` + ``format --standalone``);
    ``controller.quorum.voters`` must not be set with it. Internal topics get one
    partition and no initial rebalance delay so the first consumer group is quick.
    """
    lines = {
        "process.roles": "broker,controller",
        "node.id": str(cfg.node_id),
        "controller.quorum.bootstrap.servers": f"127.0.0.1:{cfg.controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{cfg.port},CONTROLLER://127.0.0.1:{cfg.controller_port}",
        "advertised.listeners": (
            f"PLAINTEXT://127.0.0.1:{cfg.port},CONTROLLER://127.0.0.1:{cfg.controller_port}"
        ),
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(cfg.data_dir),
        "num.partitions": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "group.min.session.timeout.ms": "1000",
        "auto.create.topics.enable": "true",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        # The log cleaner allocates its dedupe buffer (128 MiB by default) on the heap.
        "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
    }
    return "".join(f"{k}={v}\n" for k, v in lines.items())


def new_cluster_id() -> str:
    """A cluster id as Kafka's ``Uuid.randomUuid()`` writes it: URL-safe base64 of 16
    bytes without padding, never starting with ``-`` (argparse would read an option)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_accepts(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def broker_ready(log_bytes: bytes) -> bool:
    """Whether a broker's log shows the line logged after every listener accepts."""
    return READY_PATTERN.search(log_bytes) is not None


def jvm_options(
    heap_mb: int, tmp_dir: Path, log_config: Path, *, fast_start: bool = True
) -> list[str]:
    """Small-heap JVM flags. ``java.io.tmpdir`` is the state dir's own folder because
    zstd/snappy unpack native libraries there (a noexec /tmp would break them).

    ``fast_start`` compiles with C1 only (``-XX:TieredStopAtLevel=1``): on a busy
    2-core machine it halves the time to ready (measured 5.5-9 s against 10-21 s) at
    some cost in peak broker throughput, which a local test broker does not need.

    The serial collector, not G1: on two cores shared with a sidecar and a producer,
    G1's young collections paused the broker for 157 and 195 ms now and then (``jstat``
    on the broker during ``kvwarm bench serve``'s Kafka open loop, LRU at 958 events/s,
    2026-12-07), each one a sidecar flush waiting that long for its acks; twelve such
    runs gave p99 13-285 ms, six over 100. With the serial collector its young
    collections took 8-13 ms and four runs gave p99 30-53 ms. A broker of this size (a
    512 MiB heap at most, little live data) is what the serial collector is for.
    """
    if heap_mb < 128:
        raise KafkaBrokerError(f"heap_mb={heap_mb} is too small for a broker; use at least 128")
    return [
        *(["-XX:TieredStopAtLevel=1"] if fast_start else []),
        f"-Xms{min(heap_mb, 128)}m",
        f"-Xmx{heap_mb}m",
        "-XX:+UseSerialGC",
        "-Djava.awt.headless=true",
        f"-Djava.io.tmpdir={tmp_dir}",
        f"-Dlog4j2.configurationFile={log_config}",
    ]


def process_cmdline(pid: int) -> str | None:
    """The command line of ``pid`` (NUL separators as spaces), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:
            out = subprocess.run(
                ["ps", "-o", "command=", "-p", str(pid)],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            return None
        return out.stdout.strip() or None
    if not raw:
        return None  # a zombie has an empty cmdline
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def is_our_broker(pid: int, properties_path: Path) -> bool:
    """True only if ``pid`` runs ``kafka.Kafka`` on this very properties file: a PID
    file can outlive its process and the number be reused by something else."""
    cmdline = process_cmdline(pid)
    return cmdline is not None and BROKER_MAIN_CLASS in cmdline and str(properties_path) in cmdline


def _die_with_parent() -> None:
    """In the forked child, before exec: ask Linux to SIGTERM it when its parent dies,
    so a test run that is killed outright does not leave a broker behind."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() is then the only way


# --- jars ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JarSet:
    lib_dir: Path
    num_jars: int
    size_bytes: int
    fetched_now: bool
    elapsed_s: float

    @property
    def classpath(self) -> str:
        # The JVM expands the wildcard itself.
        return f"{self.lib_dir}/*"


def _find_tool(name: str, env_var: str) -> str:
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    if name == "java" and os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / "java"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise KafkaBrokerError(
            f"{name!r} not found on PATH (or ${env_var}); install it with `make system-deps` "
            "(Java 17+ and Maven are needed to fetch and run the Kafka broker)"
        )
    return found


def _verify_lib(lib_dir: Path, version: str) -> list[Path]:
    jars = sorted(lib_dir.glob("*.jar"))
    names = [j.name for j in jars]
    if f"kafka_2.13-{version}.jar" not in names:
        raise KafkaBrokerError(
            f"{lib_dir} lacks kafka_2.13-{version}.jar; delete it and fetch again"
        )
    bindings = [
        n for n in names if n.startswith(("log4j-slf4j", "slf4j-simple", "logback-classic"))
    ]
    if len(bindings) != 1:
        raise KafkaBrokerError(
            f"{lib_dir} must hold exactly one SLF4J binding, found {bindings}; delete it and fetch again"
        )
    return jars


def fetch_jars(
    version: str = KAFKA_VERSION,
    cache_dir: Path | None = None,
    *,
    timeout_s: float = 600,
) -> JarSet:
    """Resolve the broker's jars with Maven into ``<cache>/lib-<version>/``.

    The folder is filled under a temporary name and renamed when complete, so an
    interrupted download is never mistaken for a cached one.
    """
    started = time.monotonic()
    cache = cache_dir or default_cache_dir()
    lib_dir = cache / f"lib-{version}"
    marker = lib_dir / ".complete"
    fetched_now = False
    if not marker.is_file():
        mvn = _find_tool("mvn", "KVWARM_MVN")
        cache.mkdir(parents=True, exist_ok=True)
        pom = cache / f"pom-{version}.xml"
        pom.write_text(render_pom(version))
        partial = cache / f"lib-{version}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [
            mvn, "-B", "-q", "-ntp", "-f", str(pom),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={partial}",
        ]  # fmt: skip
        log.info("fetching Kafka %s jars with Maven into %s", version, lib_dir)
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise KafkaBrokerError(
                f"Maven did not finish fetching Kafka {version} within {timeout_s:.0f} s; "
                "check that Maven Central is reachable (mvn settings, proxy)"
            ) from None
        if done.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise KafkaBrokerError(
                f"Maven could not fetch org.apache.kafka:kafka_2.13:{version} (exit {done.returncode}); "
                "check that Maven Central is reachable and the version exists. Output:\n"
                + (done.stdout + done.stderr)[-3000:]
            )
        _verify_lib(partial, version)
        (partial / ".complete").write_text(json.dumps({"version": version}))
        shutil.rmtree(lib_dir, ignore_errors=True)
        partial.rename(lib_dir)
        fetched_now = True
    jars = _verify_lib(lib_dir, version)
    return JarSet(
        lib_dir=lib_dir,
        num_jars=len(jars),
        size_bytes=sum(j.stat().st_size for j in jars),
        fetched_now=fetched_now,
        elapsed_s=time.monotonic() - started,
    )


# --- the broker -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    accepting: bool
    pid: int | None
    bootstrap: str | None
    state_dir: Path

    def describe(self) -> str:
        if not self.running:
            return f"not running (state dir {self.state_dir})"
        listening = "accepting connections" if self.accepting else "NOT accepting connections yet"
        return f"running, pid {self.pid}, bootstrap {self.bootstrap}, {listening} (state dir {self.state_dir})"


class KafkaBroker:
    """One KRaft broker+controller whose files all live in ``state_dir``.

    ``die_with_parent`` (tests, benchmarks): the broker gets SIGTERM when the process
    that started it dies, even by SIGKILL. ``kvwarm kafka up`` leaves it off, since
    that broker must outlive the command.

    ``state_dir`` holds ``broker.json`` (ports, cluster id, version), ``server.properties``,
    ``data/``, ``broker.out`` (the JVM's output), ``broker.pid`` and ``tmp/``. Ports are
    chosen once (free ports, or ``port`` when given) and reused by later starts.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        heap_mb: int = DEFAULT_HEAP_MB,
        fast_start: bool = True,
        die_with_parent: bool = False,
        version: str = KAFKA_VERSION,
        cache_dir: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.heap_mb = heap_mb
        self.fast_start = fast_start
        self.die_with_parent = die_with_parent
        self.version = version
        self.cache_dir = cache_dir
        self._requested_port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    # Paths --------------------------------------------------------------------------------
    @property
    def properties_path(self) -> Path:
        return self.state_dir / "server.properties"

    @property
    def pid_path(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "broker.out"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    def config(self) -> BrokerConfig:
        """The broker's config, created (free ports, new cluster id) on first use."""
        meta = self.state_dir / "broker.json"
        if meta.is_file():
            saved = json.loads(meta.read_text())
            return BrokerConfig(
                port=saved["port"],
                controller_port=saved["controller_port"],
                data_dir=Path(saved["data_dir"]),
                cluster_id=saved["cluster_id"],
            )
        port = self._requested_port or free_port()
        controller_port = free_port()
        while controller_port == port:
            controller_port = free_port()
        cfg = BrokerConfig(port, controller_port, self.data_dir, new_cluster_id())
        self.state_dir.mkdir(parents=True, exist_ok=True)
        record = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
        meta.write_text(json.dumps({**record, "version": self.version}, indent=2))
        return cfg

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.config().port}"

    # Lifecycle ----------------------------------------------------------------------------
    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None

    def _alive_pid(self) -> int | None:
        """The PID from the PID file if it still runs our broker, else None."""
        if self._proc is not None and self._proc.poll() is not None:
            return None
        pid = self._read_pid()
        if pid is not None and is_our_broker(pid, self.properties_path):
            return pid
        return None

    def status(self) -> BrokerStatus:
        pid = self._alive_pid()
        if pid is None:
            return BrokerStatus(False, False, None, None, self.state_dir)
        cfg = self.config()
        return BrokerStatus(True, port_accepts(cfg.port), pid, self.bootstrap, self.state_dir)

    def _format(self, java: str, jars: JarSet, cfg: BrokerConfig, log_config: Path) -> None:
        if (cfg.data_dir / "meta.properties").is_file():
            return  # formatted before: this start is a restart on the same data
        cmd = [
            java, "-Xmx256m", f"-Dlog4j2.configurationFile={log_config}",
            "-cp", jars.classpath, STORAGE_TOOL_CLASS, "format", "--standalone",
            f"--cluster-id={cfg.cluster_id}", "--config", str(self.properties_path),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        if done.returncode != 0:
            raise KafkaBrokerError(
                f"formatting KRaft storage in {cfg.data_dir} failed (exit {done.returncode}); "
                "delete the state dir to start from scratch. Output:\n"
                + (done.stdout + done.stderr)[-3000:]
            )

    def start(self, timeout_s: float = 120) -> float:
        """Start the broker (formatting storage on first use) and wait until it accepts
        connections. Returns seconds from JVM launch to ready. No-op if already running."""
        if self._alive_pid() is not None:
            return 0.0
        java = _find_tool("java", "KVWARM_JAVA")
        jars = fetch_jars(self.version, self.cache_dir)
        cfg = self.config()
        for sub in ("tmp", "data"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.properties_path.write_text(render_server_properties(cfg))
        log_config = self.state_dir / "log4j2.properties"
        log_config.write_text(LOG4J2_PROPERTIES)
        self._format(java, jars, cfg, log_config)
        if port_accepts(cfg.port):
            raise KafkaBrokerError(
                f"port {cfg.port} on 127.0.0.1 is taken by another process; stop it or delete "
                f"{self.state_dir}/broker.json so free ports are chosen"
            )
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        cmd = [
            java,
            *jvm_options(
                self.heap_mb, self.state_dir / "tmp", log_config, fast_start=self.fast_start
            ),
            "-cp",
            jars.classpath,
            BROKER_MAIN_CLASS,
            str(self.properties_path),
        ]
        started = time.monotonic()
        with open(self.log_path, "ab") as out:
            # A session of its own: Ctrl-C in a shell that ran `kvwarm kafka up` must not
            # reach the broker; only stop() (or `down`) ends it.
            self._proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.state_dir,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )  # fmt: skip
        self.pid_path.write_text(f"{self._proc.pid}\n")
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise KafkaBrokerError(
                    f"the Kafka broker exited with code {self._proc.returncode} while starting; "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail(offset=offset)}"
                )
            if broker_ready(self._read_log(offset)) and port_accepts(cfg.port):
                self.start_s = time.monotonic() - started
                log.info(
                    "Kafka %s ready at %s in %.1f s", self.version, self.bootstrap, self.start_s
                )
                return self.start_s
            time.sleep(0.1)
        self.stop()
        raise KafkaBrokerError(
            f"the Kafka broker did not become ready within {timeout_s:.0f} s; "
            f"its log ({self.log_path}) ends with:\n{self.log_tail(offset=offset)}"
        )

    def _read_log(self, offset: int) -> bytes:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except OSError:
            return b""

    def log_tail(self, num_chars: int = 4000, offset: int = 0) -> str:
        return self._read_log(offset)[-num_chars:].decode(errors="replace")

    def stop(self, grace_s: float = 30) -> bool:
        """SIGTERM the broker this state dir started (clean shutdown), SIGKILL after
        ``grace_s``. Returns whether a broker was running."""
        pid = self._alive_pid()
        if pid is None:
            self._reap()
            self.pid_path.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        if not self._wait_gone(pid, grace_s):
            log.warning("Kafka broker pid %d ignored SIGTERM for %.0f s; killing it", pid, grace_s)
            os.kill(pid, signal.SIGKILL)
            self._wait_gone(pid, 10)
        self._reap()
        self.pid_path.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL the broker (a crash, for tests); the data dir stays for a restart."""
        pid = self._alive_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self._wait_gone(pid, 10)
        self._reap()

    def _wait_gone(self, pid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not is_our_broker(pid, self.properties_path):
                return True
            time.sleep(0.1)
        return False

    def _reap(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return
            self._proc = None

    def destroy(self) -> None:
        """Stop the broker and delete its state dir."""
        self.stop()
        shutil.rmtree(self.state_dir, ignore_errors=True)
