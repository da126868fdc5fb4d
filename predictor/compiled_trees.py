"""Tree ensembles compiled to native code: the learned path's fast evaluator.

``compile_ensemble(ensemble)`` turns a validated ``TreeEnsemble`` (``predictor.trees``:
indices in range, acyclic, finite values) into C, one block of branches per tree,
compiles it with the system C compiler into a shared library and loads it by ctypes.
``CompiledTrees.predict_raw(rows)`` then evaluates float32 rows in one call that
releases the GIL: LightGBM's raw score, bit-identical (the same float32 -> double
comparisons against the same double thresholds, with LightGBM's missing-value rules,
leaf values summed in double tree by tree). On the models kvwarm trains it is 4-17x
faster than LightGBM's own predictor through its C API (``kvwarm bench replay``
prints both), because each row is a few hundred predictable branches and no
per-call set-up.

Safety: only numbers from the validated arrays enter the C source (``repr`` of
doubles, integer indices), never text from the model file. Before a library is used
it must reproduce ``TreeEnsemble.predict_raw`` on a fixed set of rows with NaN,
zeros and extremes (``SELF_TEST_ROWS``) exactly; otherwise it is discarded.

Where it cannot be used, ``compile_ensemble`` returns ``None`` with the reason in
``last_failure`` and the caller keeps LightGBM's predictor: no C compiler (``$CC``,
else ``cc``), a compile that fails or takes longer than ``COMPILE_TIMEOUT_S``, a model
over ``MAX_NODES`` nodes, ``KVWARM_TREE_EVALUATOR=lightgbm``, or a failed self-test.

Libraries are cached by the hash of their source under ``$KVWARM_CACHE_DIR/trees``
(default ``~/.cache/kvwarm/trees``; a temporary directory when that is not writable),
so loading the same model again costs no compile; the ``MAX_CACHED_LIBRARIES`` most
recently used are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import os
from pathlib import Path

import numpy as np

from features import native_build
from predictor.trees import TreeEnsemble

log = logging.getLogger(__name__)

MAX_NODES = 2_000_000
"""Larger models stay on LightGBM's predictor (source and compile time grow with nodes)."""
COMPILE_TIMEOUT_S = 120.0
MAX_CACHED_LIBRARIES = 64
"""The cache keeps the most recently used libraries; older ones are deleted on a compile."""
SELF_TEST_ROWS = 512
EVALUATOR_ENV = "KVWARM_TREE_EVALUATOR"
"""``compiled`` (default: compiled when possible) or ``lightgbm`` (never compile)."""

last_failure: str = ""
"""Why the last ``compile_ensemble`` returned None ("" after a success)."""

_K_ZERO = "1e-35"  # LightGBM's kZeroThreshold


def _c_double(value: float) -> str:
    if math.isinf(value):
        return "INFINITY" if value > 0 else "-INFINITY"
    return repr(float(value))


def c_source(ensemble: TreeEnsemble) -> str:
    """C source of ``kv_predict_raw(const float *x, int64 n, int64 stride, double *out)``.

    Each internal node is a label and one test; a leaf adds its value and jumps to the
    next tree. The test is LightGBM's ``NumericalDecision``: NaN counts as 0 unless
    the node's missing type is NaN; a missing value (NaN for type NaN, |v| <= 1e-35 for
    type Zero) goes the default direction; otherwise ``v <= threshold`` goes left."""
    e = ensemble
    lines = [
        "#include <math.h>",
        "#include <stdint.h>",
        f"#define KV_ZERO(v) ((v) > -{_K_ZERO} && (v) <= {_K_ZERO})",
        "void kv_predict_raw(const float *x, int64_t n, int64_t stride, double *out) {",
        "  for (int64_t r = 0; r < n; ++r) {",
        "    const float *row = x + r * stride;",
        "    double s = 0.0, v;",
    ]
    feature = e.feature.tolist()
    threshold = e.threshold.tolist()
    left, right = e.left.tolist(), e.right.tolist()
    default_left = e.default_left.tolist()
    missing = e.missing_type.tolist()
    value = e.value.tolist()
    for t, root in enumerate(e.roots.tolist()):
        done = f"t{t}_done"
        stack = [root]
        while stack:
            i = stack.pop()
            if left[i] == i:  # a leaf
                lines.append(f"    n{i}: s += {_c_double(value[i])}; goto {done};")
                continue
            f, go_left, go_right = feature[i], f"n{left[i]}", f"n{right[i]}"
            test = f"v <= {_c_double(threshold[i])}"
            default = go_left if default_left[i] else go_right
            if missing[i] == 2:  # NaN is missing
                lines.append(
                    f"    n{i}: v = (double)row[{f}]; if (isnan(v)) goto {default}; "
                    f"if ({test}) goto {go_left}; goto {go_right};"
                )
            else:
                body = f"    n{i}: v = (double)row[{f}]; if (isnan(v)) v = 0.0; "
                if missing[i] == 1:  # zero is missing
                    body += f"if (KV_ZERO(v)) goto {default}; "
                lines.append(body + f"if ({test}) goto {go_left}; goto {go_right};")
            stack += [right[i], left[i]]
        lines.append(f"    {done}:;")
    lines += ["    out[r] = s;", "  }", "}"]
    return "\n".join(lines) + "\n"


class CompiledTrees:
    """A loaded library of one ensemble; see the module docstring."""

    def __init__(self, library: Path, num_features: int) -> None:
        self.library = library
        self.num_features = num_features
        self._lib = ctypes.CDLL(str(library))
        fn = self._lib.kv_predict_raw
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = None
        self._fn = fn

    def __deepcopy__(self, memo: dict[int, object]) -> CompiledTrees:
        return self  # immutable code: copies of a policy share it

    def __reduce__(self) -> tuple[type[CompiledTrees], tuple[Path, int]]:
        return (CompiledTrees, (self.library, self.num_features))

    def predict_raw(self, features: np.ndarray) -> np.ndarray:
        """LightGBM's raw score per row (float64) of float32 ``features`` (n, num_features)."""
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.num_features:
            raise ValueError(f"expected features of shape (n, {self.num_features}), got {x.shape}")
        out = np.empty(x.shape[0], dtype=np.float64)
        if x.shape[0]:
            self._fn(x.ctypes.data, x.shape[0], x.shape[1], out.ctypes.data)
        return out


def self_test_rows(num_features: int, seed: int = 0) -> np.ndarray:
    """Rows that reach every kind of branch: normal values at several scales, NaN,
    exact zeros, +-1e-36 (zero for LightGBM), huge values and +-inf."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SELF_TEST_ROWS, num_features)) * rng.choice(
        [1e-3, 1.0, 1e3, 1e6], size=(SELF_TEST_ROWS, num_features)
    )
    special = np.array([np.nan, 0.0, 1e-36, -1e-36, 3e38, -3e38, np.inf, -np.inf])
    mask = rng.random(x.shape) < 0.2
    x[mask] = rng.choice(special, size=int(mask.sum()))
    return x.astype(np.float32)


def _cache_dir() -> Path:
    return native_build.cache_dir("trees")


def _prune(directory: Path, keep: Path) -> None:
    """Delete all but the ``MAX_CACHED_LIBRARIES`` most recently used libraries (a
    process that has one loaded keeps its mapping; only the file goes)."""
    with contextlib.suppress(OSError):
        libraries = sorted(
            directory.glob("trees-*.so"), key=lambda p: p.stat().st_mtime, reverse=True
        )
        for old in libraries[MAX_CACHED_LIBRARIES:]:
            if old != keep:
                old.unlink(missing_ok=True)


def _fail(why: str) -> None:
    global last_failure
    last_failure = why
    log.info("tree ensemble not compiled (%s): LightGBM's predictor scores", why)


def compile_ensemble(ensemble: TreeEnsemble) -> CompiledTrees | None:
    """The ensemble compiled and self-tested, or None (``last_failure`` says why)."""
    global last_failure
    if os.environ.get(EVALUATOR_ENV, "compiled").strip().lower() == "lightgbm":
        _fail(f"{EVALUATOR_ENV}=lightgbm")
        return None
    if ensemble.feature.shape[0] > MAX_NODES:
        _fail(f"{ensemble.feature.shape[0]:,} nodes, over {MAX_NODES:,}")
        return None
    source = c_source(ensemble)
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    directory = _cache_dir()
    library = directory / f"trees-{digest}.so"
    try:
        built = native_build.build_library(
            source, library, timeout_s=COMPILE_TIMEOUT_S, flags=("-O2", "-fno-math-errno")
        )
    except native_build.BuildError as exc:
        _fail(str(exc))
        return None
    if built:
        _prune(directory, keep=library)
    else:
        with contextlib.suppress(OSError):
            os.utime(library)  # recently used: pruned last
    try:
        compiled = CompiledTrees(library, ensemble.num_features)
    except OSError as exc:
        _fail(f"cannot load {library.name}: {exc}")
        return None
    rows = self_test_rows(ensemble.num_features)
    expected = ensemble.predict_raw(rows)
    got = compiled.predict_raw(rows)
    if not np.array_equal(expected, got):
        bad = int(np.argmax(expected != got))
        _fail(f"self-test failed at row {bad}: {got[bad]!r} != {expected[bad]!r}")
        return None
    last_failure = ""
    return compiled
