"""Checks a model must pass before it serves, besides its structural parse.

The structural parse of LightGBM trees (indices in range, acyclic, finite values) is
``predictor.trees.parse_lightgbm_model``; this module adds what surrounds it.

Primitives (called by the policies' loaders and by ``serving.model_lifecycle`` for the
initial load and every hot-swap, before the new policy is installed):

- ``read_model_text(path)``: a model file's text, refused over ``MAX_MODEL_FILE_BYTES``
  or when not UTF-8.
- ``without_tree_sizes(text)``: the text handed to LightGBM (see its docstring: a
  wrong ``tree_sizes`` offset aborts the process inside LightGBM's parallel parser).
- ``check_lstm_weights(state, path)``: refuses nan/inf weights and a zero normaliser std.
- ``probe_policy(policy, timeout_s)``: scores a fixed probe batch in a worker thread
  and waits at most ``timeout_s``; refuses a policy whose scoring does not return in
  time (a looping model), raises, or returns non-finite or out-of-range scores.

Failures raise ``ModelCheckError`` (``ModelProbeError`` for the probe), both
``PolicyLoadError``s with the reason; the caller keeps the previous policy (or LRU)
serving.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from predictor.base import Policy, PolicyLoadError

DEFAULT_PROBE_TIMEOUT_S = 5.0
"""How long a probe batch may take to score before the model is refused."""

PROBE_NUM_ROWS = 64
"""Rows in the probe batch: typical, zero, huge and negative feature values."""


class ModelCheckError(PolicyLoadError):
    """A model failed a pre-serving check; the message names the file and the check."""


class ModelProbeError(ModelCheckError):
    """A model loaded but its probe batch hung, raised or gave unusable scores."""


# --- LightGBM text handed to LightGBM ---------------------------------------------------


def without_tree_sizes(text: str) -> str:
    """The model text minus its ``tree_sizes=`` line, the form handed to LightGBM.

    With that line LightGBM parses trees in parallel at the byte offsets it declares;
    a file edited by hand (or by an attacker) declares wrong offsets and the parse
    error, thrown inside an OpenMP thread, aborts the process. Without it LightGBM
    parses sequentially and a bad tree is an ordinary ``LightGBMError``.
    """
    head, sep, rest = text.partition("\nTree=")
    head = "\n".join(line for line in head.split("\n") if not line.startswith("tree_sizes="))
    return head + sep + rest


# --- the timed probe ---------------------------------------------------------------------


def probe_rows(num_features: int, num_rows: int = PROBE_NUM_ROWS) -> np.ndarray:
    """The probe batch: zeros, ones, typical values, huge and negative values."""
    rng = np.random.default_rng(12345)
    rows = rng.random((num_rows, num_features)).astype(np.float32)
    rows[:, :] *= rng.choice([1.0, 1e3, 1e6], size=(num_rows, 1)).astype(np.float32)
    rows[0] = 0.0
    rows[1] = 1.0
    rows[2] = 1e12
    rows[3] = -1.0
    return rows


def _probe_scores(policy: Policy) -> np.ndarray:
    predict = getattr(policy, "predict_features", None)
    feature_names = getattr(policy, "feature_names", None)
    if predict is not None and feature_names is not None:
        return np.asarray(predict(probe_rows(len(feature_names))))
    hashes = np.arange(1, PROBE_NUM_ROWS + 1, dtype=np.uint64)
    return np.asarray(policy.score(hashes, 0))


def probe_policy(
    policy: Policy, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, *, where: str | Path = "<model>"
) -> None:
    """Score the probe batch within ``timeout_s``; raise ``ModelCheckError`` if it hangs,
    raises, or returns a non-finite (or, for probabilities, out-of-[0, 1]) score.

    The scoring runs in a daemon thread: a model that never returns strands that thread
    (native code cannot be interrupted) but never the caller.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["scores"] = _probe_scores(policy)
        except BaseException as exc:  # reported to the caller, never lost in the thread
            result["error"] = exc

    worker = threading.Thread(target=run, name="kvwarm-model-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ModelProbeError(
            where,
            f"scoring a probe batch of {PROBE_NUM_ROWS} rows did not finish in {timeout_s:g} s "
            "(a looping or far too slow model)",
        )
    if "error" in result:
        exc = result["error"]
        raise ModelProbeError(where, f"scoring a probe batch raised {type(exc).__name__}: {exc}")
    check_scores(result["scores"], policy, where)


def check_scores(scores: np.ndarray, policy: Policy, where: str | Path = "<model>") -> None:
    """Raise ``ModelCheckError`` unless ``scores`` are finite (and in [0, 1] for a
    policy whose scores are probabilities)."""
    scores = np.asarray(scores)
    finite = np.isfinite(scores)
    if not finite.all():
        raise ModelProbeError(
            where, f"{int((~finite).sum())} of {scores.size} probe scores are nan or inf"
        )
    if policy.outputs_probability and scores.size and (scores.min() < 0 or scores.max() > 1):
        raise ModelProbeError(
            where,
            f"probe scores span [{scores.min():.4g}, {scores.max():.4g}], outside [0, 1]",
        )


MAX_MODEL_FILE_BYTES = 1 << 30
"""The largest model file read (1 GiB): a bigger one is refused before it is read."""


def read_model_text(path: Path) -> str:
    """A text model file, refused when missing, over ``MAX_MODEL_FILE_BYTES`` or not UTF-8."""
    try:
        size_bytes = path.stat().st_size
        if size_bytes > MAX_MODEL_FILE_BYTES:
            raise ModelCheckError(
                path, f"{size_bytes} bytes, more than the {MAX_MODEL_FILE_BYTES} allowed"
            )
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ModelCheckError(path, f"cannot read ({exc})") from exc
    except UnicodeDecodeError:
        raise ModelCheckError(path, "not a text model (invalid UTF-8)") from None


# --- LSTM weights ------------------------------------------------------------------------


def check_lstm_weights(state: dict[str, Any], path: str | Path) -> None:
    """Refuse LSTM weights with a nan/inf tensor or a zero (or negative) normaliser std.

    Called after the state dict is loaded into the network, before the first probe.
    """
    for name, tensor in state.items():
        values = tensor.detach().float()
        if not bool(values.isfinite().all()):
            raise ModelCheckError(path, f"weights {name!r} hold nan or inf")
        if name.endswith("_std") and bool((values <= 0).any()):
            raise ModelCheckError(path, f"normaliser {name!r} has a std <= 0 (divides by zero)")
