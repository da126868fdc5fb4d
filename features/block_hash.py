"""Engine block hashes from a request's token ids, exactly as vLLM computes them.

The join that makes kvwarm useful next to an engine: the engine publishes residency
(``BlockStored``/``BlockRemoved``) keyed by its own block hashes; a router sees each
prompt's token ids before the engine does. If kvwarm hashes those token ids the way
the engine does, the access event and the residency events name the same blocks.

Primitives:

- ``engine_block_hashes(token_ids, params)``: the engine's digests (``bytes``), one per
  *full* block, chained over the parent digest.
- ``block_id(digest)``: the 64-bit int kvwarm uses as a block id. It is what vLLM puts in
  its KV events by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the digest read
  big-endian, low 64 bits kept), and what ``features.events.block_hash_from`` folds a
  ``bytes`` hash to when an engine publishes raw digests instead, so both meet.
- ``request_blocks_accessed(...)``: a ``BlocksAccessed`` event for a request.
- ``load_tokenizer(path)``: text -> token ids with a local ``tokenizer.json`` (needs
  the optional ``tokenizers`` package); ``decode_request_event`` takes ``text`` with it.

What is reproduced (vLLM 0.33.0, ``vllm/v1/core/kv_cache_utils.py``: ``init_none_hash``,
``hash_block_tokens``, ``generate_block_hash_extra_keys``, ``get_request_block_hasher``;
``vllm/utils/hashing.py``: ``sha256``, ``sha256_cbor``; ``maybe_convert_block_hash``)::

    NONE_HASH  = H(seed)            seed = PYTHONHASHSEED if the engine sets it,
                                    else "vllm-none-hash" (sha256 / sha256_cbor)
    hash[i]    = H((hash[i-1] or NONE_HASH, tuple(tokens of block i), extra_keys_i))
    extra_keys = (("lora", name, path),)? + (("mm", identifier, offset_in_block), ...)
                 + (("cache_salt", salt),) on block 0 only; None when empty
    H          = sha256(pickle.dumps(x, protocol=5)) | sha256(cbor2 canonical(x))

Only full blocks are hashed (a trailing partial block has no hash in vLLM either).
``builtin`` (older vLLM's Python ``hash()``) is salted per process and cannot be
reproduced outside the engine; ``xxhash``/``xxhash_cbor`` seed ``NONE_HASH`` from random
bytes unless ``PYTHONHASHSEED`` is set, and are not implemented here. Both fail with a
message that says to run the engine with ``--prefix-caching-hash-algo sha256``.

Not covered: prompt-embeds inputs (their per-block digest needs the tensors),
speculative-decoding lookahead hashing (``num_hash_lookahead_tokens``), and hybrid
models whose groups hash at a coarser block size.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from features.events import MAX_BLOCK_HASH, BlocksAccessed, EventValidationError

VLLM_VERSION = "0.33.0"
"""The vLLM release whose hashing this module reproduces (vectors pinned in tests)."""

HASH_ALGOS = ("sha256", "sha256_cbor")
"""``--prefix-caching-hash-algo`` values kvwarm reproduces. sha256 is vLLM's default."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's fixed seed of the chain for cryptographic algorithms (no PYTHONHASHSEED)."""

DEFAULT_BLOCK_SIZE_TOKENS = 16
"""vLLM's default ``--block-size`` on GPUs."""

MAX_TOKENS_PER_REQUEST = 1 << 20
"""Longest prompt hashed (a million tokens); longer input is refused, not truncated."""

MAX_TOKEN_ID = (1 << 32) - 1
"""Token ids are vocabulary indices; anything above 32 bits is not a token."""

_UNREPRODUCIBLE = {
    "builtin": "Python's hash(), salted per engine process",
    "xxhash": "seeded from random bytes per engine process unless PYTHONHASHSEED is set",
    "xxhash_cbor": "seeded from random bytes per engine process unless PYTHONHASHSEED is set",
}


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input of a prompt: its placeholder tokens span
    ``[offset, offset + length)``; ``identifier`` is vLLM's ``mm_feature.identifier``
    (the item's content hash, as the engine computed it)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HashParams:
    """How one engine hashes blocks: must match its flags (``--block-size``,
    ``--prefix-caching-hash-algo``, ``PYTHONHASHSEED``) and the request's LoRA adapter,
    multimodal items and ``cache_salt``."""

    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    hash_algo: str = "sha256"
    lora_name: str | None = None
    lora_path: str | None = None
    """vLLM 0.33 keys LoRA blocks by name *and* adapter path (``LoRARequest.lora_path``)."""
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = field(default_factory=tuple)
    none_hash_seed: str = DEFAULT_NONE_HASH_SEED
    """The engine's ``PYTHONHASHSEED`` when it sets one, else vLLM's fixed default."""

    def __post_init__(self) -> None:
        if isinstance(self.block_size_tokens, bool) or not isinstance(self.block_size_tokens, int):
            raise EventValidationError("block_size", "expected an integer", "bad_type")
        if not 1 <= self.block_size_tokens <= 1 << 16:
            raise EventValidationError(
                "block_size", f"must be in 1..65536, got {self.block_size_tokens}", "out_of_range"
            )
        if self.hash_algo not in HASH_ALGOS:
            why = _UNREPRODUCIBLE.get(self.hash_algo)
            problem = (
                f"{self.hash_algo!r} cannot be reproduced outside the engine ({why})"
                if why
                else f"unknown hash algorithm {self.hash_algo!r}"
            )
            raise EventValidationError(
                "hash_algo",
                f"{problem}; use one of {', '.join(HASH_ALGOS)} and start vLLM with "
                "--prefix-caching-hash-algo sha256",
                "bad_hash_algo",
            )
        for name in ("lora_name", "lora_path", "cache_salt", "none_hash_seed"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise EventValidationError(name, "must be a string when given", "bad_type")
        if (self.lora_name is None) != (self.lora_path is None):
            raise EventValidationError(
                "lora_path",
                "give lora_name and lora_path together (vLLM hashes both)",
                "missing_field",
            )
        last_end = 0
        for item in self.mm_items:
            if not isinstance(item, MultiModalItem):
                raise EventValidationError("mm_items", "expected MultiModalItem", "bad_type")
            if item.offset < last_end or item.length < 1:
                raise EventValidationError(
                    "mm_items",
                    "items must be sorted by offset, non-overlapping, length >= 1",
                    "bad_mm_items",
                )
            last_end = item.offset + item.length


def _sha256_pickle(value: Any) -> bytes:
    # Pickling only plain ints, strs, bytes, tuples built here: safe, and the bytes are
    # what vLLM hashes (protocol 5 = HIGHEST_PROTOCOL on every supported Python).
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only engines on sha256_cbor need it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_HASH_FNS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def none_hash(hash_algo: str = "sha256", seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """The chain's root (vLLM's ``NONE_HASH``), the parent of every first block."""
    return _HASH_FNS[hash_algo](seed)


def _extra_keys(
    params: HashParams, start: int, end: int, mm_index: int
) -> tuple[tuple[Any, ...] | None, int]:
    """vLLM's ``generate_block_hash_extra_keys`` for block ``[start, end)``: LoRA, then
    the multimodal items the block overlaps, then the cache salt (block 0 only)."""
    keys: list[tuple[Any, ...]] = []
    if params.lora_name is not None:
        keys.append(("lora", params.lora_name, params.lora_path))
    items = params.mm_items
    while mm_index < len(items):
        item = items[mm_index]
        if end <= item.offset:
            break  # the block ends before this item
        if start >= item.offset + item.length:
            mm_index += 1  # passed it
            continue
        keys.append(("mm", item.identifier, item.offset - start))
        if end >= item.offset + item.length:
            mm_index += 1  # the next item may start in this block too
        else:
            break
    if start == 0 and params.cache_salt:
        keys.append(("cache_salt", params.cache_salt))
    return (tuple(keys) if keys else None), mm_index


def check_token_ids(token_ids: Any) -> list[int]:
    """Untrusted token ids as a list of plain ints (bounded count and range)."""
    if not isinstance(token_ids, (list, tuple)):
        raise EventValidationError(
            "token_ids", f"expected a list of integers, got {type(token_ids).__name__}", "bad_type"
        )
    if len(token_ids) > MAX_TOKENS_PER_REQUEST:
        raise EventValidationError(
            "token_ids",
            f"{len(token_ids)} tokens, at most {MAX_TOKENS_PER_REQUEST} per request",
            "too_large",
        )
    # Fast path (a JSON list is plain ints): one type scan, then C-level min/max.
    if all(type(t) is int for t in token_ids):
        if token_ids and (min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
            bad = next(t for t in token_ids if not 0 <= t <= MAX_TOKEN_ID)
            raise EventValidationError(
                "token_ids", f"token {bad!r:.30} is not an integer in 0..2**32-1", "bad_token"
            )
        return list(token_ids)
    out: list[int] = []
    for t in token_ids:
        # numpy ints pickle differently from Python ints: normalise, and refuse bools.
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise EventValidationError(
                "token_ids", f"token {t!r:.30} is not an integer in 0..2**32-1", "bad_token"
            )
        out.append(int(t))
    return out


def engine_block_hashes(token_ids: Sequence[int], params: HashParams) -> list[bytes]:
    """The engine's block digests for a prompt, one per full block (prefix order)."""
    tokens = check_token_ids(token_ids)
    hash_fn = _HASH_FNS[params.hash_algo]
    parent = none_hash(params.hash_algo, params.none_hash_seed)
    size = params.block_size_tokens
    out: list[bytes] = []
    mm_index = 0
    for start in range(0, len(tokens) - size + 1, size):
        extra, mm_index = _extra_keys(params, start, start + size, mm_index)
        parent = hash_fn((parent, tuple(tokens[start : start + size]), extra))
        out.append(parent)
    return out


def block_id(digest: bytes) -> int:
    """The 64-bit block id of an engine digest: vLLM's ``maybe_convert_block_hash``
    (big-endian, low 64 bits), the form its KV events carry by default."""
    return int.from_bytes(digest, "big") & MAX_BLOCK_HASH


def engine_block_ids(token_ids: Sequence[int], params: HashParams) -> list[int]:
    """``engine_block_hashes`` as the 64-bit ids kvwarm and vLLM's KV events use."""
    return [block_id(d) for d in engine_block_hashes(token_ids, params)]


def request_blocks_accessed(
    token_ids: Sequence[int],
    params: HashParams,
    *,
    request_id: str,
    ts_ms: int,
    engine_id: str | None = None,
    session_id: str | None = None,
    model: str | None = None,
    output_tokens: int | None = None,
) -> BlocksAccessed:
    """The access event of one request, with the engine's block ids (and its token
    ids). A prompt shorter than one block reads no cached block: no block hashes."""
    tokens = check_token_ids(token_ids)
    ids = engine_block_ids(tokens, params)
    return BlocksAccessed.validated(
        ts_ms=ts_ms,
        request_id=request_id,
        block_hashes=ids,
        block_size_tokens=params.block_size_tokens,
        input_tokens=len(tokens),
        output_tokens=output_tokens,
        session_id=session_id,
        model=model,
        engine_id=engine_id,
        token_ids=tuple(tokens),
    )


REQUEST_EVENT_FIELDS = (
    "request_id",
    "ts_ms",
    "ts",
    "engine_id",
    "token_ids",
    "text",
    "block_size",
    "hash_algo",
    "none_hash_seed",
    "lora_name",
    "lora_path",
    "cache_salt",
    "mm_items",
    "session_id",
    "model",
    "output_tokens",
)
"""Fields of a request event (JSON): what a router publishes per prompt."""

MAX_MM_ITEMS = 4096
"""Most multimodal items one request may carry."""


def _mm_items(value: Any) -> tuple[MultiModalItem, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_MM_ITEMS:
        raise EventValidationError(
            "mm_items", f"expected a list of at most {MAX_MM_ITEMS} objects", "bad_type"
        )
    items = []
    for raw in value:
        if not isinstance(raw, dict):
            raise EventValidationError(
                "mm_items", "each item is {identifier, offset, length}", "bad_type"
            )
        identifier, offset, length = raw.get("identifier"), raw.get("offset"), raw.get("length")
        if (
            not isinstance(identifier, str)
            or isinstance(offset, bool)
            or isinstance(length, bool)
            or not isinstance(offset, int)
            or not isinstance(length, int)
            or offset < 0
        ):
            raise EventValidationError(
                "mm_items",
                "each item is {identifier: str, offset: int >= 0, length: int >= 1}",
                "bad_type",
            )
        items.append(MultiModalItem(identifier, offset, length))
    return tuple(items)


def decode_request_event(
    obj: Any,
    *,
    default_request_id: str | None = None,
    default_ts_ms: int | None = None,
    tokenize: Tokenize | None = None,
) -> BlocksAccessed:
    """A request event (a parsed JSON object) to ``BlocksAccessed``, hashing its tokens::

        {"request_id": "r1", "ts_ms": 1700000000000, "engine_id": "vllm-0",
         "token_ids": [...], "block_size": 16, "hash_algo": "sha256",
         "lora_name": null, "lora_path": null, "cache_salt": null,
         "mm_items": [{"identifier": "...", "offset": 3, "length": 576}]}

    ``text`` may stand in for ``token_ids`` where a ``tokenize`` is given (the HTTP
    intake with a configured tokenizer file). ``ts`` (seconds, as vLLM stamps its
    batches) may stand in for ``ts_ms``. The
    defaults fill a missing request id or time (the HTTP intake uses a generated id and
    the wall clock); without them both are required. Unknown fields are refused so a
    misspelt extra key (which would silently change every hash) fails loudly.
    """
    if not isinstance(obj, dict):
        raise EventValidationError(
            "<request>", f"expected a JSON object, got {type(obj).__name__}", "not_object"
        )
    unknown = sorted(set(obj) - set(REQUEST_EVENT_FIELDS) - {"schema_version"})
    if unknown:
        raise EventValidationError(
            unknown[0],
            f"unknown request field; known: {', '.join(REQUEST_EVENT_FIELDS)}",
            "unknown_field",
        )
    token_ids = obj.get("token_ids")
    if token_ids is None and "text" in obj:
        text = obj["text"]
        if tokenize is None:
            raise EventValidationError(
                "text",
                "no tokenizer configured here (KVWARM_TOKENIZER_PATH on the HTTP intake); "
                "send token_ids instead",
                "no_tokenizer",
            )
        if not isinstance(text, str) or len(text) > 64 * MAX_TOKENS_PER_REQUEST:
            raise EventValidationError("text", "expected a string of bounded length", "bad_type")
        token_ids = tokenize(text)
    if token_ids is None:
        raise EventValidationError("token_ids", "is missing (or give text)", "missing_field")
    ts_ms = obj.get("ts_ms")
    if ts_ms is None and obj.get("ts") is not None:
        ts = obj["ts"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < 1e12:
            raise EventValidationError("ts", f"expected seconds >= 0, got {ts!r:.30}", "bad_type")
        ts_ms = int(round(ts * 1000))
    if ts_ms is None:
        ts_ms = default_ts_ms
    if ts_ms is None:
        raise EventValidationError("ts_ms", "is missing (or give ts in seconds)", "missing_field")
    request_id = obj.get("request_id") or default_request_id
    if request_id is None:
        raise EventValidationError("request_id", "is missing", "missing_field")
    params = HashParams(
        block_size_tokens=obj.get("block_size", DEFAULT_BLOCK_SIZE_TOKENS),
        hash_algo=obj.get("hash_algo") or "sha256",
        lora_name=obj.get("lora_name"),
        lora_path=obj.get("lora_path"),
        cache_salt=obj.get("cache_salt"),
        mm_items=_mm_items(obj.get("mm_items")),
        none_hash_seed=obj.get("none_hash_seed") or DEFAULT_NONE_HASH_SEED,
    )
    return request_blocks_accessed(
        token_ids,
        params,
        request_id=request_id,
        ts_ms=ts_ms,
        engine_id=obj.get("engine_id"),
        session_id=obj.get("session_id"),
        model=obj.get("model"),
        output_tokens=obj.get("output_tokens"),
    )


Tokenize = Callable[[str], list[int]]
"""Text -> token ids, as the engine's tokenizer does it."""


def load_tokenizer(tokenizer_path: str | Path) -> Tokenize:
    """A tokenizer from a local Hugging Face ``tokenizer.json`` (the file the engine's
    model ships), loaded once. Needs the optional ``tokenizers`` package. Special tokens
    and chat templates are the caller's: send the prompt exactly as the engine sees it
    (or let the engine tokenize: vLLM's ``POST /tokenize``, see devtools/router_hook.py)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise EventValidationError(
            "text",
            "hashing text needs the 'tokenizers' package (pip install tokenizers); "
            "or send token_ids instead",
            "no_tokenizer",
        ) from None
    path = Path(tokenizer_path)
    if not path.is_file():
        raise EventValidationError(
            "tokenizer", f"{path}: no such tokenizer file (want a tokenizer.json)", "no_tokenizer"
        )
    tokenizer = Tokenizer.from_file(str(path))

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return tokenize
