"""Tree ensembles parsed from LightGBM's text model, validated, evaluated with numpy.

Primitives:

- ``parse_lightgbm_model(text, path=...) -> TreeEnsemble``: parses ``model.txt`` and
  checks its structure before anything scores with it: feature indices in range,
  child indices in range, every tree acyclic with each node reached exactly once from
  its root, finite leaf values, thresholds that are numbers (+-inf allowed: LightGBM
  writes inf for a split that separates only NaN), a supported objective. A model that
  fails raises ``PolicyLoadError`` naming the tree, the node and the problem; a
  malformed file can never make scoring crash or loop (LightGBM's own predictor
  trusts the file: an out-of-range index reads outside its arrays, a cycle never
  returns).
- ``TreeEnsemble.predict(X) -> np.ndarray``: what ``lightgbm.Booster.predict(X)``
  returns (the objective's transform applied: sigmoid for ``binary``), float64, equal
  to LightGBM's output within 1e-12 on the same float32 rows (unit-tested on random and
  real feature rows); ``predict_raw(X)`` without the transform.

How it evaluates: every tree's nodes live in one set of flat arrays; leaves are nodes
that point to themselves with threshold +inf, so all trees of all rows advance one
level per step in a handful of vectorised gathers and comparisons, for exactly
``max_depth`` steps, with no per-row or per-tree Python work. The split rule is
LightGBM's numerical decision, missing values included: a NaN input counts as 0
unless the split's missing type is NaN; a missing value (NaN, or zero for missing
type Zero) goes the split's default direction; otherwise ``x <= threshold`` goes
left. Leaf values are summed in float64, tree by tree, as LightGBM does.

Not supported (refused at parse time with the reason): categorical splits, linear
trees, multi-class models, ``average_output`` (random forest) models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from predictor.base import PolicyLoadError

__all__ = ["TreeEnsemble", "parse_lightgbm_model"]

_K_ZERO_THRESHOLD = 1e-35  # LightGBM's kZeroThreshold: |x| <= this is "zero"
_MISSING_NONE, _MISSING_ZERO, _MISSING_NAN = 0, 1, 2
_MAX_TREES = 1_000_000
_MAX_LEAVES = 1 << 17
_OBJECTIVES = ("binary", "regression", "regression_l2", "regression_l1", "huber", "fair")


@dataclass(frozen=True)
class TreeEnsemble:
    """Validated trees in flat arrays; see the module docstring.

    Node ``i`` of the flat arrays splits on ``feature[i]`` at ``threshold[i]`` and
    continues to ``left[i]`` or ``right[i]``; a leaf has ``left == right == i``,
    threshold +inf and its value in ``value[i]`` (0 for split nodes)."""

    num_features: int
    roots: np.ndarray  # int32, one per tree
    feature: np.ndarray  # int32
    threshold: np.ndarray  # float64
    left: np.ndarray  # int32
    right: np.ndarray  # int32
    default_left: np.ndarray  # bool
    missing_type: np.ndarray  # int8
    value: np.ndarray  # float64
    max_depth: int
    objective: str
    sigmoid: float = 1.0

    @property
    def num_trees(self) -> int:
        return int(self.roots.shape[0])

    def predict_raw(self, features: np.ndarray) -> np.ndarray:
        """Sum of leaf values per row (float64), LightGBM's raw score."""
        x = np.asarray(features)
        if x.ndim != 2 or x.shape[1] != self.num_features:
            raise ValueError(f"expected features of shape (n, {self.num_features}), got {x.shape}")
        n = x.shape[0]
        if n == 0 or self.num_trees == 0:
            return np.zeros(n, dtype=np.float64)
        x = x.astype(np.float64, copy=False)
        # Row offsets into the flattened matrix: x.flat[row_base + feature] is one gather.
        flat = np.ascontiguousarray(x).reshape(-1)
        row_base = (np.arange(n, dtype=np.int64) * self.num_features)[:, None]
        node = np.broadcast_to(self.roots, (n, self.num_trees)).copy()
        has_missing = bool((self.missing_type != _MISSING_NONE).any())
        nan_rows = has_missing or bool(np.isnan(flat).any())
        for _ in range(self.max_depth):
            v = flat[row_base + self.feature[node]]
            if nan_rows:
                go_left = self._decide_with_missing(v, node)
            else:
                go_left = v <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        # Tree by tree, in float64, in model order: LightGBM's summation order.
        leaf_values = self.value[node]
        out = leaf_values[:, 0].copy()
        for t in range(1, self.num_trees):
            out += leaf_values[:, t]
        return out

    def _decide_with_missing(self, v: np.ndarray, node: np.ndarray) -> np.ndarray:
        mt = self.missing_type[node]
        isnan = np.isnan(v)
        v = np.where(isnan & (mt != _MISSING_NAN), 0.0, v)
        missing = ((mt == _MISSING_ZERO) & (v > -_K_ZERO_THRESHOLD) & (v <= _K_ZERO_THRESHOLD)) | (
            (mt == _MISSING_NAN) & isnan
        )
        return np.where(missing, self.default_left[node], v <= self.threshold[node])

    def predict(self, features: np.ndarray) -> np.ndarray:
        """``lightgbm.Booster.predict`` equivalent: the objective's transform applied."""
        return self.transform(self.predict_raw(features))

    def transform(self, raw: np.ndarray) -> np.ndarray:
        """The objective's transform of raw scores, as LightGBM computes it (the
        sigmoid for ``binary``; none for regression)."""
        if self.objective == "binary":
            return 1.0 / (1.0 + np.exp(-self.sigmoid * raw))
        return raw


def _fail(path: str | Path, why: str) -> PolicyLoadError:
    return PolicyLoadError(path, why)


def _numbers(
    fields: dict[str, str], key: str, count: int, dtype: type, where: str, path: str | Path
) -> np.ndarray:
    if key not in fields:
        raise _fail(path, f"{where}: '{key}' is missing")
    text = fields[key].strip()
    try:
        values: np.ndarray = np.array(text.split(" ") if text else [], dtype=dtype)
    except (ValueError, OverflowError) as exc:
        raise _fail(path, f"{where}: '{key}' is not a list of numbers ({exc})") from exc
    if values.shape[0] != count:
        raise _fail(path, f"{where}: '{key}' has {values.shape[0]} values, expected {count}")
    return values


def parse_lightgbm_model(text: str, path: str | Path = "<model text>") -> TreeEnsemble:
    """Parse and validate LightGBM's text model format; see the module docstring.

    Raises ``PolicyLoadError`` (naming ``path``, the tree, the node and the problem)
    for anything LightGBM's predictor would read outside its arrays, loop on, or
    score as non-finite."""
    blocks = text.split("\nTree=")
    header = _key_values(blocks[0])
    if header.get("tree") is None and not blocks[0].startswith("tree"):
        raise _fail(path, "not a LightGBM text model (no 'tree' header line)")
    try:
        max_feature_idx = int(header["max_feature_idx"])
        num_class = int(header.get("num_class", "1"))
        per_iteration = int(header.get("num_tree_per_iteration", "1"))
    except (KeyError, ValueError) as exc:
        raise _fail(
            path, f"header: max_feature_idx/num_class missing or not integers ({exc})"
        ) from exc
    if not 0 <= max_feature_idx < 1_000_000:
        raise _fail(path, f"header: max_feature_idx {max_feature_idx} out of range")
    if num_class != 1 or per_iteration != 1:
        raise _fail(path, f"header: {num_class} classes; only single-output models are supported")
    if "average_output" in header or blocks[0].splitlines().count("average_output"):
        raise _fail(path, "header: average_output (random forest) models are not supported")
    objective_words = header.get("objective", "").split()
    objective = objective_words[0] if objective_words else ""
    if objective not in _OBJECTIVES:
        raise _fail(path, f"header: objective {objective!r} is not one of {_OBJECTIVES}")
    sigmoid = 1.0
    for word in objective_words[1:]:
        if word.startswith("sigmoid:"):
            try:
                sigmoid = float(word.split(":", 1)[1])
            except ValueError as exc:
                raise _fail(path, f"header: bad sigmoid in objective ({exc})") from exc
    if not math.isfinite(sigmoid) or sigmoid <= 0:
        raise _fail(path, f"header: sigmoid {sigmoid} must be finite and positive")
    num_features = max_feature_idx + 1

    tree_texts = blocks[1:]
    if len(tree_texts) > _MAX_TREES:
        raise _fail(path, f"{len(tree_texts)} trees, more than {_MAX_TREES}")
    roots: list[int] = []
    feats, thrs, lefts, rights, dls, mts, vals = [], [], [], [], [], [], []
    offset = 0
    max_depth = 0
    for t, body in enumerate(tree_texts):
        # The last tree's text runs into the footer ("end of trees", feature importances).
        body = body.split("\nend of trees", 1)[0]
        first, _, rest = body.partition("\n")
        where = f"tree {t}"
        if first.strip() != str(t):
            raise _fail(path, f"{where}: header says Tree={first.strip()!r}, expected {t}")
        fields = _key_values(rest)
        try:
            num_leaves = int(fields["num_leaves"])
        except (KeyError, ValueError) as exc:
            raise _fail(path, f"{where}: num_leaves missing or not an integer") from exc
        if not 1 <= num_leaves <= _MAX_LEAVES:
            raise _fail(path, f"{where}: num_leaves {num_leaves} out of range 1..{_MAX_LEAVES}")
        if fields.get("num_cat", "0").strip() != "0":
            raise _fail(path, f"{where}: categorical splits are not supported")
        if fields.get("is_linear", "0").strip() != "0":
            raise _fail(path, f"{where}: linear trees are not supported")
        leaf_value = _numbers(fields, "leaf_value", num_leaves, np.float64, where, path)
        bad = np.flatnonzero(~np.isfinite(leaf_value))
        if bad.size:
            raise _fail(
                path, f"{where} leaf {bad[0]}: leaf_value {leaf_value[bad[0]]} is not finite"
            )
        n_int = num_leaves - 1
        n_nodes = n_int + num_leaves
        if n_int == 0:
            # A single leaf: one self-looping node.
            roots.append(offset)
            feats.append(np.zeros(1, np.int32))
            thrs.append(np.full(1, np.inf))
            lefts.append(np.array([offset], np.int32))
            rights.append(np.array([offset], np.int32))
            dls.append(np.zeros(1, bool))
            mts.append(np.zeros(1, np.int8))
            vals.append(leaf_value)
            offset += 1
            continue
        split_feature = _numbers(fields, "split_feature", n_int, np.int64, where, path)
        threshold = _numbers(fields, "threshold", n_int, np.float64, where, path)
        decision_type = _numbers(fields, "decision_type", n_int, np.int64, where, path)
        left = _numbers(fields, "left_child", n_int, np.int64, where, path)
        right = _numbers(fields, "right_child", n_int, np.int64, where, path)
        for i in range(n_int):
            f = int(split_feature[i])
            if not 0 <= f < num_features:
                raise _fail(
                    path,
                    f"{where} node {i}: split_feature {f} out of range 0..{num_features - 1}",
                )
            if math.isnan(float(threshold[i])):
                # +-inf is legitimate: LightGBM writes "inf" for a split that separates
                # only missing (NaN) values; a comparison with it is well defined.
                raise _fail(path, f"{where} node {i}: threshold is NaN")
            if int(decision_type[i]) & 1:
                raise _fail(path, f"{where} node {i}: categorical splits are not supported")
            if not 0 <= int(decision_type[i]) < 16 or (int(decision_type[i]) >> 2) & 3 == 3:
                raise _fail(path, f"{where} node {i}: decision_type {decision_type[i]} is invalid")
        depth = _check_tree_shape(left, right, num_leaves, where, path)
        max_depth = max(max_depth, depth)
        # Flat layout: internal nodes [offset, offset + n_int), leaves after them.
        leaf0 = offset + n_int

        def to_flat(child: np.ndarray, offset: int = offset, leaf0: int = leaf0) -> np.ndarray:
            return np.where(child >= 0, offset + child, leaf0 + (-child - 1)).astype(np.int32)

        leaf_ids = np.arange(leaf0, leaf0 + num_leaves, dtype=np.int32)
        roots.append(offset)
        feats.append(
            np.concatenate([split_feature.astype(np.int32), np.zeros(num_leaves, np.int32)])
        )
        thrs.append(np.concatenate([threshold, np.full(num_leaves, np.inf)]))
        lefts.append(np.concatenate([to_flat(left), leaf_ids]))
        rights.append(np.concatenate([to_flat(right), leaf_ids]))
        dls.append(np.concatenate([(decision_type & 2) != 0, np.zeros(num_leaves, bool)]))
        mts.append(
            np.concatenate(
                [((decision_type >> 2) & 3).astype(np.int8), np.zeros(num_leaves, np.int8)]
            )
        )
        vals.append(np.concatenate([np.zeros(n_int), leaf_value]))
        offset += n_nodes

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return TreeEnsemble(
        num_features=num_features,
        roots=np.array(roots, dtype=np.int32),
        feature=cat(feats, np.int32),
        threshold=cat(thrs, np.float64),
        left=cat(lefts, np.int32),
        right=cat(rights, np.int32),
        default_left=cat(dls, bool),
        missing_type=cat(mts, np.int8),
        value=cat(vals, np.float64),
        max_depth=max_depth,
        objective="binary" if objective == "binary" else "regression",
        sigmoid=sigmoid,
    )


def _check_tree_shape(
    left: np.ndarray, right: np.ndarray, num_leaves: int, where: str, path: str | Path
) -> int:
    """Children in range, every node reached exactly once from the root (so no cycle
    and no shared subtree), every leaf reached; returns the depth (edges to the
    deepest leaf)."""
    n_int = num_leaves - 1
    seen_internal = np.zeros(n_int, dtype=bool)
    seen_leaf = np.zeros(num_leaves, dtype=bool)
    stack = [(0, 0)]
    seen_internal[0] = True
    depth = 0
    while stack:
        node, d = stack.pop()
        for side, child in (("left_child", int(left[node])), ("right_child", int(right[node]))):
            if child >= 0:
                if child >= n_int:
                    raise _fail(
                        path, f"{where} node {node}: {side} {child} out of range 0..{n_int - 1}"
                    )
                if seen_internal[child]:
                    raise _fail(
                        path,
                        f"{where} node {node}: {side} {child} is reached twice (a cycle or a shared subtree)",
                    )
                seen_internal[child] = True
                stack.append((child, d + 1))
            else:
                leaf = -child - 1
                if leaf >= num_leaves:
                    raise _fail(
                        path,
                        f"{where} node {node}: {side} {child} names leaf {leaf}, "
                        f"out of range 0..{num_leaves - 1}",
                    )
                if seen_leaf[leaf]:
                    raise _fail(path, f"{where} node {node}: leaf {leaf} is reached twice")
                seen_leaf[leaf] = True
                depth = max(depth, d + 1)
    if not seen_internal.all():
        raise _fail(path, f"{where}: node {int(np.argmin(seen_internal))} is unreachable")
    if not seen_leaf.all():
        raise _fail(path, f"{where}: leaf {int(np.argmin(seen_leaf))} is unreachable")
    return depth


def _key_values(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value
        elif line.strip():
            out.setdefault(line.strip(), "")
    return out
