"""The feature-state kernels: ``FeatureState``'s per-request work in native calls.

Two hot paths of every learned replay and sidecar, each one call into
``native_rows.c``: the rows of a scoring call (~100 candidates of an eviction sample:
~50 us in some forty small numpy operations, ~15 us native including the call), and
the update of one request's blocks (``kv_observe_rows``). Both are bit-identical to
the numpy code kept as the reference definition and the fallback
(``FeatureState._rows_numpy``, ``FeatureState._observe_rows_numpy``): the same integer
differences, the same double products and quotients, float32 sums in float32, one
rounding to float32 each, and no transcendental function in C (decay multipliers and
arrival rates come in computed by numpy).

``kernel()`` builds the library once per machine (``features.native_build``: the
system C compiler, cached by source hash), self-tests it against the numpy path on a
state with every kind of row (unknown blocks, blocks without parent or root, tiers,
decayed counters) and returns it; or returns None, with the reason in
``last_failure``, and rows stay on numpy: no compiler, a failed build or self-test,
or ``KVWARM_FEATURE_ROWS=numpy``. The call holds the GIL (``ctypes.PyDLL``): it is
microseconds, and no other thread can change the state's arrays under it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from features import native_build

if TYPE_CHECKING:
    from features.state import FeatureState

log = logging.getLogger(__name__)

ENV = "KVWARM_FEATURE_ROWS"
"""``native`` (default: the kernel when it builds and passes its self-test) or ``numpy``."""
BUILD_TIMEOUT_S = 60.0
SOURCE = Path(__file__).with_name("native_rows.c")

last_failure: str = ""
"""Why ``kernel()`` returned None ("" when it did not)."""

_lock = threading.Lock()
_loaded: tuple[bool, FeatureRowsKernel | None] = (False, None)

_P = ctypes.c_void_p
_I = ctypes.c_int64


class FeatureRowsKernel:
    """The loaded library: ``rows`` (``kv_feature_rows``) and ``observe``
    (``kv_observe_rows``)."""

    def __init__(self, library: Path) -> None:
        self.library = library
        loaded = ctypes.PyDLL(str(library))
        fn = loaded.kv_feature_rows
        fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _I, _P, _I, _P, _I, _I, _P, _P]
        fn.restype = None
        self._fn = fn
        update = loaded.kv_observe_rows
        update.argtypes = [_P, _I, _P, _I, _P, _I, _P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P]
        update.restype = None
        self._update = update

    def rows(
        self,
        state: FeatureState,
        slots: np.ndarray,
        now_ms: int,
        scale: np.ndarray,
        rates: list[float],
    ) -> np.ndarray:
        """Rows of ``slots`` (int64, -1 = unknown) at ``now_ms``, the state's clock
        already applied; ``scale`` and ``rates`` as the numpy path computes them."""
        layout = state._native_layout()
        n = slots.shape[0]
        out = np.empty((n, layout.width), dtype=np.float32)
        if n == 0:
            return out
        if int(slots.max()) >= state._i64.shape[0]:  # the C reads rows unchecked
            raise IndexError(f"slot {int(slots.max())} is not a row of this state")
        dbl = np.concatenate((layout.constants, scale, rates))
        self._fn(
            slots.ctypes.data, n, *layout.table_args(), layout.static_args,
            now_ms, state.num_requests, dbl.ctypes.data, out.ctypes.data,
        )  # fmt: skip
        return out

    def observe(
        self,
        state: FeatureState,
        slots: np.ndarray,
        ts_ms: int,
        weights: np.ndarray,
        new_pos: list[int],
        values: tuple[int, ...],
    ) -> None:
        """One request's row update (``FeatureState._observe_rows_numpy``'s arguments;
        ``values`` each within int32, ``weights`` float32)."""
        layout = state._native_layout()
        n = slots.shape[0]
        if layout.scratch.shape[0] < n * layout.row_bytes:
            layout.scratch = np.zeros(2 * n * layout.row_bytes, dtype=np.uint8)
        sl = np.ascontiguousarray(slots, dtype=np.int64)
        new = np.array(new_pos, dtype=np.int64)
        vals = np.array(values, dtype=np.int64)
        w = np.ascontiguousarray(weights, dtype=np.float32)
        self._update(
            sl.ctypes.data, n, *layout.table_args(), layout.observe.ctypes.data, ts_ms,
            w.ctypes.data, new.ctypes.data, new.shape[0], vals.ctypes.data,
            state._scored.ctypes.data, layout.scratch.ctypes.data,
        )  # fmt: skip


def kernel() -> FeatureRowsKernel | None:
    """The self-tested kernel, built on first use, or None (see ``last_failure``)."""
    global _loaded
    done, loaded = _loaded
    if done:
        return loaded
    with _lock:
        if not _loaded[0]:
            # Decided (None: numpy) while it builds and tests itself: the self-test's
            # own states, and other threads meanwhile, use numpy.
            _loaded = (True, None)
            _loaded = (True, _load())
        return _loaded[1]


def status() -> str:
    """What computes feature rows in this process, for health: ``native``, ``numpy
    (<why>)``, or ``undecided`` before the first row (reads only; never builds)."""
    done, loaded = _loaded
    if not done:
        return "undecided"
    return "native" if loaded is not None else f"numpy ({last_failure or 'building'})"


def reset() -> None:
    """Forget the loaded kernel: the next ``kernel()`` builds, tests and decides again."""
    global _loaded, last_failure
    with _lock:
        _loaded, last_failure = (False, None), ""


def _fail(why: str) -> None:
    global last_failure
    last_failure = why
    log.info("feature rows stay on numpy (%s)", why)


def _load() -> FeatureRowsKernel | None:
    global last_failure
    if os.environ.get(ENV, "native").strip().lower() == "numpy":
        _fail(f"{ENV}=numpy")
        return None
    try:
        source = SOURCE.read_text()
    except OSError as exc:
        _fail(f"cannot read {SOURCE.name}: {exc}")
        return None
    flags = native_build.DEFAULT_FLAGS
    library = native_build.library_path(
        source, native_build.cache_dir("native"), "feature-rows", flags
    )
    try:
        native_build.build_library(source, library, timeout_s=BUILD_TIMEOUT_S, flags=flags)
        loaded = FeatureRowsKernel(library)
    except (native_build.BuildError, OSError, AttributeError) as exc:
        _fail(str(exc))
        return None
    why = self_test(loaded)
    if why:
        _fail(f"self-test failed: {why}")
        return None
    last_failure = ""
    return loaded


def self_test(candidate: FeatureRowsKernel) -> str:
    """What differed from the numpy path's updates and rows on a small state with
    every kind of row, or "" when ``candidate`` gives them bit for bit."""
    from features.events import BlocksAccessed, BlockStored, Tier
    from features.state import FeatureParams, FeatureState

    rng = np.random.default_rng(0)
    params = FeatureParams(max_tracked_blocks=4_096, initial_capacity=64)
    state, reference = FeatureState(params), FeatureState(params)
    state.rows_kernel, reference.rows_kernel = candidate, False
    ts = 1_000
    for i in range(300):
        ts += int(rng.integers(0, 5_000))
        base = int(rng.integers(1, 40)) * 1_000
        depth = int(rng.integers(1, 24))
        blocks = tuple(base + j for j in range(depth)) + (10_000_000 + i,)
        if i % 13 == 5:
            blocks += blocks[:1]  # a block read twice by one request
        event = BlocksAccessed(
            ts_ms=ts,
            request_id=f"r{i}",
            block_hashes=blocks,
            block_size_tokens=16,
            session_id=f"s{i % 7}" if i % 3 else None,
            input_tokens=None if i % 5 == 0 else 16 * len(blocks),
            output_tokens=int(rng.integers(0, 500)),
        )
        state.observe(event)
        reference.observe(event)
        if i % 11 == 0:
            stored = BlockStored(
                ts_ms=ts,
                block_hashes=blocks[:3],
                parent_block_hash=None,
                block_size_tokens=16,
                tier=Tier.HBM if i % 2 else Tier.NVME,
            )
            state.observe(stored)
            reference.observe(stored)
    for got_table, expected_table in zip(state._arrays(), reference._arrays(), strict=True):
        if not np.array_equal(got_table, expected_table):
            return "the rows an update wrote differ from numpy's"
    hashes = np.concatenate((state.tracked_hashes(), np.array([1, 2, 3], dtype=np.uint64)))
    slots = state.slot_of(hashes)
    for now in (ts, ts + 1, ts + 3_600_000):
        expected = reference.features_for_slots(slots, now)
        got = state.features_for_slots(slots, now)
        if expected.shape != got.shape or not np.array_equal(expected, got):
            where = np.argwhere(expected != got)
            r, c = (int(v) for v in where[0]) if where.size else (-1, -1)
            return (
                f"row {r} column {state.feature_names[c] if c >= 0 else '?'} at now "
                f"{now}: {got[r, c] if r >= 0 else got.shape} != "
                f"{expected[r, c] if r >= 0 else expected.shape}"
            )
    return ""
