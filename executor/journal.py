"""The executor's journal: a small append-only file that makes decisions idempotent
across restarts and tells recovery which moves were in flight.

Records, one JSON object per line:

- ``{"b": move_id, "k": key, "f": src, "t": dst}``: a move is starting;
- ``{"e": move_id}``: that move ended (either way) without finishing a decision;
- ``{"d": decision_id, "s": status}``: a decision was handled (applied or skipped);
  also ends the move of the same id. Failed decisions are not recorded, so a
  redelivery retries them;
- ``{"p": key, "on": true|false}``: a block was pinned or unpinned.

A torn last line (crash mid-append) is ignored. Any other line that is not a
well-formed record (bad JSON, missing or mistyped fields, a move from a tier to
itself) is skipped and copied to ``<journal>.quarantine``: start-up goes on. ``compact`` rewrites the file
atomically with only the remembered ids (the newest ``max_ids``), the pins and the
moves still pending; it runs after recovery and whenever the file has grown to
``compact_every`` records. Appends go straight to the kernel
(``os.write`` on an ``O_APPEND`` descriptor), so a killed process loses none;
``fsync=True`` also survives power loss: per record, or with ``group_commit`` once per
``sync()`` (a batch), so a power loss can lose at most the batch not yet synced
(whose decisions are then redelivered, since the caller acknowledges only after sync).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

from executor.names import TIER_NAMES
from executor.protocol import OUTCOME_STATUSES

log = logging.getLogger(__name__)

_MAX_KEPT_LINE_BYTES = 4096
_MAX_FIELD_CHARS = 512


def _check_record(record: Any) -> str | None:
    """None if ``record`` is a well-formed journal record, else what is wrong with it.
    Only well-formed records are replayed: a bad one could otherwise stop start-up
    (missing field) or mislead recovery (a move whose source is its destination would
    have recovery delete the block's only copy)."""
    if not isinstance(record, dict):
        return "not a JSON object"

    def text(name: str) -> bool:
        value = record.get(name)
        return isinstance(value, str) and 0 < len(value) <= _MAX_FIELD_CHARS

    if "b" in record:
        if not all(text(f) for f in ("b", "k", "f", "t")):
            return "move record needs string fields b, k, f, t"
        if record["f"] == record["t"]:
            return f"move record from {record['f']!r} to itself"
        return None
    if "e" in record:
        return None if text("e") else "end record needs a string e"
    if "d" in record:
        return None if text("d") and text("s") else "decision record needs strings d, s"
    if "p" in record:
        if not text("p") or not isinstance(record.get("on"), bool):
            return "pin record needs a string p and a boolean on"
        return None
    return "unknown record kind"


def _q(text: str) -> str:
    """``text`` as a JSON string literal (ids are usually plain ASCII: no escaping)."""
    quoted = _QUOTED.get(text)
    if quoted is not None:
        return quoted
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text)


_QUOTED = {name: f'"{name}"' for name in (*TIER_NAMES, *OUTCOME_STATUSES, "done")}
"""Tier names and statuses (in most records) quoted once."""


class PendingMove(NamedTuple):
    move_id: str
    key: str
    src: str
    dst: str


class Journal:
    """``path=None`` keeps everything in memory (idempotence within one process only)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        fsync: bool = True,
        group_commit: bool = False,
        max_ids: int = 1_000_000,
        compact_every: int = 200_000,
    ):
        """``fsync``: make records survive power loss. ``group_commit``: do it once per
        ``sync()`` (the caller's batch) instead of once per record."""
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, got {max_ids}")
        self.path = Path(path) if path is not None else None
        self.fsync = fsync
        self.group_commit = group_commit
        self._dirty = False
        self.num_fsyncs = 0
        self.max_ids = max_ids
        self.compact_every = max(compact_every, 1)
        self._num_records = 0
        self._lock = threading.Lock()
        self._done: OrderedDict[str, None] = OrderedDict()
        self.pending: dict[str, PendingMove] = {}
        self.pins: set[str] = set()
        self.num_torn_lines = 0
        self.num_malformed_records = 0
        """Complete lines that were not valid records: skipped at load and copied to
        ``<journal>.quarantine``."""
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._set_aside_if_not_a_file(self.path)
            if self.path.exists():
                raw = self.path.read_bytes()
                self._load(raw)
                if raw and not raw.endswith(b"\n"):
                    # Cut the torn tail, so the next append starts on a line of its own.
                    os.truncate(self.path, raw.rfind(b"\n") + 1)
            self._fd = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
            )

    @staticmethod
    def _set_aside_if_not_a_file(path: Path) -> None:
        """A journal path holding a FIFO, device, directory or link is moved aside (a
        FIFO would hang the read) and the journal starts empty, with a warning."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISREG(mode):
            return
        aside = path.with_name(f"{path.name}.not-a-file.{time.time_ns()}")
        log.warning("journal %s is not a regular file; moved to %s, starting empty", path, aside)
        os.replace(path, aside)

    def _load(self, raw: bytes) -> None:
        lines = raw.splitlines()
        malformed: list[bytes] = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            problem = _check_record(record)
            if problem is None:
                self._replay(record)
            elif i == len(lines) - 1 and not raw.endswith(b"\n"):
                self.num_torn_lines += 1  # a crash mid-append: expected, nothing to keep
            else:
                malformed.append(line)
                log.warning("journal %s line %d quarantined: %s", self.path, i + 1, problem)
        self.num_malformed_records = len(malformed)
        if malformed and self.path is not None:
            # Kept for inspection; the next compaction drops them from the journal.
            with open(self.path.with_name(self.path.name + ".quarantine"), "ab") as f:
                f.write(b"".join(line[:_MAX_KEPT_LINE_BYTES] + b"\n" for line in malformed))

    def _replay(self, record: dict[str, Any]) -> None:
        if "b" in record:
            self.pending[record["b"]] = PendingMove(
                record["b"], record["k"], record["f"], record["t"]
            )
        elif "e" in record:
            self.pending.pop(record["e"], None)
        elif "d" in record:
            self.pending.pop(record["d"], None)
            self._remember(record["d"])
        elif "p" in record:
            if record.get("on"):
                self.pins.add(record["p"])
            else:
                self.pins.discard(record["p"])

    def _remember(self, decision_id: str) -> None:
        done = self._done
        if decision_id in done:
            done.move_to_end(decision_id)
            return
        done[decision_id] = None
        while len(done) > self.max_ids:
            done.popitem(last=False)

    def _write(self, line: bytes) -> None:
        """Append ``line`` (a record already applied in memory) to the file; the caller
        holds the lock. The write reaches the kernel before this returns, so a killed
        process loses no record; the fsync (power loss) is per record or, with group
        commit, per sync()."""
        if self._fd is None:
            return
        os.write(self._fd, line)
        if self.fsync:
            if self.group_commit:
                self._dirty = True
            else:
                os.fsync(self._fd)
                self.num_fsyncs += 1
        self._num_records += 1
        if self._num_records >= self.compact_every:
            self._rewrite()

    def sync(self) -> None:
        """Group commit: fsync the records appended since the last sync, once. Called
        at the end of each batch (``Executor.apply``) and by callers before they
        acknowledge what was applied (the sidecar's flush, before its offsets commit)."""
        with self._lock:
            if self._dirty and self._fd is not None:
                os.fsync(self._fd)
                self.num_fsyncs += 1
            self._dirty = False

    # -- records ------------------------------------------------------------------
    def is_done(self, decision_id: str) -> bool:
        return decision_id in self._done

    # Lines are formatted by hand (ids through json.dumps for escaping): the same JSON
    # as json.dumps(record) gives, at a fraction of the cost per record.
    # Each record is applied in memory as ``_replay`` would, then written.
    def begin_move(self, move_id: str, key: str, src: str, dst: str) -> None:
        if src == dst:
            raise ValueError(f"move {move_id}: source and destination are both {src!r}")
        line = f'{{"b":{_q(move_id)},"k":{_q(key)},"f":{_q(src)},"t":{_q(dst)}}}\n'.encode()
        with self._lock:
            self.pending[move_id] = PendingMove(move_id, key, src, dst)
            self._write(line)

    def end_move(self, move_id: str) -> None:
        line = f'{{"e":{_q(move_id)}}}\n'.encode()
        with self._lock:
            self.pending.pop(move_id, None)
            self._write(line)

    def decision_done(self, decision_id: str, status: str) -> None:
        line = f'{{"d":{_q(decision_id)},"s":{_q(status)}}}\n'.encode()
        with self._lock:
            self.pending.pop(decision_id, None)
            self._remember(decision_id)
            self._write(line)

    def set_pin(self, key: str, pinned: bool) -> None:
        line = f'{{"p":{_q(key)},"on":{"true" if pinned else "false"}}}\n'.encode()
        with self._lock:
            if pinned:
                self.pins.add(key)
            else:
                self.pins.discard(key)
            self._write(line)

    # -- maintenance ----------------------------------------------------------------
    def compact(self, drop_pending: bool = False) -> None:
        """Rewrite the file with the remembered ids, the pins and (unless
        ``drop_pending``, which recovery uses once it has resolved them) pending moves."""
        with self._lock:
            if drop_pending:
                self.pending.clear()
            self._rewrite()

    def _rewrite(self) -> None:
        """Caller holds the lock."""
        self._num_records = 0
        if self.path is None:
            return
        # The lines json.dumps would give (as the record methods write them), formatted
        # by hand: a compaction rewrites up to max_ids records at once.
        lines = [f'{{"d":{_q(d)},"s":"done"}}\n' for d in self._done]
        lines += [f'{{"p":{_q(k)},"on":true}}\n' for k in sorted(self.pins)]
        lines += [
            f'{{"b":{_q(m.move_id)},"k":{_q(m.key)},"f":{_q(m.src)},"t":{_q(m.dst)}}}\n'
            for m in self.pending.values()
        ]
        text = "".join(lines)
        tmp = self.path.with_name(self.path.name + ".compact")
        with open(tmp, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
