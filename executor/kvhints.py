"""Decisions in the engines' vocabulary: the KV hint envelope, and acknowledgements.

Engines and cache layers (vLLM, Dynamo, SGLang, LMCache) are converging on a typed hint
envelope for external KV control::

    {"protocol_version": "0.1", "message_id": "...",
     "actions": [{"action_id", "action_type", "action_version", "payload"}]}

answered per action with ``accepted | clipped | deferred | rejected | missing``. This
module maps kvwarm's ``Decision`` onto it, losslessly, and back. The JSON Schema of the
envelope (and of an acknowledgement) is ``executor/schemas/kvhints.schema.json``.

Primitives:

- ``to_envelope(decisions)`` / ``decisions_from_envelope(obj)``: the mapping. Every
  decision field has a home, so ``decisions_from_envelope(to_envelope(ds)) == ds``.
- ``DecisionFormat`` and ``decision_format(name)``: how a sink turns decisions into
  records (``native``: one JSON decision per record, keyed by block hash, the format
  kvwarm always had; ``kvhints``: envelopes of at most ``MAX_ACTIONS_PER_ENVELOPE``
  actions, keyed by message id). An unknown name fails listing the valid ones.
- ``make_ack`` / ``parse_ack(obj)``: an acknowledgement message <-> ``(action_id,
  status)`` pairs; ``ACK_STATUSES`` are the five outcomes a sink counts;
  ``ack_status_of`` maps an in-process executor outcome onto them.

Action types and the decisions they carry:

================  ===============================================================
kv.prefetch       promote: bring the blocks into ``to_tier`` before they are read
kv.demote         demote: move the blocks down to ``to_tier``
kv.evict          evict: drop the blocks from ``from_tier`` (every tier if null)
kv.pin            pin (``release: false``) / unpin (``release: true``)
kv.retain         keep the blocks (or a session's) for ``ttl_ms``; no kvwarm decision
                  emits it yet, executors may already accept it
kv.admit_veto     do not admit the blocks into ``tier`` (one-hit wonders); likewise
================  ===============================================================

Payload: ``block_hashes`` (64-bit ids as vLLM's KV events carry them) or
``session_id``; ``from_tier``, ``to_tier``, ``ttl_ms``, ``priority`` (kvwarm's score),
``confidence`` (0..1, when a policy gives one), ``deadline_ms`` (past it the action is
worthless), ``issued_at_ms``, and ``source`` ``{policy, model_version}``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

from executor.decision import Decision, DecisionValidationError

_encode = msgspec.json.Encoder().encode

PROTOCOL_VERSION = "0.1"
ACTION_VERSION = 1
MAX_ACTIONS_PER_ENVELOPE = 1024
"""Actions per envelope: keeps one Kafka record well under the 1 MB default limit."""

SCHEMA_PATH = Path(__file__).parent / "schemas" / "kvhints.schema.json"

ActionType = Literal["kv.prefetch", "kv.demote", "kv.evict", "kv.pin", "kv.retain", "kv.admit_veto"]
ACTION_TYPES: tuple[str, ...] = get_args(ActionType)

AckStatus = Literal["accepted", "clipped", "deferred", "rejected", "missing"]
ACK_STATUSES: tuple[str, ...] = get_args(AckStatus)

_TYPE_OF_ACTION = {
    "promote": "kv.prefetch",
    "demote": "kv.demote",
    "evict": "kv.evict",
    "pin": "kv.pin",
    "unpin": "kv.pin",
}


class HintError(ValueError):
    """A hint envelope or acknowledgement is malformed; the message names the field."""


def action_of(decision: Decision) -> dict[str, Any]:
    """One decision as one envelope action."""
    payload: dict[str, Any] = {
        "block_hashes": [decision.block_hash],
        "from_tier": decision.from_tier,
        "to_tier": decision.to_tier,
        "priority": decision.score,
        "deadline_ms": decision.deadline_ms,
        "issued_at_ms": decision.ts_ms,
        "source": {"policy": decision.policy, "model_version": decision.model_version},
    }
    if decision.action in ("pin", "unpin"):
        payload["release"] = decision.action == "unpin"
    return {
        "action_id": decision.decision_id,
        "action_type": _TYPE_OF_ACTION[decision.action],
        "action_version": ACTION_VERSION,
        "payload": payload,
    }


def message_id_of(action_ids: Sequence[str]) -> str:
    """Deterministic: the same decisions give the same message id (idempotent resends)."""
    digest = hashlib.blake2b(digest_size=12)
    for action_id in action_ids:
        digest.update(action_id.encode())
        digest.update(b"\x1f")
    return digest.hexdigest()


def to_envelope(decisions: Sequence[Decision]) -> dict[str, Any]:
    """Decisions as one envelope (callers split batches over ``MAX_ACTIONS_PER_ENVELOPE``)."""
    actions = [action_of(d) for d in decisions]
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id_of([a["action_id"] for a in actions]),
        "actions": actions,
    }


def _field(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        raise HintError(f"{where}: field {name!r} is missing")
    return obj[name]


def decision_of(action: Any) -> Decision:
    """One envelope action back to the decision it came from. ``kv.retain`` and
    ``kv.admit_veto`` have no kvwarm decision and are refused."""
    if not isinstance(action, dict):
        raise HintError(f"action: expected an object, got {type(action).__name__}")
    action_id = _field(action, "action_id", "action")
    action_type = _field(action, "action_type", f"action {action_id!r:.60}")
    where = f"action {action_id!r:.60}"
    if action.get("action_version", ACTION_VERSION) != ACTION_VERSION:
        raise HintError(f"{where}: action_version {action.get('action_version')!r} unsupported")
    payload = _field(action, "payload", where)
    if not isinstance(payload, dict):
        raise HintError(f"{where}: payload must be an object")
    if action_type == "kv.pin":
        kind = "unpin" if payload.get("release") else "pin"
    else:
        kinds = {v: k for k, v in _TYPE_OF_ACTION.items() if k not in ("pin", "unpin")}
        if action_type not in kinds:
            raise HintError(
                f"{where}: {action_type!r} has no kvwarm decision; "
                "kvwarm emits kv.prefetch, kv.demote, kv.evict, kv.pin"
            )
        kind = kinds[action_type]
    hashes = _field(payload, "block_hashes", where)
    if not isinstance(hashes, list) or len(hashes) != 1:
        raise HintError(f"{where}: a kvwarm decision names exactly one block hash")
    source = payload.get("source") or {}
    try:
        return Decision.from_dict(
            {
                "decision_id": action_id,
                "ts_ms": _field(payload, "issued_at_ms", where),
                "block_hash": hashes[0],
                "action": kind,
                "from_tier": payload.get("from_tier"),
                "to_tier": payload.get("to_tier"),
                "score": payload.get("priority"),
                "policy": source.get("policy", ""),
                "model_version": source.get("model_version", ""),
                "deadline_ms": payload.get("deadline_ms"),
            }
        )
    except DecisionValidationError as exc:
        raise HintError(f"{where}: {exc}") from None


def decisions_from_envelope(envelope: Any) -> list[Decision]:
    """The decisions an envelope carries (what an executor reading kvhints applies)."""
    if not isinstance(envelope, dict):
        raise HintError(f"envelope: expected an object, got {type(envelope).__name__}")
    version = _field(envelope, "protocol_version", "envelope")
    if version != PROTOCOL_VERSION:
        raise HintError(f"envelope: protocol_version {version!r}; this reader speaks 0.1")
    _field(envelope, "message_id", "envelope")
    actions = _field(envelope, "actions", "envelope")
    if not isinstance(actions, list):
        raise HintError("envelope: actions must be a list")
    return [decision_of(a) for a in actions]


# -- acknowledgements ---------------------------------------------------------------------


def make_ack(message_id: str, results: Sequence[tuple[str, str, str]]) -> dict[str, Any]:
    """An acknowledgement: ``results`` are (action_id, status, reason)."""
    for _, status, _ in results:
        if status not in ACK_STATUSES:
            raise HintError(f"ack: status {status!r}; use one of {', '.join(ACK_STATUSES)}")
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id,
        "results": [
            {"action_id": a, "status": s, **({"reason": r} if r else {})} for a, s, r in results
        ],
    }


_REJECTED = ("stale", "refused_full", "refused_pinned", "refused_budget", "expired", "failed")
_MISSING_REASONS = ("not cached", "not found", "block vanished")
_ACCEPTED_REASONS = ("already there", "duplicate decision id")


def ack_status_of(status: str, reason: str = "") -> str:
    """An executor outcome (``executor`` status and reason) as the ack status an engine
    would send, so every sink counts acks in one vocabulary: applied or a repeat is
    ``accepted`` (``clipped`` when the reason says only part was done), a block in no
    tier is ``missing``, every refusal and failure is ``rejected``."""
    if status in ACK_STATUSES:
        return status
    if status in ("applied", "duplicate") or reason.startswith(_ACCEPTED_REASONS):
        return "clipped" if reason.startswith("clipped") else "accepted"
    if status == "missing" or reason.startswith(_MISSING_REASONS):
        return "missing"
    return "rejected"


def parse_ack(obj: Any) -> list[tuple[str, str]]:
    """An acknowledgement message -> (action_id, status) pairs; refuses unknown statuses."""
    if not isinstance(obj, dict):
        raise HintError(f"ack: expected an object, got {type(obj).__name__}")
    results = _field(obj, "results", "ack")
    if not isinstance(results, list):
        raise HintError("ack: results must be a list")
    out = []
    for r in results:
        if not isinstance(r, dict):
            raise HintError("ack: each result is {action_id, status}")
        status = _field(r, "status", "ack result")
        if status not in ACK_STATUSES:
            raise HintError(f"ack: status {status!r}; use one of {', '.join(ACK_STATUSES)}")
        action_id = _field(r, "action_id", "ack result")
        if not isinstance(action_id, str):
            raise HintError("ack: action_id must be a string")
        out.append((action_id, status))
    return out


# -- record formats for sinks ---------------------------------------------------------------

Record = tuple[bytes | None, bytes]
"""(key, value) of one record a sink writes (a file line ignores the key)."""


@dataclass(frozen=True)
class DecisionFormat:
    """How a sink turns a batch of decisions into records. ``name`` is what
    ``--decisions-format`` takes."""

    name: str
    records: Callable[[Sequence[Decision]], list[Record]]


def _native_records(decisions: Sequence[Decision]) -> list[Record]:
    return [(str(d.block_hash).encode(), _encode(d.to_dict())) for d in decisions]


def _kvhints_records(decisions: Sequence[Decision]) -> list[Record]:
    out: list[Record] = []
    for start in range(0, len(decisions), MAX_ACTIONS_PER_ENVELOPE):
        envelope = to_envelope(decisions[start : start + MAX_ACTIONS_PER_ENVELOPE])
        out.append((envelope["message_id"].encode(), _encode(envelope)))
    return out


DECISION_FORMATS: dict[str, DecisionFormat] = {
    "native": DecisionFormat("native", _native_records),
    "kvhints": DecisionFormat("kvhints", _kvhints_records),
}


def decision_format(name: str) -> DecisionFormat:
    """The format called ``name``; an unknown name fails listing the valid ones."""
    try:
        return DECISION_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown decisions format {name!r}; valid: {', '.join(DECISION_FORMATS)}"
        ) from None


def decisions_from_record(value: bytes) -> list[Decision]:
    """Read back one record of either format: native (a JSON array of decisions, as
    ``KafkaDecisionSink`` batches them, or one decision object) or an envelope."""
    obj = msgspec.json.decode(value)
    if isinstance(obj, dict) and "actions" in obj:
        return decisions_from_envelope(obj)
    if isinstance(obj, list):
        return [Decision.from_dict(d) for d in obj]
    return [Decision.from_dict(obj)]
