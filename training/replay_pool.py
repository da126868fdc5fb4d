"""Held-out replays side by side: the training choices' single-tier replays on the cores
at hand.

Every choice ``kvwarm train`` and ``kvwarm replay``'s own training make (the horizon, the
chain blend, the fit, the validation gate) replays held-out requests single tier
through a few policies at a few cache sizes: independent jobs, each one policy state
copied and replayed at one size. ``replay_hit_ratios(policies, events, capacities)``
runs them in worker processes when the replays are long enough to pay for it, else
one after another in this process; the figures are the same either way (a policy
travels as its pickle, an exact copy of the state the serial path deep-copies, and the
planner is seeded per replay).

Workers are ``python -m training.replay_pool`` processes: a fresh interpreter that
imports the replay's modules once and then serves jobs from its stdin (length-prefixed
pickles: the held-out requests once per worker, a policy and a size per job), so
nothing of this process's threads (MLflow's, OpenMP's after a LightGBM fit) or of its
main script is inherited. They are started at the first call that needs them and kept
for the next ones (a train run makes several), and end when this process does (their
stdin closes). ``KVWARM_REPLAY_WORKERS``: ``1`` replays serially; ``N`` uses at most N
workers and replays side by side whatever the size (tests use it on small fixtures);
unset, at most the usable cores, and only when each job holds at least
``MIN_PARALLEL_ACCESSES`` block accesses. A worker that cannot start, dies or fails a
job (a policy that does not pickle) is logged and its jobs are replayed here,
serially: the figures do not depend on it.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import importlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from features.events import BlocksAccessed
from predictor.base import Policy

log = logging.getLogger(__name__)

WORKERS_ENV = "KVWARM_REPLAY_WORKERS"
MIN_PARALLEL_ACCESSES = 20_000
"""Block accesses a replay job needs before jobs go to workers (unless
``KVWARM_REPLAY_WORKERS`` names a count): a learned replay of that many takes ~1 s,
several times what a job adds (its policy pickled here and read back there; the
trainers start the workers beside their fits, ``start_replay_workers``)."""
PRELOAD = (
    "training.replay",
    "predictor.registry",
    "predictor.lightgbm_policy",
    "predictor.chain_model",
    "predictor.baselines",
)
"""Imported by a worker as it starts, before its first job."""


@dataclass
class PoolStats:
    """Replay jobs done so far in this process, by where they ran."""

    in_workers: int = 0
    here: int = 0


STATS = PoolStats()


def usable_cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def planned_workers(num_jobs: int, accesses_per_job: int) -> int:
    """Workers the jobs get: 0 means serially in this process (see the module
    docstring for the rule)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            asked = int(raw)
        except ValueError:
            raise ValueError(
                f"{WORKERS_ENV}={raw!r} is not a whole number: set it to 1 to replay "
                "serially or to the most worker processes to use"
            ) from None
        if asked < 1:
            raise ValueError(f"{WORKERS_ENV}={asked} must be at least 1")
        limit = asked
    else:
        if accesses_per_job < MIN_PARALLEL_ACCESSES:
            return 0
        limit = usable_cpus()
    workers = min(limit, num_jobs)
    return workers if workers >= 2 else 0


def start_replay_workers(events: Sequence[BlocksAccessed], num_jobs: int) -> None:
    """Start the workers ``replay_hit_ratios`` would use for ``num_jobs`` replays of
    ``events`` now (none if it would replay serially), so that a caller with other work
    first does not wait for their start later."""
    workers = planned_workers(num_jobs, sum(len(e.block_hashes) for e in events))
    if workers:
        _pool(workers)


def replay_hit_ratios(
    policies: Sequence[Policy],
    events: Sequence[BlocksAccessed],
    capacities_blocks: Sequence[int],
) -> list[list[float]]:
    """Single-tier hit ratio of each policy (in the state it is in: warmed as the
    caller wants) on ``events`` at each cache size; ``out[i][j]`` is policy ``i`` at
    ``capacities_blocks[j]``. The policies are not changed (each replay runs on a
    copy)."""
    jobs = [(i, j) for i in range(len(policies)) for j in range(len(capacities_blocks))]
    accesses = sum(len(e.block_hashes) for e in events)
    workers = planned_workers(len(jobs), accesses)
    out: list[list[float | None]] = [[None] * len(capacities_blocks) for _ in policies]
    if workers:
        _replay_in_workers(policies, events, capacities_blocks, jobs, workers, out)
    from training.replay import replay_single_tier

    for i, j in jobs:
        if out[i][j] is None:
            replay = replay_single_tier(copy.deepcopy(policies[i]), events, capacities_blocks[j])
            out[i][j] = replay.hit_ratio
            STATS.here += 1
        else:
            STATS.in_workers += 1
    return [[float(v) for v in row if v is not None] for row in out]  # all filled now


def _replay_in_workers(
    policies: Sequence[Policy],
    events: Sequence[BlocksAccessed],
    capacities_blocks: Sequence[int],
    jobs: Sequence[tuple[int, int]],
    workers: int,
    out: list[list[float | None]],
) -> None:
    """Fill ``out`` with what the workers finish; leaves None where they did not."""
    try:
        blobs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in policies]
        trace = pickle.dumps(list(events), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - the serial path replays everything
        log.warning("held-out replays run serially: %s: %s", type(exc).__name__, exc)
        return
    trace_key = hashlib.blake2b(trace, digest_size=16).digest()
    # Longest first (the learned policies come first in every caller's list; larger
    # caches hold more residents to sample): the pool ends on the short ones.
    pending: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    for ij in sorted(jobs, key=lambda ij: (ij[0], -capacities_blocks[ij[1]])):
        pending.put(ij)
    errors: list[str] = []

    def drive(worker: _Worker) -> None:
        while True:
            try:
                i, j = pending.get_nowait()
            except queue.Empty:
                return
            try:
                out[i][j] = worker.replay(trace_key, trace, blobs[i], capacities_blocks[j])
            except _WorkerError as exc:
                errors.append(str(exc))
                if not worker.alive():
                    return  # this worker's remaining share goes to the others or here

    threads = [
        threading.Thread(target=drive, args=(w,), name="kvwarm-replay", daemon=True)
        for w in _pool(workers)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:
        _close_pool()  # an interrupt: end the workers now
        raise
    if errors:
        log.warning(
            "held-out replays: %d job(s) replayed here instead (%s)", len(errors), errors[0]
        )


class _WorkerError(Exception):
    """A job a worker did not do: why."""


class _Worker:
    """One ``python -m training.replay_pool`` process and its pipes."""

    def __init__(self) -> None:
        repo_root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "training.replay_pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.trace_key = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def replay(self, trace_key: bytes, trace: bytes, policy: bytes, capacity_blocks: int) -> float:
        send_trace = trace if trace_key != self.trace_key else b""
        try:
            _write_frame(self.proc.stdin, (trace_key, send_trace, policy, capacity_blocks))
            reply = _read_frame(self.proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            self.close()
            raise _WorkerError(
                f"a replay worker stopped ({type(exc).__name__}; exit code {self.proc.returncode})"
            ) from exc
        self.trace_key = trace_key
        status, value = reply
        if status != "ok":
            raise _WorkerError(str(value))
        return float(value)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_WORKERS: list[_Worker] = []
"""The workers kept between calls (ended at exit)."""
_POOL_LOCK = threading.Lock()


def _pool(size: int) -> list[_Worker]:
    """``size`` live workers, started now where fewer are kept."""
    with _POOL_LOCK:
        _WORKERS[:] = [w for w in _WORKERS if w.alive()]
        while len(_WORKERS) < size:
            try:
                _WORKERS.append(_Worker())
            except OSError as exc:
                log.warning("a replay worker did not start: %s", exc)
                break
        return _WORKERS[:size]


def _close_pool() -> None:
    with _POOL_LOCK:
        workers, _WORKERS[:] = list(_WORKERS), []
    for worker in workers:
        worker.close()


atexit.register(_close_pool)


_FRAME = struct.Struct("<Q")
MAX_FRAME_BYTES = 1 << 34
"""A frame longer than this is a broken pipe, not a job (16 GiB)."""


def _write_frame(stream: IO[bytes] | None, value: object) -> None:
    assert stream is not None
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream: IO[bytes] | None) -> Any:
    assert stream is not None
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError("no reply")
    (size,) = _FRAME.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise pickle.UnpicklingError(f"a frame of {size} bytes")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("a short reply")
    return pickle.loads(data)


def _serve(jobs: IO[bytes], replies: IO[bytes]) -> None:
    """A worker's loop: one reply per job until its stdin closes. Only the process that
    started it writes to its stdin (pickles are trusted here, as between threads)."""
    from training.replay import replay_single_tier

    trace_key, events = b"", []
    while True:
        try:
            key, trace, policy_blob, capacity_blocks = _read_frame(jobs)
        except EOFError:
            return
        reply: tuple[str, object]
        try:
            if key != trace_key:
                events, trace_key = pickle.loads(trace), key
            policy = pickle.loads(policy_blob)
            reply = ("ok", replay_single_tier(policy, events, capacity_blocks).hit_ratio)
        except Exception as exc:  # noqa: BLE001 - the caller replays it itself
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _write_frame(replies, reply)


if __name__ == "__main__":
    for _name in PRELOAD:
        importlib.import_module(_name)
    _serve(sys.stdin.buffer, sys.stdout.buffer)
