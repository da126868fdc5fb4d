"""The ``Decision`` schema: what the planner tells the executor to do.

One decision moves, drops or pins one block::

    {decision_id, ts_ms, block_hash, action, from_tier, to_tier,
     score, policy, model_version, deadline_ms}

- ``promote``: move the block to a faster ``to_tier`` (from ``from_tier``, or from
  wherever it is when ``from_tier`` is None).
- ``demote``: move the block to a slower ``to_tier``.
- ``evict``: drop the block from ``from_tier`` (from every tier when None).
- ``pin`` / ``unpin``: keep the block where it is; a demote/evict of a pinned block
  is refused (``refused_pinned``).

``decision_id`` makes delivery idempotent: the executor applies each id at most
once, across restarts. ``deadline_ms`` (wall-clock or simulated ms, same clock as
``ts_ms``) is when the move stops being useful; a decision past it is skipped.
Decisions are named in the imperative; events (``features.events``) in the past
tense.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from executor.block_ids import MAX_BLOCK_HASH
from executor.names import TIER_NAMES, TIER_RANK

Action = Literal["promote", "demote", "evict", "pin", "unpin"]
ACTIONS: tuple[str, ...] = get_args(Action)
MAX_DECISION_ID_CHARS = 200

_FIELDS = (
    "decision_id",
    "ts_ms",
    "block_hash",
    "action",
    "from_tier",
    "to_tier",
    "score",
    "policy",
    "model_version",
    "deadline_ms",
)


class DecisionValidationError(ValueError):
    """A decision is malformed. ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"decision field {field!r}: {problem}")


def _int_field(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecisionValidationError(name, f"expected an integer, got {value!r:.60}")
    if value < 0:
        raise DecisionValidationError(name, f"must be >= 0, got {value}")
    return value


def _tier_field(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in TIER_RANK:
        raise DecisionValidationError(
            name, f"unknown tier {value!r:.60}; use one of {', '.join(TIER_NAMES)} or null"
        )
    return value


def _str_field(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise DecisionValidationError(name, f"expected a string, got {value!r:.60}")
    return value


@dataclass(frozen=True, slots=True)
class Decision:
    """One instruction to the executor. Build from untrusted input with ``from_dict``;
    the constructor validates too, so an invalid ``Decision`` cannot exist."""

    decision_id: str
    ts_ms: int
    block_hash: int
    action: Action
    from_tier: str | None = None
    to_tier: str | None = None
    score: float | None = None
    policy: str = ""
    model_version: str = ""
    deadline_ms: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.decision_id, str) or not self.decision_id:
            raise DecisionValidationError("decision_id", "must be a non-empty string")
        if len(self.decision_id) > MAX_DECISION_ID_CHARS:
            raise DecisionValidationError(
                "decision_id", f"longer than {MAX_DECISION_ID_CHARS} characters"
            )
        if not self.decision_id.isprintable():
            raise DecisionValidationError("decision_id", "contains non-printable characters")
        _int_field("ts_ms", self.ts_ms)
        block_hash = _int_field("block_hash", self.block_hash)
        assert block_hash is not None
        if block_hash > MAX_BLOCK_HASH:
            raise DecisionValidationError("block_hash", "does not fit in 64 unsigned bits")
        if self.action not in ACTIONS:
            raise DecisionValidationError(
                "action", f"unknown action {self.action!r:.60}; use one of {', '.join(ACTIONS)}"
            )
        _tier_field("from_tier", self.from_tier)
        _tier_field("to_tier", self.to_tier)
        if self.score is not None and (
            isinstance(self.score, bool)
            or not isinstance(self.score, (int, float))
            or not math.isfinite(self.score)
        ):
            raise DecisionValidationError("score", f"must be a finite number, got {self.score!r}")
        _str_field("policy", self.policy)
        _str_field("model_version", self.model_version)
        _int_field("deadline_ms", self.deadline_ms, optional=True)
        self._check_action_tiers()

    @classmethod
    def planned(
        cls,
        decision_id: str,
        ts_ms: int,
        block_hash: int,
        action: Action,
        from_tier: str | None,
        to_tier: str | None,
        score: float,
        policy: str,
        model_version: str,
        deadline_ms: int,
    ) -> Decision:
        """A decision of kvwarm's own planner (``serving.decisions.DecisionMaker``),
        built without the per-field checks (1.0 us against the 3.1 us a checked one
        takes): the maker checks once that its tier names are known and in rank order,
        and each field comes from a validated event (block hash, time), a fixed table
        (action, tier names by index, in an order the planner's move kinds guarantee),
        its own id function or ``math.isfinite`` (score). Untrusted input goes through
        the constructor or ``from_dict``. The fields are set through their slots'
        descriptors, which a frozen dataclass's own ``__setattr__`` would refuse."""
        d = object.__new__(cls)
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9 = _SLOT_SETTERS
        s0(d, decision_id)
        s1(d, ts_ms)
        s2(d, block_hash)
        s3(d, action)
        s4(d, from_tier)
        s5(d, to_tier)
        s6(d, score)
        s7(d, policy)
        s8(d, model_version)
        s9(d, deadline_ms)
        return d

    def _check_action_tiers(self) -> None:
        if self.action in ("promote", "demote"):
            if self.to_tier is None:
                raise DecisionValidationError("to_tier", f"required for {self.action}")
            if self.from_tier is not None:
                faster = TIER_RANK[self.to_tier] < TIER_RANK[self.from_tier]
                if self.from_tier == self.to_tier or faster != (self.action == "promote"):
                    want = "faster" if self.action == "promote" else "slower"
                    raise DecisionValidationError(
                        "to_tier",
                        f"{self.action} needs a {want} to_tier than from_tier "
                        f"{self.from_tier!r}, got {self.to_tier!r}",
                    )
        elif self.action == "evict" and self.to_tier is not None:
            raise DecisionValidationError("to_tier", "must be null for evict (use demote)")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict with every field (None for absent ones)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: Any) -> Decision:
        """Validate an untrusted mapping (decoded JSON/msgpack). Unknown keys are refused
        so that a misspelt field fails loudly instead of being dropped."""
        if not isinstance(data, dict):
            raise DecisionValidationError(
                "<root>", f"expected an object, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise DecisionValidationError(
                unknown[0], f"unknown field; known fields: {', '.join(_FIELDS)}"
            )
        for required in ("decision_id", "ts_ms", "block_hash", "action"):
            if data.get(required) is None:
                raise DecisionValidationError(required, "is missing")
        score = data.get("score")
        return cls(
            decision_id=data["decision_id"],
            ts_ms=cast(int, _int_field("ts_ms", data["ts_ms"])),
            block_hash=cast(int, _int_field("block_hash", data["block_hash"])),
            action=data["action"],
            from_tier=data.get("from_tier"),
            to_tier=data.get("to_tier"),
            score=float(score) if isinstance(score, int) and not isinstance(score, bool) else score,
            policy=data.get("policy", "") or "",
            model_version=data.get("model_version", "") or "",
            deadline_ms=_int_field("deadline_ms", data.get("deadline_ms"), optional=True),
        )


_SLOT_SETTERS = tuple(Decision.__dict__[f.name].__set__ for f in dataclasses.fields(Decision))
"""Each field's slot setter, in field order (``Decision.planned``)."""
