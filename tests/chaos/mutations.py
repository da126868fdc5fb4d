"""Hostile edits of a saved LightGBM model: each returns the mutated ``model.txt`` text.

The first eleven are the variants of issue 18 (what segfaulted, looped or exited the
sidecar); the rest are more of the same kind.
"""

from __future__ import annotations

import re
from collections.abc import Callable


def _edit_tree0(text: str, key: str, edit: Callable[[list[str]], list[str]]) -> str:
    """Replace ``key=`` of the first tree that has splits with ``edit(values)``."""
    for match in re.finditer(r"^Tree=\d+\n(?:.+\n)+", text, flags=re.M):
        block = match.group(0)
        if "num_leaves=1\n" in block:
            continue
        line = re.search(rf"^{key}=(.*)$", block, flags=re.M)
        assert line is not None, key
        values = edit(line.group(1).split())
        new_block = block.replace(line.group(0), f"{key}={' '.join(values)}", 1)
        return text[: match.start()] + new_block + text[match.end() :]
    raise AssertionError("the model has no tree with a split")


def _set0(value: str) -> Callable[[list[str]], list[str]]:
    return lambda values: [value, *values[1:]]


MUTATIONS: dict[str, Callable[[str], str]] = {
    "split_feature_out_of_range": lambda t: _edit_tree0(t, "split_feature", _set0("9999")),
    "split_feature_negative": lambda t: _edit_tree0(t, "split_feature", _set0("-7")),
    "left_child_out_of_range": lambda t: _edit_tree0(t, "left_child", _set0("999")),
    "right_child_leaf_out_of_range": lambda t: _edit_tree0(t, "right_child", _set0("-999")),
    "tree_loops_to_itself": lambda t: _edit_tree0(t, "left_child", _set0("0")),
    "leaf_value_nan": lambda t: _edit_tree0(t, "leaf_value", _set0("nan")),
    "leaf_value_inf": lambda t: _edit_tree0(t, "leaf_value", _set0("inf")),
    "threshold_nan": lambda t: _edit_tree0(t, "threshold", _set0("nan")),
    "truncated_half": lambda t: t[: len(t) // 2],
    "num_leaves_inflated": lambda t: _edit_tree0(t, "num_leaves", lambda v: ["1000"]),
    "max_feature_idx_wrong": lambda t: t.replace("max_feature_idx=", "max_feature_idx=9", 1),
    # more of the same kind
    "child_cycle_two_nodes": lambda t: _edit_tree0(
        t, "right_child", lambda v: [v[0], "0", *v[2:]] if len(v) > 1 else ["0"]
    ),
    "shared_leaf": lambda t: _edit_tree0(t, "right_child", lambda v: ["-1", *v[1:]]),
    "categorical_without_bitset": lambda t: _edit_tree0(t, "decision_type", _set0("1")),
    "shrinkage_nan": lambda t: _edit_tree0(t, "shrinkage", lambda v: ["nan"]),
    "split_feature_not_a_number": lambda t: _edit_tree0(t, "split_feature", _set0("x")),
    "missing_left_child": lambda t: re.sub(r"^left_child=.*\n", "", t, count=1, flags=re.M),
    "empty_file": lambda t: "",
    "binary_garbage": lambda t: "\x00\xff\x13" * 100,
    "truncated_in_header": lambda t: t[:40],
    "num_leaves_zero": lambda t: _edit_tree0(t, "num_leaves", lambda v: ["0"]),
    "leaf_value_huge": lambda t: _edit_tree0(t, "leaf_value", _set0("1e308")),
}
"""Name -> mutation of the model text."""
