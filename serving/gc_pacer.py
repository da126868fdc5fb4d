"""Full garbage collections when the sidecar chooses, not when allocations say.

CPython's cyclic collector runs a full (generation 2) collection whenever enough
objects have survived two younger collections. Serving keeps growing long-lived state
(chains, request records, the recent-request ring: 144,000-198,000 tracked objects
in a 5,000-request ``kvwarm bench serve`` run), and a full collection walks all of
it: seven of them in that run's two file runs, 84-223 ms each on this project's 2-core
VM, each a stall of every event in flight; four of the seven found nothing to free.

``GcPacer`` takes full collections out of the allocation path while a sidecar runs:

- ``start()``: everything alive is frozen (``gc.freeze``: the collector never walks
  it again) and automatic full collections are switched off (generation 2's
  threshold). Generations 0 and 1 still run as before, so short-lived cycles are
  freed as soon as they were.
- ``tick(idle)`` after each batch: a full collection when the source had nothing
  (``idle``) and ``idle_interval_s`` passed since the last one, or, under unbroken
  load, once ``max_interval_s`` passed anyway. Each one ends by freezing what
  survived, so the next walks only what arrived since: short and bounded.
- Every ``refreeze_interval_s`` (at an idle moment when one comes, otherwise at the
  next tick past twice that) the frozen objects are released and collected once, so
  a cycle that died after it was frozen (a replaced model, a dropped chain) is still
  freed: memory stays bounded on an endless stream.
- ``stop()`` puts the collector back as it found it (threshold and frozen objects).

``max_interval_s=0`` leaves CPython's schedule alone (``paced`` is False): ``start``
only freezes what is alive, ``tick`` does nothing, ``stop`` unfreezes.

The pacer counts its collections and their pauses (``status()``: ``/healthz`` and
``/metrics``). Pacers nest: a process running several sidecars shares one paced
collector; the last ``stop`` restores it.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

NEVER = 1 << 30
"""Generation 2's threshold while paced: full collections only from ``tick``."""

_lock = threading.Lock()
_active = 0
_saved_threshold: tuple[int, int, int] | None = None


class GcPacer:
    def __init__(
        self,
        idle_interval_s: float = 2.0,
        max_interval_s: float = 60.0,
        refreeze_interval_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= idle_interval_s <= max_interval_s <= refreeze_interval_s:
            raise ValueError(
                "need 0 <= idle_interval_s <= max_interval_s <= refreeze_interval_s, got "
                f"{idle_interval_s}, {max_interval_s}, {refreeze_interval_s}"
            )
        self.idle_interval_s = idle_interval_s
        self.max_interval_s = max_interval_s
        self.paced = max_interval_s > 0
        self.refreeze_interval_s = refreeze_interval_s
        self._clock = clock
        self._started = False
        self._last = 0.0
        self._last_refreeze = 0.0
        self.num_collections = 0
        self.num_refreezes = 0
        self.num_collected = 0
        self.last_pause_ms = 0.0
        self.max_pause_ms = 0.0
        self.total_pause_ms = 0.0

    def start(self) -> None:
        """Freeze what is alive (collected first) and, when paced, switch automatic full
        collections off."""
        global _active, _saved_threshold
        if self._started:
            return
        if self.paced:
            with _lock:
                if _active == 0:
                    _saved_threshold = gc.get_threshold()
                    t0, t1, _ = _saved_threshold
                    gc.set_threshold(t0, t1, NEVER)
                _active += 1
        self._started = True
        self._collect(refreeze=False)
        self._last_refreeze = self._last

    def tick(self, idle: bool) -> bool:
        """Collect now if it is time (see the module docstring); True when it did."""
        if not (self._started and self.paced):
            return False
        now = self._clock()
        since = now - self._last
        if now - self._last_refreeze >= self.refreeze_interval_s and (
            idle or now - self._last_refreeze >= 2 * self.refreeze_interval_s
        ):
            self._collect(refreeze=True)
            return True
        if (idle and since >= self.idle_interval_s) or since >= self.max_interval_s:
            self._collect(refreeze=False)
            return True
        return False

    def _collect(self, refreeze: bool) -> None:
        t0 = time.perf_counter()
        if refreeze:
            gc.unfreeze()
        self.num_collected += gc.collect()
        gc.freeze()
        pause_ms = (time.perf_counter() - t0) * 1e3
        self.num_collections += 1
        self.last_pause_ms = pause_ms
        self.max_pause_ms = max(self.max_pause_ms, pause_ms)
        self.total_pause_ms += pause_ms
        self._last = self._clock()
        if refreeze:
            self.num_refreezes += 1
            self._last_refreeze = self._last

    def stop(self) -> None:
        """Give the collector back: frozen objects collectable, its threshold restored
        (by the last pacer of the process to stop)."""
        global _active, _saved_threshold
        if not self._started:
            return
        self._started = False
        if not self.paced:
            gc.unfreeze()
            return
        with _lock:
            _active -= 1
            if _active == 0:
                gc.unfreeze()
                if _saved_threshold is not None:
                    gc.set_threshold(*_saved_threshold)
                _saved_threshold = None

    def status(self) -> dict[str, Any]:
        return {
            "paced": self._started and self.paced,
            "collections": self.num_collections,
            "refreezes": self.num_refreezes,
            "collected_objects": self.num_collected,
            "last_pause_ms": round(self.last_pause_ms, 3),
            "max_pause_ms": round(self.max_pause_ms, 3),
            "total_pause_ms": round(self.total_pause_ms, 3),
            "frozen_objects": gc.get_freeze_count(),
        }
