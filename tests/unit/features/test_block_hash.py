"""kvwarm's block hashes equal vLLM's: vectors computed by vLLM 0.33.0's own hashing code
(tests/data/vllm_block_hashes/generate.py runs it from the published wheel)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from features.block_hash import (
    VLLM_VERSION,
    HashParams,
    MultiModalItem,
    block_id,
    decode_request_event,
    engine_block_hashes,
    engine_block_ids,
    load_tokenizer,
    none_hash,
    request_blocks_accessed,
)
from features.decoders import decode_kv_event_batch
from features.events import BlockStored, EventValidationError, block_hash_from

VECTORS = json.loads(
    (Path(__file__).parents[2] / "data" / "vllm_block_hashes" / "vectors.json").read_text()
)
CASES: list[dict[str, Any]] = VECTORS["cases"]


def params_of(case: dict[str, Any]) -> HashParams:
    lora = case.get("lora")
    return HashParams(
        block_size_tokens=case["block_size"],
        hash_algo=case["hash_algo"],
        lora_name=lora[0] if lora else None,
        lora_path=lora[1] if lora else None,
        cache_salt=case.get("cache_salt"),
        mm_items=tuple(MultiModalItem(i, o, n) for i, o, n in case.get("mm", [])),
        none_hash_seed=case["pythonhashseed"] or "vllm-none-hash",
    )


def test_vectors_come_from_the_pinned_vllm_release() -> None:
    assert VECTORS["vllm_version"] == VLLM_VERSION
    algos = {(c["hash_algo"], c["pythonhashseed"]) for c in CASES}
    assert algos == {("sha256", None), ("sha256", "0"), ("sha256_cbor", None), ("sha256_cbor", "0")}


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c['name']}-{c['hash_algo']}-seed{c['pythonhashseed']}" for c in CASES]
)
def test_digests_and_event_ids_match_vllm(case: dict[str, Any]) -> None:
    params = params_of(case)
    assert none_hash(params.hash_algo, params.none_hash_seed).hex() == case["none_hash"]
    digests = engine_block_hashes(case["tokens"], params)
    assert [d.hex() for d in digests] == case["digests"]
    assert engine_block_ids(case["tokens"], params) == case["event_ids"]


def test_extra_keys_change_the_hashes_they_should() -> None:
    tokens = list(range(64))
    plain = engine_block_ids(tokens, HashParams())
    salted = engine_block_ids(tokens, HashParams(cache_salt="t"))
    # The salt keys block 0; the chain carries it into every later block.
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    image = HashParams(mm_items=(MultiModalItem("img", 40, 4),))
    with_image = engine_block_ids(tokens, image)
    assert with_image[:2] == plain[:2] and with_image[2] != plain[2]
    assert engine_block_ids(tokens, HashParams(block_size_tokens=32)) != plain[:2]


def test_bytes_and_int_event_hashes_fold_to_the_same_id() -> None:
    """vLLM publishes ints by default and raw digests with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: both must name the same kvwarm block."""
    case = CASES[0]
    digest = bytes.fromhex(case["digests"][1])
    assert block_hash_from(digest) == block_id(digest) == case["event_ids"][1]
    parent = bytes.fromhex(case["digests"][0])
    batch = msgspec.msgpack.encode(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [digest],
                    "parent_block_hash": parent,
                    "token_ids": case["tokens"][16:32],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ],
        ]
    )
    (stored,) = decode_kv_event_batch(batch, "e0")
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (case["event_ids"][1],)
    assert stored.parent_block_hash == case["event_ids"][0]


def test_access_event_carries_engine_ids_and_engine() -> None:
    tokens = list(range(40))
    event = request_blocks_accessed(
        tokens, HashParams(), request_id="r1", ts_ms=5, engine_id="vllm-0"
    )
    assert event.block_hashes == tuple(engine_block_ids(tokens, HashParams()))
    assert len(event.block_hashes) == 2 and event.input_tokens == 40
    assert event.engine_id == "vllm-0" and event.to_dict()["engine_id"] == "vllm-0"


@pytest.mark.parametrize(
    ("kwargs", "tokens", "field"),
    [
        ({"hash_algo": "builtin"}, [1], "hash_algo"),
        ({"hash_algo": "xxhash"}, [1], "hash_algo"),
        ({"hash_algo": "md5"}, [1], "hash_algo"),
        ({"block_size_tokens": 0}, [1], "block_size"),
        ({"lora_name": "a"}, [1], "lora_path"),
        ({"mm_items": (MultiModalItem("a", 5, 4), MultiModalItem("b", 6, 1))}, [1], "mm_items"),
        ({}, [1, -2], "token_ids"),
        ({}, [1, True], "token_ids"),
        ({}, [1, 2**40], "token_ids"),
        ({}, "1 2 3", "token_ids"),
    ],
)
def test_bad_input_names_the_field_and_the_fix(
    kwargs: dict[str, Any], tokens: Any, field: str
) -> None:
    with pytest.raises(EventValidationError) as info:
        engine_block_hashes(tokens, HashParams(**kwargs))
    assert info.value.field == field
    if field == "hash_algo":
        assert "--prefix-caching-hash-algo sha256" in str(info.value)


def test_text_requests_hash_the_tokenizer_ids(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(40)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    tokenize = load_tokenizer(path)
    text = " ".join(f"w{i}" for i in range(40))
    assert tokenize(text) == list(range(1, 41))
    event = decode_request_event({"text": text, "ts_ms": 1, "request_id": "r"}, tokenize=tokenize)
    assert list(event.block_hashes) == engine_block_ids(list(range(1, 41)), HashParams())
    with pytest.raises(EventValidationError, match="no tokenizer configured"):
        decode_request_event({"text": text, "ts_ms": 1, "request_id": "r"})
    with pytest.raises(EventValidationError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "missing.json")
