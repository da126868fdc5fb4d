"""Compute block-hash test vectors with vLLM's own code, from an unpacked vLLM wheel.

Why a generator and not ``import vllm``: the wheel is 336 MB (vLLM 0.33.0, CUDA build)
and ``vllm.v1.core.kv_cache_utils`` imports torch, the config tree and CUDA helpers at
module level. The hashing itself needs none of that, so this script loads
``vllm/utils/hashing.py`` as it ships and executes the hashing functions of
``vllm/v1/core/kv_cache_utils.py`` (``resolve_none_hash_seed``, ``init_none_hash``,
``hash_block_tokens``, ``_gen_mm_extra_hash_keys``, ``_gen_lora_extra_hash_keys``,
``_gen_prompt_embeds_extra_hash_keys``, ``generate_block_hash_extra_keys``,
``get_request_block_hasher``, ``maybe_convert_block_hash``) from the file's own source,
unmodified, with stand-ins only for the imports they do not use here. Requests are
stand-ins carrying the attributes the hasher reads.

Run (a scratch venv with ``cbor2`` and ``xxhash``; nothing of kvwarm is needed)::

    pip download --no-deps vllm==0.33.0 -d wheels && unzip -q wheels/vllm-*.whl -d vllm-src
    python tests/data/vllm_block_hashes/generate.py vllm-src > tests/data/vllm_block_hashes/vectors.json
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NewType

FUNCTIONS = (
    "maybe_convert_block_hash",
    "resolve_none_hash_seed",
    "init_none_hash",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "hash_block_tokens",
    "get_request_block_hasher",
)
CONSTANTS = ("DEFAULT_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS", "_NONE_HASH_SEED")


def load_vllm_hashing(root: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("vllm_hashing", root / "vllm/utils/hashing.py")
    assert spec is not None and spec.loader is not None
    hashing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hashing)
    source = (root / "vllm/v1/core/kv_cache_utils.py").read_text()
    tree = ast.parse(source)
    wanted: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            wanted.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in CONSTANTS for t in targets):
                wanted.append(node)
    found = {getattr(n, "name", None) for n in wanted}
    missing = [f for f in FUNCTIONS if f not in found]
    if missing:
        raise SystemExit(f"not in this vLLM's kv_cache_utils.py: {missing}")
    namespace: dict[str, Any] = {
        "os": os,
        "hashlib": hashlib,
        "Any": Any,
        "Callable": Callable,
        "Sequence": Sequence,
        "Iterable": Iterable,
        "BlockHash": NewType("BlockHash", bytes),
        "ExternalBlockHash": bytes | int,
        "Request": SimpleNamespace,
        "xxhash": hashing.xxhash,
        "xxhash_cbor": hashing.xxhash_cbor,
        "envs": SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True),
        "logger": SimpleNamespace(warning=lambda *a, **k: None),
        "tensor_data": None,
    }
    module = ast.Module(body=wanted, type_ignores=[])
    exec(compile(module, "vllm/v1/core/kv_cache_utils.py", "exec"), namespace)
    namespace["hashing"] = hashing
    return namespace


def request(
    tokens: list[int],
    *,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    mm: Sequence[tuple[str, int, int]] = (),
) -> SimpleNamespace:
    mm_features = [
        SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
        for i, o, n in mm
    ]
    return SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=mm_features,
        lora_request=None
        if lora is None
        else SimpleNamespace(lora_name=lora[0], lora_path=lora[1]),
        cache_salt=cache_salt,
        prompt_embeds=None,
    )


CASES: list[dict[str, Any]] = [
    {"name": "plain-16", "block_size": 16, "tokens": list(range(1000, 1040))},
    {"name": "plain-4", "block_size": 4, "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]},
    {"name": "short", "block_size": 16, "tokens": list(range(15))},
    {"name": "big-ids", "block_size": 8, "tokens": [151_643, 0, 65_535, 65_536, 2**31 - 1] * 4},
    {"name": "salt", "block_size": 16, "tokens": list(range(48)), "cache_salt": "tenant-a"},
    {
        "name": "lora",
        "block_size": 16,
        "tokens": list(range(32)),
        "lora": ["sql-adapter", "/adapters/sql"],
    },
    {
        "name": "mm",
        "block_size": 16,
        "tokens": [7] * 64,
        "mm": [["img-aaaa", 4, 8], ["img-bbbb", 12, 30], ["img-cccc", 50, 6]],
    },
    {
        "name": "all-extras",
        "block_size": 16,
        "tokens": list(range(500, 548)),
        "lora": ["chat", "/a/chat"],
        "cache_salt": "s1",
        "mm": [["audio-1", 10, 20]],
    },
]


def main() -> None:
    root = Path(sys.argv[1])
    vectors: dict[str, Any] = {"vllm_version": None, "source": "vllm wheel", "cases": []}
    meta = next(root.glob("vllm-*.dist-info/METADATA"), None)
    if meta is not None:
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                vectors["vllm_version"] = line.split(":", 1)[1].strip()
    for algo in ("sha256", "sha256_cbor"):
        for seed in (None, "0"):
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            ns = load_vllm_hashing(root)  # fresh globals: NONE_HASH per algorithm and seed
            hash_fn = ns["hashing"].get_hash_fn_by_name(algo)
            ns["init_none_hash"](hash_fn)
            for case in CASES:
                req = request(
                    case["tokens"],
                    lora=tuple(case["lora"]) if case.get("lora") else None,
                    cache_salt=case.get("cache_salt"),
                    mm=[tuple(m) for m in case.get("mm", [])],
                )
                hasher = ns["get_request_block_hasher"](case["block_size"], hash_fn)
                digests = hasher(req)
                vectors["cases"].append(
                    {
                        **case,
                        "hash_algo": algo,
                        "pythonhashseed": seed,
                        "none_hash": ns["NONE_HASH"].hex(),
                        "digests": [d.hex() for d in digests],
                        "event_ids": [ns["maybe_convert_block_hash"](d) for d in digests],
                    }
                )
    # One case per line: reviewable diffs when vLLM changes its hashing.
    cases = vectors.pop("cases")
    head = json.dumps(vectors)[:-1]
    body = ",\n  ".join(json.dumps(c) for c in cases)
    sys.stdout.write(f'{head}, "cases": [\n  {body}\n]}}\n')


if __name__ == "__main__":
    main()
