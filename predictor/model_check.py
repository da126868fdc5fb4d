"""Checks a model must pass before it serves: structure first, then a timed probe.

Primitives (called by ``serving.model_lifecycle`` for the initial load and for every
hot-swap, before the new policy is installed):

- ``check_lightgbm_structure(text, path, num_features)``: the structural parse of a
  LightGBM text model, run before LightGBM itself reads the file. LightGBM trusts its
  model file: an out-of-range ``split_feature`` or child index reads out of bounds
  (a segfault on the first score) and a child that points back up the tree loops
  forever. Refused here: feature indices outside ``[0, num_features)``, child indices
  outside the tree, a node reached twice from the root (cycles, shared subtrees),
  non-finite leaf values, thresholds or shrinkage, array lengths that disagree with
  ``num_leaves``, categorical splits without their bitsets, a truncated file.
- ``probe_policy(policy, timeout_s)``: scores a fixed probe batch in a worker thread
  and waits at most ``timeout_s``; refuses a policy whose scoring does not return in
  time (a looping model), raises, or returns non-finite or out-of-range scores.

Both raise ``ModelCheckError`` (a ``PolicyLoadError``) with the reason; the caller
keeps the previous policy (or LRU) serving.

The structural parse of tree models belongs to ``predictor.trees`` when that module
is present (``parse_lightgbm_model(text)``, raising ``PolicyLoadError``); the checker
below is the stand-in used until then, and is called only when it is absent.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from predictor.base import Policy, PolicyLoadError

DEFAULT_PROBE_TIMEOUT_S = 5.0
"""How long a probe batch may take to score before the model is refused."""

PROBE_NUM_ROWS = 64
"""Rows in the probe batch: typical, zero, huge and negative feature values."""

MAX_TREES = 100_000
"""The most trees a model may declare (``LightGBMParams.num_boost_round`` caps at this)."""

MAX_LEAVES = 131_072
"""The most leaves one tree may declare (LightGBM's own ``num_leaves`` limit)."""


class ModelCheckError(PolicyLoadError):
    """A model failed a pre-serving check; the message names the file and the check."""


class ModelProbeError(ModelCheckError):
    """A model loaded but its probe batch hung, raised or gave unusable scores."""


# --- LightGBM structure ------------------------------------------------------------------


def check_lightgbm_structure(text: str, path: str | Path, num_features: int) -> None:
    """Refuse a LightGBM text model whose trees LightGBM could not score safely.

    Called on the file's text before ``lightgbm.Booster`` reads it. Delegates to
    ``predictor.trees.parse_lightgbm_model`` when that module exists.
    """
    parse = _trees_parser()
    if parse is not None:
        try:
            parse(text)
        except PolicyLoadError as exc:
            raise ModelCheckError(path, exc.why) from exc
        except (ValueError, IndexError, KeyError) as exc:
            raise ModelCheckError(path, f"not a valid LightGBM model ({exc})") from exc
        _check_header(text, path, num_features)
        return
    _check_lightgbm_fallback(text, path, num_features)


def _trees_parser() -> Callable[[str], Any] | None:
    try:
        from predictor import trees  # type: ignore[attr-defined]
    except ImportError:
        return None
    return getattr(trees, "parse_lightgbm_model", None)


def _header(text: str) -> dict[str, str]:
    head, _, _ = text.partition("\nTree=")
    out: dict[str, str] = {}
    for line in head.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _check_header(text: str, path: str | Path, num_features: int) -> dict[str, str]:
    header = _header(text)
    if not header.get("version", "").startswith("v") or "max_feature_idx" not in header:
        raise ModelCheckError(path, "no LightGBM header (version=, max_feature_idx=)")
    try:
        max_feature_idx = int(header["max_feature_idx"])
    except ValueError:
        raise ModelCheckError(path, "max_feature_idx is not an integer") from None
    if max_feature_idx != num_features - 1:
        raise ModelCheckError(
            path, f"max_feature_idx={max_feature_idx}, expected {num_features - 1}"
        )
    if header.get("num_class", "1") != "1" or header.get("num_tree_per_iteration", "1") != "1":
        raise ModelCheckError(path, "multiclass models are not kvwarm policies")
    if "\nend of trees" not in text:
        raise ModelCheckError(path, "no 'end of trees' marker: the file is truncated")
    return header


def _check_lightgbm_fallback(text: str, path: str | Path, num_features: int) -> None:
    _check_header(text, path, num_features)
    body = text.partition("\nend of trees")[0]
    blocks = body.split("\nTree=")[1:]
    if not blocks:
        raise ModelCheckError(path, "no trees")
    if len(blocks) > MAX_TREES:
        raise ModelCheckError(path, f"{len(blocks)} trees, at most {MAX_TREES}")
    for index, block in enumerate(blocks):
        _check_tree(block, f"tree {index}", path, num_features)


def _ints(fields: dict[str, str], key: str, count: int, where: str, path: str | Path) -> list[int]:
    raw = fields.get(key, "").split()
    if len(raw) != count:
        raise ModelCheckError(path, f"{where}: {key} has {len(raw)} values, expected {count}")
    try:
        return [int(v) for v in raw]
    except ValueError:
        raise ModelCheckError(path, f"{where}: {key} holds a non-integer") from None


def _floats(
    fields: dict[str, str], key: str, count: int, where: str, path: str | Path
) -> list[float]:
    raw = fields.get(key, "").split()
    if len(raw) != count:
        raise ModelCheckError(path, f"{where}: {key} has {len(raw)} values, expected {count}")
    try:
        values = [float(v) for v in raw]
    except ValueError:
        raise ModelCheckError(path, f"{where}: {key} holds a non-number") from None
    if not all(math.isfinite(v) for v in values):
        raise ModelCheckError(path, f"{where}: {key} holds nan or inf")
    return values


def _check_tree(block: str, where: str, path: str | Path, num_features: int) -> None:
    fields: dict[str, str] = {}
    for line in block.splitlines()[1:]:
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        num_leaves = int(fields["num_leaves"])
        num_cat = int(fields.get("num_cat", "0"))
    except (KeyError, ValueError):
        raise ModelCheckError(
            path, f"{where}: num_leaves/num_cat missing or not integers"
        ) from None
    if not 1 <= num_leaves <= MAX_LEAVES:
        raise ModelCheckError(path, f"{where}: num_leaves={num_leaves}, not in [1, {MAX_LEAVES}]")
    if num_cat < 0:
        raise ModelCheckError(path, f"{where}: num_cat={num_cat} is negative")
    if fields.get("is_linear", "0") != "0":
        raise ModelCheckError(path, f"{where}: linear trees are not supported")
    shrinkage = _floats(fields, "shrinkage", 1, where, path) if "shrinkage" in fields else []
    del shrinkage
    _floats(fields, "leaf_value", num_leaves, where, path)
    num_internal = num_leaves - 1
    if num_internal == 0:
        return
    split_feature = _ints(fields, "split_feature", num_internal, where, path)
    threshold = _floats(fields, "threshold", num_internal, where, path)
    decision_type = _ints(fields, "decision_type", num_internal, where, path)
    left = _ints(fields, "left_child", num_internal, where, path)
    right = _ints(fields, "right_child", num_internal, where, path)
    bad = [f for f in split_feature if not 0 <= f < num_features]
    if bad:
        raise ModelCheckError(path, f"{where}: split_feature {bad[0]} outside [0, {num_features})")
    if any(not 0 <= d < 16 for d in decision_type):
        raise ModelCheckError(path, f"{where}: decision_type outside [0, 16)")
    if num_cat:
        boundaries = _ints(fields, "cat_boundaries", num_cat + 1, where, path)
        num_words = len(fields.get("cat_threshold", "").split())
        if boundaries[0] != 0 or boundaries[-1] != num_words or boundaries != sorted(boundaries):
            raise ModelCheckError(path, f"{where}: cat_boundaries do not index cat_threshold")
    for node in range(num_internal):
        if decision_type[node] & 1:  # categorical: the threshold indexes cat_boundaries
            cat = threshold[node]
            if not (cat.is_integer() and 0 <= cat < num_cat):
                raise ModelCheckError(path, f"{where}: categorical split {cat} outside num_cat")
    # Every node reached exactly once from the root: no cycle, no shared subtree,
    # every child index in range (>= 0: internal node; < 0: leaf ~index).
    seen_internal = [False] * num_internal
    seen_leaf = [False] * num_leaves
    stack = [0]
    while stack:
        node = stack.pop()
        if seen_internal[node]:
            raise ModelCheckError(path, f"{where}: node {node} is reached twice (a cycle)")
        seen_internal[node] = True
        for child in (left[node], right[node]):
            if child >= 0:
                if child >= num_internal:
                    raise ModelCheckError(
                        path, f"{where}: child {child} outside [0, {num_internal})"
                    )
                stack.append(child)
            else:
                leaf = ~child
                if leaf >= num_leaves:
                    raise ModelCheckError(path, f"{where}: leaf {leaf} outside [0, {num_leaves})")
                if seen_leaf[leaf]:
                    raise ModelCheckError(path, f"{where}: leaf {leaf} is reached twice")
                seen_leaf[leaf] = True


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
