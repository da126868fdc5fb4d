"""The sidecar's online state as plain data: captured into a snapshot, restored into a
freshly built sidecar of the same configuration.

What is state (everything a decision depends on besides the events and the model):

- the policy's online state: a baseline's block table; a learned policy's
  ``FeatureState`` (rows, index, stored scores, decay epoch, session table) and its
  chain model's tracker (live chains, block -> chain maps, root counts); the online
  guard's candidates, ghost caches (with their RNGs) and hit counters; the scoring
  fallback's inner policy;
- the planner's eviction-sampling RNG and the placement mirror (tier of every block,
  members per tier, move times);
- the loop's recent-request ring and prefetch timer, and the origin the decision maker
  names prefetch rounds after.

Which attributes of a class are state is declared here, in ``STATE_FIELDS`` (keyed by
class name, looked up along the MRO); models, parameters and caches derived from them
are not state: they come from the model file and the settings, as at any start.

``capture(obj) -> tree`` and ``restore(obj, tree)`` walk those attributes. The tree
holds only what ``serving.state_store.encode_state`` allows (plain values, string-keyed
dicts, numpy arrays): containers are tagged (``{"~": "d", ...}`` a dict with any keys,
``"t"`` a tuple, ``"q"`` a deque, ``"g"`` a numpy RNG's state, ``"o"`` a nested stateful
object), and integer lists and int->int dicts travel as arrays. ``restore`` never
creates an object of a class named in the data: nested objects are restored into the
ones the fresh sidecar already has (a structure that does not match raises
``CheckpointMismatchError``), so a snapshot cannot run code.

``fresh_policy(policy)`` builds the same policy (same model, same wrappers) with empty
state: one per shard (``serving.shards``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

import numpy as np

STATE_FIELDS: dict[str, tuple[str, ...]] = {
    # predictor.baselines
    "_BlockTable": (
        "slot_of",
        "last_access",
        "prev_access",
        "last_request",
        "count",
        "depth",
        "hash_of",
        "free_slots",
        "num_accesses",
        "num_requests",
        "num_forgotten",
    ),
    "_TablePolicy": ("_table",),
    # predictor.learned + features.state
    "LearnedPolicy": ("state", "chain_tracker"),
    "FeatureState": (
        "_hash",
        "_i64",
        "_i32",
        "_f32",
        "_u8",
        "_score",
        "_scored",
        "_index",
        "_free",
        "_high_water",
        "_sessions",
        "_dec_epoch_ms",
        "_weights_ts_ms",
        "_weights",
        "num_requests",
        "num_accesses",
        "num_evicted",
        "clock_ms",
        "_req_counts",
        "_block_count",
        "last_request_slots",
    ),
    # predictor.chain_model (a learned policy's chain tracker: live chains as parallel
    # arrays, the block -> chain maps as int -> int dicts)
    "ChainPolicy": ("tracker",),
    "ChainTracker": ("chain_table", "anchors", "latest_leaf", "root_requests"),
    # predictor.guard
    "GuardedPolicy": (
        "candidates",
        "scales",
        "num_requests",
        "num_switches",
        "chosen",
        "_chosen_since",
        "_estimates_since",
    ),
    "_Scale": ("ghosts", "hits", "accesses", "num_sampled", "pair", "requests"),
    "_Ghost": ("slot", "members", "rng", "pending"),
    "_RecencyGhost": ("order",),
    # serving
    "ScoringFallback": ("inner", "num_failures"),
    "Placement": ("_tier", "_members", "_pos", "_order", "moved_at_ms"),
    "Planner": (
        "rng",
        "_queue",
        "_queue_scores",
        "_round_ms",
        "_read_since_round",
        "_intake",
        "_round_request",
        "_requests",
    ),
    "PrefetchGate": (
        "used_weight",
        "total_weight",
        "pending",
        "num_used",
        "num_wasted",
        "num_rounds",
        "num_skipped",
        "tier_weights",
        "tier_rounds",
    ),
}


class CheckpointError(Exception):
    """Base of checkpoint errors."""


class NotCheckpointableError(CheckpointError, TypeError):
    """An object whose state this module does not know how to capture."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A snapshot that does not fit the sidecar it is restored into (another policy,
    other tiers): the shard starts empty instead."""


def state_fields(obj: Any) -> tuple[str, ...] | None:
    """The declared state attributes of ``obj`` (its classes' entries, base first), or
    None when none of its classes is declared."""
    fields: list[str] = []
    found = False
    for cls in reversed(type(obj).__mro__):
        names = STATE_FIELDS.get(cls.__name__)
        if names is not None:
            found = True
            fields += [n for n in names if n not in fields]
    return tuple(fields) if found else None


def capture(obj: Any, *, copy: bool = False) -> dict[str, Any]:
    """The declared state of ``obj`` as a tree of plain data and arrays. The tree shares
    ``obj``'s numpy arrays unless ``copy`` (needed when it is encoded later, on another
    thread, while ``obj`` goes on changing)."""
    fields = state_fields(obj)
    if fields is None:
        raise NotCheckpointableError(
            f"{type(obj).__name__} has no declared state (serving.checkpoint.STATE_FIELDS): "
            "it cannot be checkpointed"
        )
    out: dict[str, Any] = {"~cls": type(obj).__name__}
    for name in fields:
        out[name] = _encode(getattr(obj, name), copy)
    return out


def restore(obj: Any, tree: Any) -> None:
    """Put the state captured by ``capture`` back into ``obj`` (a fresh object of the
    same configuration)."""
    fields = state_fields(obj)
    if fields is None:
        raise NotCheckpointableError(f"{type(obj).__name__} has no declared state")
    if not isinstance(tree, dict) or tree.get("~cls") != type(obj).__name__:
        got = tree.get("~cls") if isinstance(tree, dict) else type(tree).__name__
        raise CheckpointMismatchError(
            f"snapshot holds a {got!r} where this sidecar has a {type(obj).__name__!r}"
        )
    missing = [n for n in fields if n not in tree]
    if missing:
        raise CheckpointMismatchError(
            f"snapshot of {type(obj).__name__} lacks {', '.join(missing)}"
        )
    for name in fields:
        setattr(obj, name, _decode(tree[name], getattr(obj, name, None)))


# -- values ---------------------------------------------------------------------------


def _int_array(values: Any, count: int) -> np.ndarray | None:
    """``values`` (ints) as an int64 or uint64 array, or None if they fit neither."""
    for dtype in (np.int64, np.uint64):
        try:
            return np.fromiter(values, dtype=dtype, count=count)
        except (OverflowError, TypeError, ValueError):
            continue
    return None


def _all_ints(items: Any) -> bool:
    return all(type(v) is int for v in items)


def _encode(value: Any, copy: bool = False) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy() if copy else value
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return value
    if type(value) is int:
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.random.Generator):
        return {"~": "g", "s": value.bit_generator.state}
    if state_fields(value) is not None:
        return {"~": "o", "v": capture(value, copy=copy)}
    if isinstance(value, deque):
        return {"~": "q", "m": value.maxlen, "v": [_encode(v, copy) for v in value]}
    if isinstance(value, tuple):
        return {"~": "t", "v": [_encode(v, copy) for v in value]}
    if isinstance(value, list):
        if value and _all_ints(value):
            array = _int_array(value, len(value))
            if array is not None:
                return {"~": "li", "v": array}
        return {"~": "l", "v": [_encode(v, copy) for v in value]}
    if isinstance(value, OrderedDict):  # an order of int keys (Placement.order): keep it
        array = _int_array(value.keys(), len(value)) if _all_ints(value.keys()) else None
        if array is None or any(v is not None for v in value.values()):
            raise NotCheckpointableError("only an OrderedDict of int keys to None is checkpointed")
        return {"~": "ok", "k": array}
    if isinstance(value, dict):
        tag = "c" if isinstance(value, Counter) else "d"
        n = len(value)
        if n and _all_ints(value.keys()) and _all_ints(value.values()):
            keys = _int_array(value.keys(), n)
            values = _int_array(value.values(), n)
            if keys is not None and values is not None:
                return {"~": "ii", "k": keys, "v": values}
        return {
            "~": tag,
            "k": [_encode(k, copy) for k in value],
            "v": [_encode(v, copy) for v in value.values()],
        }
    raise NotCheckpointableError(f"cannot checkpoint a {type(value).__name__}")


def _decode(tree: Any, template: Any) -> Any:
    """``tree`` back into a value; ``template`` is the fresh object's current value of
    the same attribute (nested stateful objects are restored into it)."""
    if not isinstance(tree, dict):
        if isinstance(tree, np.ndarray):
            return tree.copy() if not tree.flags.writeable else tree
        return tree
    tag = tree.get("~")
    if tag == "o":
        if template is None or state_fields(template) is None:
            raise CheckpointMismatchError(
                f"snapshot holds a {tree['v'].get('~cls')!r} this sidecar has no place for"
            )
        restore(template, tree["v"])
        return template
    if tag == "g":
        rng = template if isinstance(template, np.random.Generator) else None
        if rng is None:
            raise CheckpointMismatchError("snapshot holds an RNG this sidecar has no place for")
        rng.bit_generator.state = tree["s"]
        return rng
    if tag == "q":
        return deque((_decode(v, None) for v in tree["v"]), maxlen=tree["m"])
    if tag == "t":
        return tuple(_decode(v, None) for v in tree["v"])
    if tag == "li":
        return np.asarray(tree["v"]).tolist()
    if tag == "l":
        items = template if isinstance(template, list) else []
        return [_decode(v, items[i] if i < len(items) else None) for i, v in enumerate(tree["v"])]
    if tag == "ii":
        return dict(
            zip(np.asarray(tree["k"]).tolist(), np.asarray(tree["v"]).tolist(), strict=True)
        )
    if tag == "ok":
        return OrderedDict.fromkeys(np.asarray(tree["k"]).tolist())
    if tag in ("d", "c"):
        old = template if isinstance(template, dict) else {}
        keys = [_decode(k, None) for k in tree["k"]]
        out = {k: _decode(v, old.get(k)) for k, v in zip(keys, tree["v"], strict=True)}
        return Counter(out) if tag == "c" else out
    raise CheckpointMismatchError(f"unknown value tag {tag!r} in a snapshot")


# -- fresh copies -----------------------------------------------------------------------


def fresh_policy(policy: Any) -> Any:
    """The same policy (model, parameters, wrappers) with empty online state."""
    from predictor.guard import GuardedPolicy
    from serving.model_lifecycle import ScoringFallback

    if isinstance(policy, ScoringFallback):
        return ScoringFallback(fresh_policy(policy.inner), policy.on_failure)
    if isinstance(policy, GuardedPolicy):
        return GuardedPolicy(
            policy.params, {name: fresh_policy(c) for name, c in policy.candidates.items()}
        )
    copy = getattr(policy, "fresh_copy", None)
    if copy is not None:
        return copy()
    return type(policy)(policy.params)


def check_checkpointable(policy: Any) -> None:
    """Raise ``NotCheckpointableError`` naming the part of ``policy`` that has no
    declared state (so ``serve`` refuses at start, not at the first checkpoint)."""
    capture(fresh_policy(policy))


def policy_signature(policy: Any) -> list[str]:
    """What a snapshot's policy state must match: the classes of the policy and its
    wrappers and candidates, and the features of every learned one."""
    from predictor.guard import GuardedPolicy
    from serving.model_lifecycle import ScoringFallback

    out: list[str] = []
    todo = [policy]
    while todo:
        p = todo.pop(0)
        out.append(type(p).__name__)
        if isinstance(p, ScoringFallback):
            todo.append(p.inner)
        elif isinstance(p, GuardedPolicy):
            out += sorted(p.candidates)
            todo += [p.candidates[name] for name in sorted(p.candidates)]
        else:
            names = getattr(p, "feature_names", None)
            if names is not None:
                out.append(",".join(names))
    return out
