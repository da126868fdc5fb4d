"""The one typed event module of kvwarm.

Everything that enters kvwarm -- rows of a trace file, JSON or msgpack bytes
from Kafka, vLLM/SGLang ``KVEventBatch`` payloads from ZMQ -- is decoded into
the types below at the edge (``features.decoders``) and nowhere else.

Primitives:

- ``BlocksAccessed``: a request arrived and will read this prefix-ordered chain
  of KV blocks (what the router/gateway publishes at arrival).
- ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``: residency reported
  by an engine (vLLM ``KVEventBatch`` semantics), with ``tier`` normalised.
- ``Tier``: the tiers kvwarm knows, fastest first, and ``normalize_tier`` for
  the many spellings engines use.
- ``EventValidationError``: the single error type of validation; its message
  names the field and the problem.

Events are named in the past tense; decisions (``executor``) in the imperative.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1
"""Version of the canonical event schema. Bump when a field changes meaning."""

MAX_BLOCK_HASH = (1 << 64) - 1
"""Block hashes are unsigned 64-bit integers (bytes hashes are folded to 64 bits)."""


class EventValidationError(ValueError):
    """An input event is malformed. ``field`` names the offending field, ``reason`` is a
    short machine-friendly tag used to count rejects (``missing_field``, ``negative`` ...)."""

    def __init__(self, field: str, problem: str, reason: str = "invalid") -> None:
        self.field = field
        self.problem = problem
        self.reason = reason
        super().__init__(f"field {field!r}: {problem}")


class Tier(enum.StrEnum):
    """Cache tiers, fastest first. Values are the executor's tier names."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    REMOTE = "remote"

    @property
    def rank(self) -> int:
        """0 for the fastest tier."""
        return _TIER_ORDER.index(self)


_TIER_ORDER = [Tier.HBM, Tier.DRAM, Tier.NVME, Tier.REMOTE]

# Medium strings differ by producer (vLLM: GPU, CPU, FS/OBJ/STORAGE; SGLang: GPU,
# CPU_PINNED, DISK, EXTERNAL, earlier CPU_TIER1/2; LMCache: cpu; Mooncake: gpu, cpu, disk).
TIER_ALIASES: dict[str, Tier] = {
    "gpu": Tier.HBM,
    "hbm": Tier.HBM,
    "cuda": Tier.HBM,
    "cpu": Tier.DRAM,
    "cpu_pinned": Tier.DRAM,
    "cpu_tier1": Tier.DRAM,
    "cpu_tier2": Tier.DRAM,
    "dram": Tier.DRAM,
    "host": Tier.DRAM,
    "hostpinned": Tier.DRAM,
    "disk": Tier.NVME,
    "fs": Tier.NVME,
    "nvme": Tier.NVME,
    "local_disk": Tier.NVME,
    "obj": Tier.REMOTE,
    "storage": Tier.REMOTE,
    "external": Tier.REMOTE,
    "remote": Tier.REMOTE,
    "nvmeof": Tier.REMOTE,
}


def normalize_tier(medium: str | None) -> Tier:
    """Map an engine's ``medium`` string onto ``Tier``, case-insensitively.

    ``None`` means the GPU: vLLM omitted ``medium`` before offload tiers existed.
    """
    if medium is None:
        return Tier.HBM
    if not isinstance(medium, str):
        raise EventValidationError(
            "medium", f"expected a string, got {type(medium).__name__}", "bad_type"
        )
    tier = TIER_ALIASES.get(medium.strip().lower().replace("-", "_"))
    if tier is None:
        known = ", ".join(sorted(TIER_ALIASES))
        raise EventValidationError(
            "medium", f"unknown tier {medium!r}; known spellings: {known}", "unknown_tier"
        )
    return tier


def _check_int(name: str, value: Any, *, minimum: int = 0, optional: bool = False) -> int | None:
    if value is None:
        if optional:
            return None
        raise EventValidationError(name, "is missing", "missing_field")
    # bool is an int subclass; a JSON true is never a valid count or timestamp.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise EventValidationError(name, f"expected an integer, got {value!r}", "bad_type")
    if value < minimum:
        raise EventValidationError(name, f"must be >= {minimum}, got {value}", "negative")
    return value


def block_hash_from(value: Any, field: str = "block_hashes") -> int:
    """Validate one block hash: an unsigned 64-bit int, or bytes folded to 64 bits.

    vLLM publishes ints by default and raw digests (bytes) when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; its int form is the digest read big-endian
    with the low 64 bits kept (``maybe_convert_block_hash``), so bytes fold the same way
    here and one engine's block gets one id whichever form it publishes
    (``features.block_hash.block_id``).
    """
    if isinstance(value, bool):
        raise EventValidationError(field, f"expected an integer hash, got {value!r}", "bad_hash")
    if isinstance(value, int):
        if value < 0:
            # Signed 64-bit producers (Java, Rust i64) wrap; keep the same 64 bits.
            if value < -(1 << 63):
                raise EventValidationError(field, f"hash {value} does not fit 64 bits", "bad_hash")
            return value & MAX_BLOCK_HASH
        if value > MAX_BLOCK_HASH:
            raise EventValidationError(field, f"hash {value} does not fit 64 bits", "bad_hash")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise EventValidationError(field, "empty bytes hash", "bad_hash")
        return int.from_bytes(raw, "big") & MAX_BLOCK_HASH
    raise EventValidationError(
        field, f"expected an integer hash, got {type(value).__name__} {value!r:.40}", "bad_hash"
    )


def block_hashes_from(values: Any, field: str = "block_hashes") -> tuple[int, ...]:
    if values is None:
        raise EventValidationError(field, "is missing", "missing_field")
    if not isinstance(values, (list, tuple)):
        raise EventValidationError(
            field, f"expected a list, got {type(values).__name__}", "bad_type"
        )
    return tuple(block_hash_from(v, field) for v in values)


@dataclass(frozen=True, slots=True)
class BlocksAccessed:
    """A request arrived that reads ``block_hashes`` (prefix order; block i's id depends
    on blocks 0..i). This is the access event that prediction learns from."""

    ts_ms: int
    request_id: str
    block_hashes: tuple[int, ...]
    block_size_tokens: int
    input_tokens: int | None = None
    output_tokens: int | None = None
    session_id: str | None = None
    model: str | None = None
    engine_id: str | None = None
    """The engine (instance) the request was routed to, when the router knows: access
    events join that engine's residency events by (engine_id, block hash)."""
    token_ids: tuple[int, ...] | None = None
    """The prompt's token ids when the event was made from them (request events):
    cache layers that address KV by tokens (LMCache) need them to act on a block."""

    @classmethod
    def validated(
        cls,
        *,
        ts_ms: Any,
        request_id: Any,
        block_hashes: Any,
        block_size_tokens: Any,
        input_tokens: Any = None,
        output_tokens: Any = None,
        session_id: Any = None,
        model: Any = None,
        engine_id: Any = None,
        token_ids: tuple[int, ...] | None = None,
    ) -> BlocksAccessed:
        """Build an event from untrusted values; raises ``EventValidationError``.
        ``token_ids`` must already be checked (``features.block_hash.check_token_ids``)."""
        if not isinstance(request_id, str) or not request_id:
            raise EventValidationError("request_id", "must be a non-empty string", "bad_type")
        for name, value in (("session_id", session_id), ("model", model), ("engine_id", engine_id)):
            if value is not None and not isinstance(value, str):
                raise EventValidationError(name, "must be a string when given", "bad_type")
        block_size = _check_int("block_size_tokens", block_size_tokens, minimum=1)
        assert block_size is not None
        ts = _check_int("ts_ms", ts_ms)
        assert ts is not None
        return cls(
            ts_ms=ts,
            request_id=request_id,
            block_hashes=block_hashes_from(block_hashes),
            block_size_tokens=block_size,
            input_tokens=_check_int("input_tokens", input_tokens, optional=True),
            output_tokens=_check_int("output_tokens", output_tokens, optional=True),
            session_id=session_id,
            model=model,
            engine_id=engine_id,
            token_ids=token_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON form (what ``decoders.decode_canonical`` reads back)."""
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "ts_ms": self.ts_ms,
            "request_id": self.request_id,
            "block_hashes": list(self.block_hashes),
            "block_size_tokens": self.block_size_tokens,
        }
        for name in ("input_tokens", "output_tokens", "session_id", "model", "engine_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.token_ids is not None:
            out["token_ids"] = list(self.token_ids)
        return out


@dataclass(frozen=True, slots=True)
class BlockStored:
    """An engine stored ``block_hashes`` (a chain continuing ``parent_block_hash``) in ``tier``.

    ``num_tokens == 0`` marks a tokenless event (offload tiers): a location update for
    hashes already known, not a new chain.
    """

    ts_ms: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    block_size_tokens: int
    tier: Tier
    num_tokens: int = 0
    engine_id: str = ""
    data_parallel_rank: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """An engine dropped ``block_hashes`` from ``tier``."""

    ts_ms: int
    block_hashes: tuple[int, ...]
    tier: Tier
    engine_id: str = ""
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """An engine cleared its whole cache (every tier it reports for)."""

    ts_ms: int
    engine_id: str = ""
    data_parallel_rank: int | None = None


ResidencyEvent = BlockStored | BlockRemoved | AllBlocksCleared
Event = BlocksAccessed | BlockStored | BlockRemoved | AllBlocksCleared
