"""Replays side by side: independent replay jobs on the cores at hand.

Every choice ``kvwarm train`` and ``kvwarm replay``'s own training make (the horizon, the
chain blend, the fit, the validation gate), and every row of ``kvwarm replay``'s and
``kvwarm bench quality``'s tables, is a replay of one policy state at one cache size:
independent jobs; so are the horizon choice's quick fits, one per candidate horizon.
``JobRunner`` runs calls of module-level functions on worker processes, or here when
there are none; ``replay_hit_ratios(policies, events, capacities)`` is the training
choices' use of it. The figures are the same either way: a job's arguments travel as
their pickle, an exact copy of the state the serial path deep-copies, every replay
seeds its own planner, and LightGBM fits on one thread with a fixed seed.

Workers are ``python -m training.replay_pool`` processes: a fresh interpreter that
imports the replay's modules once and then serves jobs from its stdin (length-prefixed
pickles: large read-only arguments such as the replayed requests once per worker and
runner, ``Shared``; a function and its arguments per job), so nothing of this process's
threads (MLflow's, OpenMP's after a LightGBM fit) or of its main script is inherited.
They are started at the first call that needs them and kept for the next ones (a train
run makes several), and end when this process does (their stdin closes; on Linux a
killed one takes them with it: ``_die_with_parent``). Only this
process writes to a worker's stdin: the pickles are trusted as between threads, and no
file or socket carries them. ``KVWARM_REPLAY_WORKERS``: ``1`` runs every job here,
serially; ``N`` uses at most N workers whatever the size (tests use it on small
fixtures); unset, at most the usable cores, and only when each job replays at least
``MIN_PARALLEL_ACCESSES`` block accesses (fits: ``MIN_PARALLEL_ROWS`` training rows).
A worker that cannot start, dies or fails a job (an argument that does not pickle) is
logged and the job is run here: the figures do not depend on it.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import hashlib
import importlib
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from features.events import BlocksAccessed
from predictor.base import Policy
from training.child_process import module_command

log = logging.getLogger(__name__)

WORKERS_ENV = "KVWARM_REPLAY_WORKERS"
MIN_PARALLEL_ACCESSES = 10_000
"""Block accesses a replay job needs before jobs go to workers (unless
``KVWARM_REPLAY_WORKERS`` names a count): a learned replay of that many takes ~0.5 s,
several times what a job adds (its policy pickled here and read back there; the
trainers start the workers beside their fits, ``start_replay_workers``)."""
MIN_PARALLEL_ROWS = 100_000
"""Training rows a fit job needs before fits go to workers (the horizon choice's quick
fits): seconds each, against the rows' pickle read once per worker."""
QUEUED_PER_WORKER = 2
"""Jobs a runner queues per worker beyond those running; ``submit`` waits for room."""
PRELOAD = (
    "training.replay",
    "training.tiered",
    "predictor.registry",
    "predictor.lightgbm_policy",
    "predictor.chain_model",
    "predictor.baselines",
)
"""Imported by a worker as it starts, before its first job."""


@dataclass
class PoolStats:
    """Jobs done so far in this process, by where they ran."""

    in_workers: int = 0
    here: int = 0


STATS = PoolStats()


def usable_cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def planned_workers(num_jobs: int, size_per_job: int, min_size: int = MIN_PARALLEL_ACCESSES) -> int:
    """Workers the jobs get: 0 means serially in this process (see the module
    docstring for the rule; ``size_per_job``: block accesses replayed, or whatever
    ``min_size`` counts, such as ``MIN_PARALLEL_ROWS``)."""
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
        if size_per_job < min_size:
            return 0
        limit = usable_cpus()
    workers = min(limit, num_jobs)
    return workers if workers >= 2 else 0


def start_replay_workers(events: Sequence[BlocksAccessed], num_jobs: int) -> None:
    """Start the workers ``num_jobs`` replays of ``events`` would get now (none if they
    would run here), so that a caller with other work first does not wait for them."""
    workers = planned_workers(num_jobs, sum(len(e.block_hashes) for e in events))
    if workers and _POOL_LOCK.acquire(blocking=False):
        try:
            _live_workers(workers)
        finally:
            _POOL_LOCK.release()


def replay_hit_ratios(
    policies: Sequence[Policy],
    events: Sequence[BlocksAccessed],
    capacities_blocks: Sequence[int],
) -> list[list[float]]:
    """Single-tier hit ratio of each policy (in the state it is in: warmed as the
    caller wants) on ``events`` at each cache size; ``out[i][j]`` is policy ``i`` at
    ``capacities_blocks[j]``. The policies are not changed (each replay runs on a
    copy)."""
    num_jobs = len(policies) * len(capacities_blocks)
    accesses = sum(len(e.block_hashes) for e in events)
    with JobRunner(planned_workers(num_jobs, accesses)) as runner:
        trace = runner.share(list(events))
        # Larger caches first (more residents to sample: longer replays), so the pool
        # ends on short ones; the learned policy comes first in every caller's list.
        order = sorted(range(len(capacities_blocks)), key=lambda j: -capacities_blocks[j])
        jobs = {
            (i, j): runner.submit(_hit_ratio, runner.own(policy), trace, capacities_blocks[j])
            for i, policy in enumerate(policies)
            for j in order
        }
        return [
            [float(jobs[i, j].result()) for j in range(len(capacities_blocks))]
            for i in range(len(policies))
        ]


def _hit_ratio(policy: Policy, events: Sequence[BlocksAccessed], capacity_blocks: int) -> float:
    from training.replay import replay_single_tier

    return replay_single_tier(policy, events, capacity_blocks).hit_ratio


# ---------------------------------------------------------------------------------------
# Jobs


_SHARES: dict[bytes, Any] = {}
"""``Shared`` values by key: here, those of the runner under way; in a worker, those
sent to it since its runner began."""


def _shared(key: bytes) -> Any:
    """What a pickled ``Shared`` becomes when a job is unpickled."""
    return _SHARES[key]


class Shared:
    """A large read-only argument (the replayed requests): with workers pickled once and
    sent to each worker once; a job's pickle names it by key."""

    def __init__(self, value: Any, parallel: bool) -> None:
        self.value = value
        self.blob, self.key = b"", b""
        if parallel:
            self.blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            self.key = hashlib.blake2b(self.blob, digest_size=16).digest()
            _SHARES[self.key] = value

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return (_shared, (self.key,))

    def __deepcopy__(self, memo: dict[int, object]) -> Shared:
        return self  # read-only


class Job:
    """One submitted call; ``result()`` is its value: a worker's, or computed here then
    (from the arguments as they were submitted) where no worker did it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        blob: bytes = b"",
        shares: dict[bytes, bytes] | None = None,
    ) -> None:
        self._call = None if blob else (fn, args)  # with a blob, the pickle holds them
        self.blob = blob
        """The pickled call (with workers): what a worker gets, and what runs here if
        none did."""
        self.shares = shares or {}
        """The ``Shared`` arguments' pickles by key (sent to a worker that lacks them)."""
        self.done = threading.Event()
        self._value: Any = None
        self._ok = False
        if not blob:
            self.done.set()

    def finish(self, ok: bool, value: Any = None) -> None:
        self._ok, self._value = ok, value
        if ok:
            self.blob = b""  # a policy state's pickle is large: done with it
        self.done.set()

    def result(self) -> Any:
        self.done.wait()
        if not self._ok:
            if self._call is None:
                self._call = pickle.loads(self.blob)
            fn, args = self._call
            args = tuple(a.value if isinstance(a, Shared) else a for a in args)
            self._value, self._ok = fn(*args), True
            STATS.here += 1
            self._call, self.blob = None, b""
        return self._value


class JobRunner:
    """Calls of module-level functions on the kept workers (``workers`` > 0), or here.

    ``submit(fn, *args)`` returns a ``Job``. With workers, the call is pickled then
    (``share(value)`` arguments once per worker), so the caller may change or drop what
    it passed; without, it runs then, on the objects given (``own(x)`` gives a job a
    copy of what the caller keeps using). A worker that dies or fails a job leaves it,
    and the queued ones no other worker takes, to ``result()`` (a job that raises in a
    worker raises again there, with its traceback). As a context manager, leaving waits
    for the workers to finish what they took (an exception ends them at once). One
    runner holds the workers at a time; another made meanwhile runs its jobs here."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._driving = 0
        self._held = False
        self._shares: list[bytes] = []
        self.failures: list[str] = []
        if workers and _POOL_LOCK.acquire(blocking=False):
            self._held = True
            pool = _live_workers(workers)
            self._driving = len(pool)
            self._threads = [
                threading.Thread(target=self._drive, args=(w,), name="kvwarm-jobs", daemon=True)
                for w in pool
            ]
            for thread in self._threads:
                thread.start()
            if not pool:
                self._release()
        self.parallel = self._driving > 0
        self._slots = threading.Semaphore(QUEUED_PER_WORKER * max(1, self._driving))
        """Jobs queued and not yet taken: bounded, so that a caller submitting many
        large policy states holds a few pickles at a time, not all of them."""

    def __enter__(self) -> JobRunner:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.close(abort=kind is not None)

    def share(self, value: Any) -> Shared:
        shared = Shared(value, self.parallel)
        self._shares.append(shared.key)
        return shared

    def own(self, value: Any) -> Any:
        """``value`` for one job: itself with workers (the job pickles it), a deep copy
        without (the call runs here, on it)."""
        return value if self.parallel else copy.deepcopy(value)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        """Queue ``fn(*args)`` (``fn`` importable by a worker: module level). Without
        workers it runs now: one job's state in memory at a time, as a plain loop."""
        if not self.parallel:
            job = Job(fn, args)
            job.result()
            return job
        try:
            blob = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - it runs here instead, on copies
            self._fail(f"{fn.__name__} not sent to a worker: {type(exc).__name__}: {exc}")
            return Job(fn, copy.deepcopy(args))
        job = Job(fn, args, blob, {a.key: a.blob for a in args if isinstance(a, Shared)})
        self._slots.acquire()
        with self._lock:
            if self._driving == 0:  # every worker gone: here, at result()
                self._slots.release()
                job.finish(False)
                return job
            self._queue.put(job)
        return job

    def close(self, abort: bool = False) -> None:
        """Wait for the workers to finish what they took (``abort``: end them now).
        Collect results before: the ``Shared`` values are dropped here."""
        if abort and self._held:
            _close_pool(kill=True)  # the drivers see their pipes close and stop
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        for key in self._shares:
            _SHARES.pop(key, None)
        self._release()
        if self.failures:
            log.warning(
                "replay jobs: %d run here instead of in a worker (first: %s)",
                len(self.failures),
                self.failures[0],
            )

    def _release(self) -> None:
        if self._held:
            self._held = False
            _POOL_LOCK.release()

    def _fail(self, why: str) -> None:
        with self._lock:
            self.failures.append(why)

    def _drive(self, worker: _Worker) -> None:
        """Feed one worker until the queue's end or its death."""
        while True:
            job = self._queue.get()
            if job is None:
                worker.forget_shares()
                return
            self._slots.release()
            try:
                value = worker.run(job)
            except _WorkerError as exc:
                job.finish(False)
                self._fail(str(exc))
                if worker.alive():
                    continue
                self._lose_driver()
                return
            job.finish(True, value)
            with self._lock:
                STATS.in_workers += 1

    def _lose_driver(self) -> None:
        """A worker died: the others take the queue; after the last, ``result()`` runs
        what is left (queued now or submitted later)."""
        with self._lock:
            self._driving -= 1
            if self._driving > 0:
                return
            while True:
                try:
                    left = self._queue.get_nowait()
                except queue.Empty:
                    return
                if left is not None:
                    self._slots.release()
                    left.finish(False)


class _WorkerError(Exception):
    """A job a worker did not do: why."""


class _Worker:
    """One ``python -m training.replay_pool`` process and its pipes."""

    def __init__(self) -> None:
        argv, env = module_command("training.replay_pool")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.shares: set[bytes] = set()
        """Keys of the ``Shared`` values this worker holds."""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: Job) -> Any:
        missing = {k: b for k, b in job.shares.items() if k not in self.shares}
        try:
            _write_frame(self.proc.stdin, ("job", missing, job.blob))
            status, value = _read_frame(self.proc.stdout)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            self.close()
            raise _WorkerError(
                f"a replay worker stopped ({type(exc).__name__}; exit code {self.proc.returncode})"
            ) from exc
        self.shares.update(missing)
        if status != "ok":
            raise _WorkerError(str(value))
        return value

    def forget_shares(self) -> None:
        """Tell the worker to drop what it was sent (the runner is done)."""
        if self.shares and self.alive():
            with contextlib.suppress(OSError, ValueError):
                _write_frame(self.proc.stdin, ("forget", {}, b""))
        self.shares = set()

    def close(self, kill: bool = False) -> None:
        if kill:
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdout.close()


_WORKERS: list[_Worker] = []
"""The workers kept between runners (ended at exit)."""
_POOL_LOCK = threading.Lock()
"""Held by the runner using the workers (and while starting them)."""


def _live_workers(size: int) -> list[_Worker]:
    """``size`` live workers, started now where fewer are kept (the pool lock held)."""
    alive = [w for w in _WORKERS if w.alive()]
    for worker in _WORKERS:
        if worker not in alive:
            worker.close()
    _WORKERS[:] = alive
    while len(_WORKERS) < size:
        try:
            _WORKERS.append(_Worker())
        except OSError as exc:
            log.warning("a replay worker did not start: %s", exc)
            break
    return _WORKERS[:size]


def _close_pool(kill: bool = False) -> None:
    workers, _WORKERS[:] = list(_WORKERS), []
    for worker in workers:
        worker.close(kill=kill)


atexit.register(_close_pool)


_FRAME = struct.Struct("<Q")
MAX_FRAME_BYTES = 1 << 36
"""A frame longer than this is a broken pipe, not a job (64 GiB)."""


def _write_frame(stream: IO[bytes] | None, value: object) -> None:
    if stream is None:
        raise ValueError("no pipe")
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream: IO[bytes] | None) -> Any:
    if stream is None:
        raise ValueError("no pipe")
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError("the pipe closed")
    (size,) = _FRAME.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("a short frame")
    return pickle.loads(data)


def _serve(jobs: IO[bytes], replies: IO[bytes]) -> None:
    """A worker's loop: one reply per job until its stdin closes."""
    while True:
        try:
            kind, shares, blob = _read_frame(jobs)
        except EOFError:
            return
        if kind == "forget":
            _SHARES.clear()
            continue
        reply: tuple[str, object]
        try:
            for key, value in shares.items():
                _SHARES[key] = pickle.loads(value)
            fn, args = pickle.loads(blob)
            reply = ("ok", fn(*args))
        except Exception as exc:  # noqa: BLE001 - the caller runs it itself
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _write_frame(replies, reply)


def _die_with_parent() -> None:
    """A worker ends when the process that started it does, however that ends (a
    SIGTERM or SIGKILL skips the exit handlers that close its pipe, and a worker in the
    middle of a long replay would read its EOF only after it)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # it ended before the line above
        sys.exit(0)


_PR_SET_PDEATHSIG = 1


if __name__ == "__main__":
    _die_with_parent()
    for _name in PRELOAD:
        importlib.import_module(_name)
    # The module's own globals (``_SHARES``), not this __main__ copy's: jobs' pickles
    # name ``training.replay_pool``.
    importlib.import_module("training.replay_pool")._serve(sys.stdin.buffer, sys.stdout.buffer)
