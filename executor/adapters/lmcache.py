"""An executor over LMCache: kvwarm's decisions as calls to LMCache's multi-process
coordinator REST API (LMCache 0.5.6, ``lmcache/v1/mp_coordinator``).

LMCache addresses KV by token sequence, never by an engine's block hash: a call names
the *full* token prefix from position 0 and LMCache hashes it into its own chunk keys
(``chunk_size`` tokens, 256 by default). So the adapter keeps a bounded ``TokenIndex``
(block hash -> the request tokens it was seen in, and where it ends), fed with the
token ids that request events carry (``BlocksAccessed.token_ids``), and turns a
decision on block ``b`` into a call on the tokens up to the end of the LMCache chunk
that holds ``b``.

Calls (request/response shapes pinned from LMCache 0.5.6's ``schemas.py``,
``http_apis/cache_api.py``, ``controllers/eviction_http_api.py``):

==========================  ======================================================
promote (to dram or hbm)    ``POST /cache/prefetches`` {instance_id, model_name,
                            world_size, token_ids, cache_salt} -> {request_id,
                            chunks, status: submitted | noop}: warms LMCache's L1
                            (CPU memory) from L2; a promote to ``hbm`` is
                            ``clipped`` there, vLLM loads L1 into the GPU itself
demote dram -> nvme         delete the block's chunk keys, tier ``l1``: the L2 copy
                            stays (see below)
evict                       the same, tier ``l1 | l2 | all``
pin / unpin                 ``POST`` / ``DELETE /cache/pins`` {model_name,
                            world_size, token_ids, cache_salt} -> {requested,
                            affected, status}; LMCache pins hold L2 only
locate                      ``POST /directory/lookup`` {token_ids, ...} ->
                            {chunks, results: [{placements: [{tier, ...}]}]}
capacities / occupancy      ``GET /instances/usage`` -> {instances: [{instance_id,
                            modules: [{tier, used_bytes, capacity_bytes}]}]}
health                      ``GET /healthz`` -> {status: "healthy"}
==========================  ======================================================

The coordinator's ``POST /cache/delete`` drops every chunk of the prefix it is given
(an evict of block ``b`` would take b's ancestors with it), so demote and evict resolve
b's chunk keys (``/directory/lookup``), refuse when the coordinator pins them in L2
(``GET /cache/pins``), and delete only those keys on the MP server
(``GET /instances`` -> ``DELETE /cache/objects {keys, tier, force}``).

Tiers: LMCache's L1 is ``dram``, its L2 ``nvme``. Outcomes: a block whose tokens were
never seen is ``missing`` (the adapter cannot name it to LMCache); a coordinator error
is ``failed`` with LMCache's ``detail``; a sequence shorter than one chunk is
``stale`` (nothing LMCache can act on). The adapter never evicts on its own.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from executor.decision import Decision
from executor.protocol import Outcome

LMCACHE_VERSION = "0.5.6"
"""The LMCache release whose coordinator API the adapter speaks."""

TIER_OF_LMCACHE = {"l1": "dram", "l2": "nvme"}
LMCACHE_OF_TIER = {v: k for k, v in TIER_OF_LMCACHE.items()}


class LMCacheError(RuntimeError):
    """The coordinator answered with an error or could not be reached."""


@dataclass(frozen=True)
class LMCacheParams:
    """Where the coordinator is and which engine instance and model the decisions are
    for (LMCache keys depend on model, world size and cache salt)."""

    coordinator_url: str
    """``http://HOST:PORT`` of ``lmcache coordinator`` (default port 9300)."""
    instance_id: str
    """The MP server (registered with the coordinator) that serves the engine."""
    model_name: str
    world_size: int = 1
    cache_salt: str = ""
    chunk_size_tokens: int = 256
    """LMCache's ``--chunk-size``; calls are rounded up to whole chunks."""
    timeout_s: float = 5.0
    max_requests_indexed: int = 4096
    """Requests whose tokens the ``TokenIndex`` keeps (oldest forgotten first)."""
    max_decision_ids: int = 100_000
    """Decision ids remembered to answer repeats with ``duplicate``."""

    def __post_init__(self) -> None:
        if not self.coordinator_url.startswith(("http://", "https://")):
            raise ValueError(
                f"coordinator_url {self.coordinator_url!r}: give http://HOST:PORT of the "
                "LMCache coordinator"
            )
        if self.world_size < 1 or self.chunk_size_tokens < 1:
            raise ValueError("world_size and chunk_size_tokens must be >= 1")


def params_from_url(url: str) -> LMCacheParams:
    """``http://HOST:PORT?instance=ID&model=NAME[&world_size=N&chunk_size=N&cache_salt=S]``
    (what ``--executor lmcache:...`` takes) as ``LMCacheParams``."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    missing = [k for k in ("instance", "model") if not query.get(k)]
    if parts.scheme not in ("http", "https") or not parts.netloc or missing:
        raise ValueError(
            f"LMCache executor {url!r}: use http://HOST:PORT?instance=ID&model=NAME"
            + (f" (missing {', '.join(missing)})" if missing else "")
        )
    known = {"instance", "model", "world_size", "chunk_size", "cache_salt"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ValueError(
            f"LMCache executor {url!r}: unknown {unknown[0]!r}; known: {sorted(known)}"
        )
    try:
        return LMCacheParams(
            coordinator_url=f"{parts.scheme}://{parts.netloc}",
            instance_id=query["instance"],
            model_name=query["model"],
            world_size=int(query.get("world_size", 1)),
            chunk_size_tokens=int(query.get("chunk_size", 256)),
            cache_salt=query.get("cache_salt", ""),
        )
    except ValueError as exc:
        raise ValueError(f"LMCache executor {url!r}: {exc}") from None


class TokenIndex:
    """Bounded block hash -> (request tokens, end of the block in them). Called with
    every request event that carries token ids (a ``Sidecar`` hook)."""

    def __init__(self, max_requests: int = 4096) -> None:
        self.max_requests = max_requests
        self._requests: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._blocks: dict[int, tuple[int, int]] = {}  # block -> (request key, end)
        self._next_key = 0

    def record(
        self, block_hashes: Sequence[int], token_ids: Sequence[int], block_size_tokens: int
    ) -> None:
        if not block_hashes:
            return
        key = self._next_key
        self._next_key += 1
        self._requests[key] = tuple(token_ids)
        for i, block in enumerate(block_hashes):
            self._blocks[block] = (key, (i + 1) * block_size_tokens)
        while len(self._requests) > self.max_requests:
            old, _ = self._requests.popitem(last=False)
            # Blocks re-seen in a newer request point there; drop only those left behind.
            stale = [b for b, (k, _) in self._blocks.items() if k == old]
            for b in stale:
                del self._blocks[b]

    def tokens_through(self, block: int) -> tuple[tuple[int, ...], int] | None:
        """(the tokens of a request containing ``block``, the block's end in them)."""
        entry = self._blocks.get(block)
        if entry is None:
            return None
        key, end = entry
        return self._requests[key], end

    def __len__(self) -> int:
        return len(self._blocks)


class LMCacheExecutor:
    """``Executor`` over an LMCache coordinator. Thread-compatible, not thread-safe:
    the decision sink calls it from the loop's thread."""

    tier_names: tuple[str, ...] = ("dram", "nvme")

    def __init__(self, params: LMCacheParams, tokens: TokenIndex | None = None) -> None:
        self.params = params
        self.tokens = tokens or TokenIndex(params.max_requests_indexed)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.num_decisions: Counter[str] = Counter()
        self.num_calls = 0

    # -- HTTP -------------------------------------------------------------------------------

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, base: str | None = None
    ) -> Any:
        """One JSON call to the coordinator (or to ``base``, an MP server)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            (base or self.params.coordinator_url).rstrip("/") + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        self.num_calls += 1
        try:
            with urllib.request.urlopen(request, timeout=self.params.timeout_s) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read() or b"{}").get("detail", "")
            except (ValueError, AttributeError):
                detail = ""
            raise LMCacheError(f"{method} {path}: HTTP {exc.code} {detail}".strip()) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise LMCacheError(
                f"{method} {path}: LMCache at {base or self.params.coordinator_url} "
                f"unreachable ({exc}); is `lmcache coordinator` (and its MP server) running?"
            ) from None

    def _key_fields(self, token_ids: Sequence[int]) -> dict[str, Any]:
        return {
            "model_name": self.params.model_name,
            "world_size": self.params.world_size,
            "token_ids": list(token_ids),
            "cache_salt": self.params.cache_salt,
        }

    def _chunk_tokens(self, block: int) -> tuple[list[int], bool] | None:
        """Tokens through the end of the LMCache chunk holding ``block``, and whether
        that chunk is complete (LMCache ignores a trailing partial chunk)."""
        found = self.tokens.tokens_through(block)
        if found is None:
            return None
        tokens, end = found
        chunk = self.params.chunk_size_tokens
        covered = min(len(tokens), -(-end // chunk) * chunk)
        return list(tokens[:covered]), covered % chunk == 0

    # -- Executor protocol ------------------------------------------------------------------

    def apply(self, decisions: Sequence[Decision]) -> list[Outcome]:
        """One outcome per decision, in order; each decision is one coordinator call."""
        return [self._apply_one(d) for d in decisions]

    def _remember(self, decision_id: str) -> bool:
        if decision_id in self._seen:
            return False
        self._seen[decision_id] = None
        if len(self._seen) > self.params.max_decision_ids:
            self._seen.popitem(last=False)
        return True

    def _apply_one(self, d: Decision) -> Outcome:
        started = time.perf_counter()

        def out(status: str, reason: str = "") -> Outcome:
            self.num_decisions[status] += 1
            return Outcome(
                d.decision_id,
                cast(Any, status),
                reason,
                d.block_hash,
                d.from_tier,
                d.to_tier,
                duration_ms=(time.perf_counter() - started) * 1000,
            )

        if not self._remember(d.decision_id):
            return out("duplicate", "duplicate decision id")
        if d.deadline_ms is not None and d.deadline_ms < time.time() * 1000:
            return out("expired", "deadline passed")
        chunk = self._chunk_tokens(d.block_hash)
        if chunk is None:
            return out("missing", "not found: no request seen with this block's tokens")
        tokens, complete = chunk
        try:
            return self._call_for(d, tokens, complete, out)
        except LMCacheError as exc:
            self._seen.pop(d.decision_id, None)  # not done: a redelivery may retry it
            return out("failed", str(exc))

    def _call_for(self, d: Decision, tokens: list[int], complete: bool, out: Any) -> Outcome:
        p = self.params
        if d.action == "promote":
            reply = self._call(
                "POST",
                "/cache/prefetches",
                {"instance_id": p.instance_id, **self._key_fields(tokens)},
            )
            if reply.get("status") == "noop":
                return out("stale", "shorter than one LMCache chunk: nothing to prefetch")
            if not complete:
                return out("applied", "clipped: the block's LMCache chunk is incomplete")
            if d.to_tier == "hbm":
                return out("applied", "clipped: warmed into LMCache L1 (dram); vLLM loads hbm")
            return out("applied")
        if d.action in ("pin", "unpin"):
            method = "POST" if d.action == "pin" else "DELETE"
            reply = self._call(method, "/cache/pins", self._key_fields(tokens))
            if not reply.get("affected"):
                return out("stale", f"LMCache {d.action}ned no key (sequence under one chunk)")
            return out("applied")
        # demote drops the L1 copy (L2 keeps one); evict drops it from its tier, or all.
        if d.action == "demote":
            if d.from_tier not in (None, "dram") or d.to_tier != "nvme":
                return out(
                    "stale", f"LMCache demotes dram -> nvme only, not {d.from_tier} -> {d.to_tier}"
                )
            tier = "l1"
        else:
            tier = LMCACHE_OF_TIER.get(d.from_tier or "", "all")
        # The coordinator's own delete takes a token prefix and drops every chunk of it;
        # only the block's chunk should go, so resolve its keys and delete those.
        keys = self._last_chunk_keys(tokens)
        if not keys:
            return out("stale", "shorter than one LMCache chunk: nothing to delete")
        if tier in ("l2", "all") and self._pinned(keys):
            return out("refused_pinned", "LMCache pins the block's chunk in L2")
        reply = self._call(
            "DELETE",
            "/cache/objects",
            {"keys": keys, "tier": tier, "force": False},
            base=self._mp_server_url(),
        )
        if not reply.get("deleted"):
            if reply.get("skipped"):
                return out("refused_pinned", "LMCache kept locked keys")
            return out("missing", "not cached in LMCache")
        return out("applied")

    def _last_chunk_keys(self, tokens: list[int]) -> list[dict[str, Any]]:
        """LMCache's keys (every rank) of the last whole chunk of ``tokens``."""
        reply = self._call("POST", "/directory/lookup", self._key_fields(tokens))
        results, chunks = reply.get("results") or [], int(reply.get("chunks") or 0)
        if not results or not chunks:
            return []
        per_rank = max(1, len(results) // chunks)
        return [dict(r["key"]) for r in results[-per_rank:]]

    def _pinned(self, keys: list[dict[str, Any]]) -> bool:
        """Whether the coordinator pins any of ``keys`` against L2 eviction."""
        query = urllib.parse.urlencode(
            {"model_name": self.params.model_name, "cache_salt": self.params.cache_salt}
        )
        reply = self._call("GET", f"/cache/pins?{query}&limit=10000")
        pinned = {
            (p["key"].get("chunk_hash_hex"), p["key"].get("kv_rank"))
            for p in reply.get("pins") or []
            if p.get("pin_count")
        }
        return any((k.get("chunk_hash_hex"), k.get("kv_rank")) in pinned for k in keys)

    def _mp_server_url(self) -> str:
        """``http://ip:port`` of this adapter's MP server, from the coordinator's registry."""
        for inst in self._call("GET", "/instances").get("instances") or []:
            if inst.get("instance_id") == self.params.instance_id:
                return f"http://{inst['ip']}:{inst['http_port']}"
        raise LMCacheError(
            f"no MP server registered with instance_id={self.params.instance_id!r} "
            "(GET /instances on the coordinator lists them)"
        )

    def store(self, block: int, tier: str, size_bytes: int) -> Outcome:
        """Refused: the engine stores what it computes into LMCache itself; kvwarm never
        writes KV through this adapter (``failed`` with that reason)."""
        return Outcome(
            "write",
            cast(Any, "failed"),
            "LMCache stores what the engine computes; kvwarm writes no KV",
            block,
            None,
            tier,
        )

    def locate(self, block: int) -> str | None:
        """The fastest LMCache tier holding the chunk of ``block`` (None if unknown)."""
        chunk = self._chunk_tokens(block)
        if chunk is None:
            return None
        tokens, _ = chunk
        reply = self._call("POST", "/directory/lookup", self._key_fields(tokens))
        results = reply.get("results") or []
        if not results:
            return None
        # The last chunk is the one holding the block; any rank's placement counts.
        per_rank = max(1, len(results) // max(1, int(reply.get("chunks") or 1)))
        tiers = {
            TIER_OF_LMCACHE.get(str(pl.get("tier")))
            for r in results[-per_rank:]
            for pl in r.get("placements") or []
        } - {None}
        for name in self.tier_names:
            if name in tiers:
                return name
        return None

    def _usage(self, field: str) -> dict[str, int]:
        reply = self._call("GET", "/instances/usage")
        total = dict.fromkeys(self.tier_names, 0)
        modules = [
            m
            for inst in reply.get("instances") or []
            if inst.get("instance_id") == self.params.instance_id
            for m in inst.get("modules") or []
        ] + list(reply.get("shared_modules") or [])
        for m in modules:
            name = TIER_OF_LMCACHE.get(str(m.get("tier")))
            if name is not None:
                total[name] += int(m.get(field) or 0)
        return total

    def capacities(self) -> dict[str, Any]:
        """Bytes LMCache declared per tier (0: none declared). Blocks are not LMCache's
        unit, so ``num_blocks`` is None."""
        return {name: _space(None, n) for name, n in self._usage("capacity_bytes").items()}

    def occupancy(self) -> dict[str, Any]:
        return {name: _space(None, n) for name, n in self._usage("used_bytes").items()}

    def health(self) -> dict[str, Any]:
        try:
            status = self._call("GET", "/healthz").get("status", "unknown")
        except LMCacheError as exc:
            status = str(exc)
        return {
            "status": "ok" if status == "healthy" else status,
            "tiers": list(self.tier_names),
            "num_decisions": dict(self.num_decisions),
            "lmcache_version": LMCACHE_VERSION,
            "blocks_indexed": len(self.tokens),
        }

    def sync(self) -> None:
        """Nothing to make durable here: LMCache acknowledged each call as it returned."""

    def close(self) -> None:
        """Nothing held open: every call is its own HTTP request."""


def _space(num_blocks: int | None, size_bytes: int) -> Any:
    try:
        from executor.protocol import TierSpace  # type: ignore[import-not-found]
    except ImportError:  # before the Executor protocol module exists
        return {"num_blocks": num_blocks, "size_bytes": size_bytes}
    return TierSpace(num_blocks, size_bytes)
