"""libCacheSim's policies on the block sequence kvwarm replays: the peers in every table.

Primitives:

- ``PEER_POLICIES``: the peers by report name (``"S3-FIFO"``, ``"3L-Cache"``...), each
  with the libCacheSim class and parameters it runs with.
- ``peer_hit_ratios(block_ids, capacity_blocks, ...)``: every listed peer on the same
  sequence at one capacity; a ``PeerResult`` per name: hit ratio, exact hit count,
  seconds, or why it is unavailable.
- ``write_oracle_general(path, block_ids, ...)``: the sequence in libCacheSim's
  oracleGeneral binary format.

Setting (the same as ``features.trace_stats``): every block is an object of size 1 and
the cache holds ``capacity_blocks`` bytes, so capacity is exactly that many blocks
(``consider_obj_metadata`` stays off: no per-object overhead is charged). Hit ratio is
hits / accesses, every access counted, cold misses included. With this,
libCacheSim's LRU and Belady give exactly ``lru_hits`` and ``belady_hits`` (always
admit); the unit tests pin that.

Why each peer runs in its own process: several libCacheSim policies abort or trap
inside C on configurations they do not support (S3-FIFO and W-TinyLFU below a few
blocks, Cacheus at capacity 0), which would take the caller down with them. Each
``peer_hit_ratios`` call starts one helper (``python -m training.peers``) that imports
libCacheSim and forks one child per policy, so children never inherit the caller's
threads or OpenMP state (LightGBM and XGBoost run inside LRB, GLCache and 3L-Cache);
a crash, an exception or a timeout becomes an unavailable result with the reason and
the child's last log lines. A fresh child per policy also makes the randomised peers
(LHD, LeCaR, Cacheus) repeat exactly: each starts from the same RNG state.

Which file each peer reads: oracles (Belady) read the sequence with next-access
annotations; every other peer reads the same sequence with every annotation set to
"never" (-1), so no online peer can see the future by construction. (On the shared
trace at 5% the deterministic online peers gave identical counts either way.)

Parameters are libCacheSim 0.3.5's defaults, untuned, except the learned peers'
objective (object miss ratio: what is measured here). Known behaviour on the shared
conversation trace: LRB never trains within 288,500 requests (its counts equal LRU's
exactly at 1/5/10%; 0.3.5 exposes no parameter for its memory window or batch size),
and GLCache's default retrain interval (86,400 clock seconds) is longer than the trace.

Clock: ``clock_time`` is seconds since the first access when ``ts_ms`` is given
(libCacheSim's unit), otherwise 0 for every access.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from features.annotate import next_access_index
from training.child_process import module_command

ORACLE_GENERAL_DTYPE = np.dtype(
    [
        ("clock_time", "<u4"),
        ("obj_id", "<u8"),
        ("obj_size", "<u4"),
        ("next_access_vtime", "<i8"),
    ]
)
"""One request of libCacheSim's oracleGeneral binary trace (24 bytes, packed)."""

NEVER_ACCESSED_AGAIN = -1
"""oracleGeneral's 'no next access' (the reader maps it to INT64_MAX)."""

DEFAULT_TIMEOUT_S = 600.0
"""Per policy; a child still running after this (rounded up to whole seconds) is
killed and reported unavailable."""

_LOG_TAIL_CHARS = 600
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
"""The colours libCacheSim's logger writes."""


class UnknownPeerError(ValueError):
    """A peer name not in ``PEER_POLICIES``."""


@dataclass(frozen=True)
class PeerPolicy:
    """How one peer runs: ``libcachesim.<cache_class>(capacity, **params)``."""

    cache_class: str
    params: tuple[tuple[str, Any], ...] = ()
    bloom_admission: bool = False
    """Admit an object only on its second miss (libCacheSim's Bloom-filter admissioner)."""
    needs_future: bool = False
    """Reads next-access annotations: an oracle, the upper reference, never a peer to beat."""


PEER_POLICIES: Mapping[str, PeerPolicy] = {
    "LRU": PeerPolicy("LRU"),
    "B-LRU": PeerPolicy("LRU", bloom_admission=True),
    "FIFO": PeerPolicy("FIFO"),
    "SIEVE": PeerPolicy("Sieve"),
    "2Q": PeerPolicy("TwoQ"),
    "ARC": PeerPolicy("ARC"),
    "LIRS": PeerPolicy("LIRS"),
    "S3-FIFO": PeerPolicy("S3FIFO"),
    "W-TinyLFU": PeerPolicy("WTinyLFU"),
    "LHD": PeerPolicy("LHD"),
    "GDSF": PeerPolicy("GDSF"),
    "LeCaR": PeerPolicy("LeCaR"),
    "Cacheus": PeerPolicy("Cacheus"),
    # The learned peers optimise object miss ratio: what the tables measure.
    "LRB": PeerPolicy("LRB", (("objective", "object-miss-ratio"),)),
    "GLCache": PeerPolicy("GLCache"),
    "3L-Cache": PeerPolicy("ThreeLCache", (("objective", "object-miss-ratio"),)),
    "Belady": PeerPolicy("Belady", needs_future=True),
}
"""Peers by the name reports show, in report order. Left out: Clock-Pro (in 0.3.5 it
fills only half of the cache: 913 objects resident at 1,827 blocks)."""


@dataclass(frozen=True)
class PeerResult:
    """One peer at one capacity. ``error`` is set exactly when it did not run."""

    name: str
    capacity_blocks: int
    num_accesses: int
    num_hits: int | None
    elapsed_s: float
    """Seconds to build the cache and run the trace (the child's own clock); for an
    unavailable peer, the seconds until it was given up."""
    error: str | None = None
    needs_future: bool = False

    @property
    def available(self) -> bool:
        return self.error is None

    @property
    def hit_ratio(self) -> float:
        """hits / accesses; NaN when unavailable."""
        if self.num_hits is None:
            return float("nan")
        return self.num_hits / self.num_accesses if self.num_accesses else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "capacity_blocks": self.capacity_blocks,
            "num_accesses": self.num_accesses,
            "num_hits": self.num_hits,
            "hit_ratio": None if self.num_hits is None else self.hit_ratio,
            "elapsed_s": self.elapsed_s,
            "error": self.error,
            "needs_future": self.needs_future,
        }


def write_oracle_general(
    path: Path, block_ids: np.ndarray, ts_ms: np.ndarray | None = None, *, annotate: bool = True
) -> Path:
    """Write the sequence as an oracleGeneral trace: object id = block id + 1, size 1,
    next_access_vtime = index of the block's next access (or -1), all -1 unless
    ``annotate``."""
    block_ids = np.asarray(block_ids, dtype=np.int64)
    n = block_ids.shape[0]
    if n and int(block_ids.min()) < 0:
        raise ValueError("block ids must be non-negative; pass AccessArrays.block_ids")
    records = np.zeros(n, dtype=ORACLE_GENERAL_DTYPE)
    if ts_ms is not None and n:
        ts = np.asarray(ts_ms, dtype=np.int64)
        if ts.shape != block_ids.shape:
            raise ValueError(f"ts_ms has {ts.shape[0]} entries for {n} block accesses")
        seconds = (ts - ts[0]) // 1000
        if int(seconds.min()) < 0 or int(seconds.max()) > np.iinfo(np.uint32).max:
            raise ValueError("ts_ms must be non-decreasing and span under 136 years")
        records["clock_time"] = seconds
    # Id 0 is avoided: ids start at 1 as in libCacheSim's own traces.
    records["obj_id"] = block_ids.astype(np.uint64) + np.uint64(1)
    records["obj_size"] = 1
    if annotate:
        nxt = next_access_index(block_ids)
        records["next_access_vtime"] = np.where(nxt < n, nxt, NEVER_ACCESSED_AGAIN)
    else:
        records["next_access_vtime"] = NEVER_ACCESSED_AGAIN
    records.tofile(path)
    return path


def peer_hit_ratios(
    block_ids: np.ndarray,
    capacity_blocks: int,
    policies: Sequence[str] = tuple(PEER_POLICIES),
    ts_ms: np.ndarray | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, PeerResult]:
    """Run each peer in ``policies`` on ``block_ids`` (dense ids, access order) with a
    cache of ``capacity_blocks`` blocks; one ``PeerResult`` per name, in order.

    Never raises for a peer: one that fails to start, crashes or runs past
    ``timeout_s`` comes back with ``error`` set. Raises ``UnknownPeerError`` for a name
    not in ``PEER_POLICIES`` and ``ValueError`` for a negative capacity.
    """
    unknown = [name for name in policies if name not in PEER_POLICIES]
    if unknown:
        raise UnknownPeerError(
            f"unknown peer policies {unknown}; choose from {', '.join(PEER_POLICIES)}"
        )
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    block_ids = np.asarray(block_ids, dtype=np.int64)
    num_accesses = int(block_ids.shape[0])

    def result(name: str, num_hits: int | None, elapsed_s: float, error: str | None) -> PeerResult:
        return PeerResult(
            name=name,
            capacity_blocks=capacity_blocks,
            num_accesses=num_accesses,
            num_hits=num_hits,
            elapsed_s=elapsed_s,
            error=error,
            needs_future=PEER_POLICIES[name].needs_future,
        )

    if importlib.util.find_spec("libcachesim") is None:
        reason = "libcachesim is not installed: pip install 'libcachesim>=0.3.5'"
        return {name: result(name, None, 0.0, reason) for name in policies}

    results: dict[str, PeerResult] = {}
    with tempfile.TemporaryDirectory(prefix="kvwarm-peers-") as tmp:
        tmp_dir = Path(tmp)
        traces = {
            True: write_oracle_general(tmp_dir / "oracle.bin", block_ids, ts_ms, annotate=True),
            False: write_oracle_general(tmp_dir / "blind.bin", block_ids, ts_ms, annotate=False),
        }
        with _PeerServer(tmp_dir / "server.log") as server:
            for index, name in enumerate(policies):
                policy = PEER_POLICIES[name]
                job = _PeerJob(
                    cache_class=policy.cache_class,
                    params=dict(policy.params),
                    bloom_admission=policy.bloom_admission,
                    trace_path=str(traces[policy.needs_future]),
                    num_accesses=num_accesses,
                    capacity_blocks=capacity_blocks,
                    timeout_s=timeout_s,
                    log_path=str(tmp_dir / f"{index}.log"),
                    result_path=str(tmp_dir / f"{index}.json"),
                )
                started = time.perf_counter()
                outcome = server.run(job)
                if isinstance(outcome, str):
                    results[name] = result(name, None, time.perf_counter() - started, outcome)
                else:
                    results[name] = result(name, outcome[0], outcome[1], None)
    return results


# ---------------------------------------------------------------------------------------
# Isolation. The caller starts one server process (``python -m training.peers``) per
# ``peer_hit_ratios`` call; it imports libCacheSim once and forks one child per job, so
# a job costs a fork, not an interpreter start, and the children never inherit the
# caller's OpenMP or thread state. Protocol: one JSON job per line on the server's
# stdin, one JSON reply per line on its stdout; the child writes its result to a file.


@dataclass(frozen=True)
class _PeerJob:
    cache_class: str
    params: dict[str, Any]
    bloom_admission: bool
    trace_path: str
    num_accesses: int
    capacity_blocks: int
    timeout_s: float
    log_path: str
    result_path: str


class _PeerServer:
    """The caller's side: starts the server, sends jobs, restarts it if it dies."""

    def __init__(self, log_path: Path) -> None:
        self._log_path = log_path
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> _PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _start(self) -> subprocess.Popen[str]:
        argv, env = module_command("training.peers")
        with open(self._log_path, "a") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()

    def run(self, job: _PeerJob) -> tuple[int, float] | str:
        """(hits, seconds), or why there are none."""
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(asdict(job)) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError as exc:
            line = ""
            server_error = f"{type(exc).__name__}: {exc}"
        else:
            server_error = ""
        if not line:
            self._stop()
            return f"the peer server died {server_error}{_log_tail(str(self._log_path))}"
        reply = json.loads(line)
        if reply["status"] == "ok":
            return int(reply["hits"]), float(reply["elapsed_s"])
        return f"{reply['reason']}{_log_tail(job.log_path)}"


def _log_tail(log_path: str) -> str:
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    lines = [_ANSI_ESCAPE.sub("", line).strip() for line in text.splitlines()]
    tail = " | ".join(line for line in lines if line)[-_LOG_TAIL_CHARS:]
    return f"; log: {tail}" if tail else ""


def _alarm_s(timeout_s: float) -> int:
    return max(1, math.ceil(timeout_s))


def _describe_wait_status(status: int, timeout_s: float) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGALRM:
            return f"timed out after {_alarm_s(timeout_s)} s"
        with contextlib.suppress(ValueError):
            return f"crashed: killed by {signal.Signals(sig).name}"
        return f"crashed: killed by signal {sig}"
    return f"crashed: exit code {os.waitstatus_to_exitcode(status)}"


def _serve(jobs: IO[str], replies: IO[str]) -> None:
    """The server loop: one forked child per job, one reply per job."""
    for line in jobs:
        job = _PeerJob(**json.loads(line))
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(job)
        _, status = os.waitpid(pid, 0)
        reply: dict[str, Any]
        try:
            reply = json.loads(Path(job.result_path).read_text())
        except (OSError, ValueError):
            reply = {
                "status": "error",
                "reason": _describe_wait_status(status, job.timeout_s),
                "elapsed_s": time.perf_counter() - started,
            }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _child(job: _PeerJob) -> None:
    code = 1
    try:
        signal.alarm(_alarm_s(job.timeout_s))
        # The C library logs to stdout and stderr; stdout is the reply pipe.
        log_fd = os.open(job.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        try:
            hits, elapsed_s = _simulate(job)
            reply: dict[str, Any] = {"status": "ok", "hits": hits, "elapsed_s": elapsed_s}
            code = 0
        except BaseException as exc:  # report everything; the caller decides
            reply = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        Path(job.result_path).write_text(json.dumps(reply))
    finally:
        os._exit(code)


def _simulate(job: _PeerJob) -> tuple[int, float]:
    import libcachesim

    started = time.perf_counter()
    if job.num_accesses == 0:
        return 0, 0.0
    reader = libcachesim.TraceReader(
        job.trace_path, trace_type=libcachesim.TraceType.ORACLE_GENERAL_TRACE
    )
    num_requests = reader.get_num_of_req()
    if num_requests != job.num_accesses:
        raise RuntimeError(f"reader sees {num_requests} requests, wrote {job.num_accesses}")
    admissioner = libcachesim.BloomFilterAdmissioner() if job.bloom_admission else None
    cache_class = getattr(libcachesim, job.cache_class)
    cache = cache_class(job.capacity_blocks, admissioner=admissioner, **job.params)
    obj_miss_ratio, _ = cache.process_trace(reader)
    # process_trace returns misses / requests as a double; the count is recovered
    # exactly (the error is ~1e-16 * num_accesses, far below 0.5).
    hits = round((1.0 - obj_miss_ratio) * job.num_accesses)
    return int(hits), time.perf_counter() - started


def _server_main() -> None:
    # Replies go to a private copy of stdout; fd 1 itself goes to stderr, where
    # anything the library prints on import cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import libcachesim  # noqa: F401  (once, before any fork)

    _serve(sys.stdin, replies)


if __name__ == "__main__":
    _server_main()
