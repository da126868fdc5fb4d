"""State per partition, checkpointed to a changelog: what makes a restart or a
rebalance give the same decisions as a run that never stopped.

With ``--state-topic`` set, a Kafka-fed sidecar keeps one *shard* per partition it
consumes: its own policy state, planner RNG, placement mirror, recent-request ring,
prefetch timer and decision origin (everything ``serving.checkpoint`` lists). A
partition's decisions then depend only on that partition's events, never on which
sidecar of the group reads it or what else that sidecar reads: the way Kafka Streams
keeps one state store per task. The ``Sidecar`` stays one object; ``ShardedState``
switches a shard's objects into it before each of that shard's events (references,
no copies).

Checkpoints (``checkpoint``) go to a ``StateStore`` over a compacted topic, one key per
``<group>/<topic>/<partition>``. A snapshot holds the shard's state and the partition
position it corresponds to: the next offset and how many events of that message were
already handled (a message may carry several events). The sidecar checkpoints a shard

- at its first commit (so a committed offset never runs ahead of every snapshot),
- then at a commit at least ``interval_s`` after its previous checkpoint,
- and when its partition is revoked in a rebalance (after the last commit).

Order at a commit: decisions flushed, dirty shards checkpointed, offsets committed.
Only a shard's first snapshot must be durable before that commit (so a committed
offset never runs ahead of every snapshot); later ones are copied in the loop (numpy
copies, tens of ms) and encoded and written by a background thread (``background``),
so the loop does not stall for the encoding. A later snapshot cut short by a crash
leaves the previous one, which is older but consistent: restoring it only means more
events are handled again. A revoke drains the background writes first, so the new
owner reads the newest snapshot.
On assignment the new owner loads the partition's newest snapshot, restores it into a
fresh shard and seeks to its position; events after it are handled again, giving the
same decision ids (the executor applies them once). A partition without a snapshot
starts empty at the committed offset. A snapshot that does not fit (other tiers,
another policy structure) is logged and the shard starts empty at the committed offset.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from predictor.base import Policy
from serving.checkpoint import CheckpointError, capture, fresh_policy, restore
from serving.placement import Placement
from serving.planner import Planner, PlannerParams
from serving.prefetch_gate import PrefetchGate
from serving.state_store import StateStore

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 7
"""3: the prefetch gate keeps its precision per target tier; 4: the guard's scales keep
each candidate's per-request lead over the safe one; 5: the guard keeps when its
estimates (re)started (``min_requests``); 6: the guard's scales keep the per-request lead
of every pair of candidates (``leave_early_any``); 7: and no longer the leads over the
safe one, which are those pairs' own."""


@dataclass
class Shard:
    """One partition's world (see the module docstring)."""

    key: str
    policy: Policy
    planner: Planner
    placement: Placement
    recent: deque[tuple[int, ...]]
    gate: PrefetchGate | None = None
    last_prefetch_ms: int | None = None
    last_origin: str = "start"
    generation: int = 0
    """The model generation its policy was built from (``ShardedState.generation``)."""
    dirty: bool = False
    """Handled events since its last checkpoint."""
    checkpointed_at_s: float | None = None
    num_checkpoints: int = 0


@dataclass
class ShardStats:
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    background_seconds: float = 0.0
    background_failures: int = 0
    restores: int = 0
    restore_misses: int = 0
    restore_mismatches: int = 0
    shards_created: int = 0
    shards_dropped: int = 0
    by_key: dict[str, int] = field(default_factory=dict)


class ShardedState:
    """Per-partition shards switched into one sidecar; checkpoints and restores them.

    ``sidecar`` is a ``serving.loop.Sidecar``; ``decisions`` its ``DecisionMaker`` (its
    ``placement`` and prefetch origin are per shard too). ``store`` is where snapshots
    go; ``fingerprint`` describes the configuration a snapshot must match (tiers,
    capacities, policy) to be restored.
    """

    def __init__(
        self,
        sidecar: Any,
        decisions: Any,
        store: StateStore,
        *,
        planner_params: PlannerParams,
        fingerprint: dict[str, Any],
        interval_s: float = 30.0,
        clock_s: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        self.sidecar = sidecar
        self.decisions = decisions
        self.store = store
        self.planner_params = planner_params
        self.fingerprint = fingerprint
        self.interval_s = interval_s
        self.clock_s = clock_s
        self.template: Policy = sidecar.policy
        """The policy new shards copy (model + wrappers): the latest swapped in."""
        self._template_used = False
        self.generation = 0
        self.shards: dict[str, Shard] = {}
        self.active: Shard | None = None
        self.stats = ShardStats()
        self._kept: dict[str, tuple[Shard, tuple[int, int]]] = {}
        self._lock: threading.Lock = sidecar._lock
        self.background = background
        self._store_lock = threading.Lock()  # the loop and the writer thread share the store
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._inflight: set[str] = set()
        self._idle = threading.Condition()
        self._writer: threading.Thread | None = None

    # -- what ModelManager.attach needs ---------------------------------------------------
    @property
    def hooks(self) -> list[Any]:
        return self.sidecar.hooks  # type: ignore[no-any-return]

    @property
    def policy(self) -> Policy:
        return self.sidecar.policy  # type: ignore[no-any-return]

    def swap_policy(self, policy: Policy) -> None:
        """A hot swap: every shard moves to the new model, keeping its online state
        where the new policy can adopt it (same features), else starting it empty."""
        wrap = getattr(self.sidecar, "wrap_policy", None)
        new = wrap(policy) if wrap is not None else policy
        with self._lock:
            self.template = new
            self._template_used = False
            self.generation += 1
            for shard in self.shards.values():
                self._migrate(shard)
            if self.active is not None:
                self.sidecar.policy = self.active.policy

    def _migrate(self, shard: Shard) -> None:
        policy = self._new_policy()
        if not policy.adopt_state(shard.policy.handover_state()):
            log.info("shard %s: the new model cannot adopt its feature state; starts empty",
                     shard.key)  # fmt: skip
        shard.policy, shard.generation = policy, self.generation

    def _new_policy(self) -> Policy:
        if not self._template_used:  # the first shard serves the installed object itself
            self._template_used = True
            return self.template
        return fresh_policy(self.template)  # type: ignore[no-any-return]

    # -- shards -------------------------------------------------------------------------
    def _new_shard(self, key: str) -> Shard:
        s = self.sidecar
        placement = Placement(list(s.placement.tier_names), list(s.placement.capacities))
        shard = Shard(
            key=key,
            policy=self._new_policy(),
            planner=Planner(self.planner_params),
            placement=placement,
            recent=deque(maxlen=s.recent.maxlen),
            gate=PrefetchGate(s.prefetch_gate.min_precision) if s.prefetch_gate else None,
            generation=self.generation,
        )
        self.stats.shards_created += 1
        return shard

    def activate(self, key: str) -> None:
        """Switch ``key``'s shard into the sidecar (created empty on first use)."""
        if self.active is not None and self.active.key == key:
            self.active.dirty = True
            return
        with self._lock:
            self._stash()
            shard = self.shards.get(key)
            if shard is None:
                shard = self.shards[key] = self._new_shard(key)
            s, d = self.sidecar, self.decisions
            s.drop_round()  # a split prefetch round belongs to the shard it started in
            s.policy, s.planner, s.placement = shard.policy, shard.planner, shard.placement
            s.recent, s._last_prefetch_ms = shard.recent, shard.last_prefetch_ms
            s.prefetch_gate = shard.gate
            d.placement, d._last_origin = shard.placement, shard.last_origin
            shard.dirty = True
            self.active = shard

    def _stash(self) -> None:
        """Write the sidecar's scalars back into the active shard (objects are shared)."""
        shard = self.active
        if shard is None:
            return
        shard.last_prefetch_ms = self.sidecar._last_prefetch_ms
        shard.last_origin = self.decisions._last_origin

    def deactivate(self) -> None:
        with self._lock:
            self._stash()
            self.active = None

    # -- snapshots --------------------------------------------------------------------------
    def snapshot(
        self, shard: Shard, position: tuple[int, int], *, copy: bool = False
    ) -> dict[str, Any]:
        if shard is self.active:
            self._stash()
        return {
            "v": SNAPSHOT_VERSION,
            "fingerprint": self.fingerprint,
            "position": list(position),
            "policy": capture(shard.policy, copy=copy),
            "planner": capture(shard.planner, copy=copy),
            "placement": capture(shard.placement, copy=copy),
            "gate": capture(shard.gate, copy=copy) if shard.gate is not None else None,
            "recent": [list(chain) for chain in shard.recent],
            "last_prefetch_ms": shard.last_prefetch_ms,
            "last_origin": shard.last_origin,
        }

    def restore_shard(self, key: str, tree: Any) -> tuple[int, int]:
        """A fresh shard for ``key`` holding ``tree``'s state; returns the position to
        resume from. Raises ``CheckpointError`` when the snapshot does not fit."""
        if not isinstance(tree, dict) or tree.get("v") != SNAPSHOT_VERSION:
            raise CheckpointError(f"snapshot version {tree.get('v') if isinstance(tree, dict) else '?'}"
                                  f" is not {SNAPSHOT_VERSION}")  # fmt: skip
        if tree.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"snapshot taken with {tree.get('fingerprint')}, this sidecar runs "
                f"{self.fingerprint}"
            )
        shard = self._new_shard(key)
        restore(shard.policy, tree["policy"])
        restore(shard.planner, tree["planner"])
        restore(shard.placement, tree["placement"])
        if (shard.gate is None) != (tree.get("gate") is None):
            raise CheckpointError("snapshot and sidecar disagree on the prefetch gate")
        if shard.gate is not None:
            restore(shard.gate, tree["gate"])
        shard.recent.extend(tuple(int(b) for b in chain) for chain in tree["recent"])
        shard.last_prefetch_ms = tree["last_prefetch_ms"]
        shard.last_origin = str(tree["last_origin"])
        offset, skip = (int(x) for x in tree["position"])
        shard.checkpointed_at_s = self.clock_s()
        with self._lock:
            if self.active is not None and self.active.key == key:
                self.active = None
            self.shards[key] = shard
        return offset, skip

    def checkpoint(
        self, positions: dict[str, tuple[int, int]], *, force: bool = False
    ) -> list[str]:
        """Save the dirty shards that are due (see the module docstring) at the
        positions given (key -> (next offset, events handled of that message)); returns
        the keys saved. A shard without a position is skipped."""
        now = self.clock_s()
        saved = []
        for key, shard in self.shards.items():
            if not shard.dirty or key not in positions:
                continue
            due = (
                force
                or shard.checkpointed_at_s is None
                or now - shard.checkpointed_at_s >= self.interval_s
            )
            if not due:
                continue
            later = self.background and not force and shard.num_checkpoints > 0
            if later and key in self._inflight:
                continue  # its previous snapshot is still being written: stays dirty
            t0 = time.perf_counter()
            tree = self.snapshot(shard, positions[key], copy=later)
            if later:
                self._submit(key, tree)
            else:
                self._save(key, tree)
            self.stats.checkpoint_seconds += time.perf_counter() - t0
            self.stats.checkpoints += 1
            self.stats.by_key[key] = self.stats.by_key.get(key, 0) + 1
            shard.dirty = False
            shard.checkpointed_at_s = now
            shard.num_checkpoints += 1
            saved.append(key)
        return saved

    def _save(self, key: str, tree: dict[str, Any]) -> None:
        with self._store_lock:
            self.store.save(key, tree)

    def _submit(self, key: str, tree: dict[str, Any]) -> None:
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvwarm-checkpoint-writer", daemon=True
            )
            self._writer.start()
        with self._idle:
            self._inflight.add(key)
        self._queue.put((key, tree))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, tree = item
            t0 = time.perf_counter()
            try:
                self._save(key, tree)
            except Exception:  # the previous snapshot stands; the next one retries
                self.stats.background_failures += 1
                log.exception("checkpoint of %s not written; the previous one stands", key)
            finally:
                self.stats.background_seconds += time.perf_counter() - t0
                with self._idle:
                    self._inflight.discard(key)
                    self._idle.notify_all()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every background snapshot is written; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the background writes (at most ``timeout_s``) and stop the writer."""
        if self._writer is None:
            return
        if not self.drain(timeout_s):
            log.warning("checkpoints still being written after %.0f s; left behind", timeout_s)
        self._queue.put(None)
        self._writer.join(timeout=1.0)
        self._writer = None

    # -- rebalances ---------------------------------------------------------------------------
    def on_revoked(self, keys: Iterable[str], positions: dict[str, tuple[int, int]]) -> None:
        """Partitions taken away: checkpoint them where they stand (after the
        background writes, so the newest snapshot is the last written), then set them
        aside (kept in memory until the assignment that follows decides)."""
        self.drain()
        keys = [k for k in keys if k in self.shards]
        self.checkpoint({k: positions[k] for k in keys if k in positions}, force=True)
        self.deactivate()
        for key in keys:
            shard = self.shards.pop(key)
            if key in positions:
                self._kept[key] = (shard, positions[key])
            self.stats.shards_dropped += 1

    def on_assigned(self, keys: Iterable[str]) -> dict[str, tuple[int, int]]:
        """Partitions given to this sidecar: returns key -> position to seek to, for
        those resumed from a kept shard or a snapshot (others: the committed offset)."""
        seek: dict[str, tuple[int, int]] = {}
        kept, self._kept = self._kept, {}
        keys = list(keys)
        trees = self.store.load_many([k for k in keys if k not in kept])
        for key in keys:
            if key in kept:  # revoked and given back in one rebalance
                self.shards[key], seek[key] = kept[key]
                continue
            tree = trees[key]
            if tree is None:
                self.stats.restore_misses += 1
                log.info("partition %s: no snapshot, starting empty at the committed offset", key)
                continue
            try:
                seek[key] = self.restore_shard(key, tree)
            except (CheckpointError, KeyError, TypeError, ValueError) as exc:
                self.stats.restore_mismatches += 1
                self.shards.pop(key, None)
                log.warning("partition %s: snapshot not restored (%s); starting empty at the "
                            "committed offset", key, exc)  # fmt: skip
                continue
            self.stats.restores += 1
            log.info("partition %s: state restored, resuming at offset %d (+%d events)",
                     key, *seek[key])  # fmt: skip
        return seek
