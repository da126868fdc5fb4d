"""A stand-in for LMCache's multi-process coordinator (and the MP server behind it) for
tests where LMCache does not run: the request and response shapes of LMCache 0.5.6
(``lmcache/v1/mp_coordinator/schemas.py``, ``http_apis/cache_api.py``,
``controllers/eviction_http_api.py``, ``http_apis/instances_usage_api.py``), served over
real HTTP with the same status codes for unknown instances (404, ``detail``) and
malformed bodies (422).

Semantics kept: keys are prefix-chained chunks of ``chunk_size`` tokens (a trailing
partial chunk is ignored; under one chunk a call is a ``noop``); prefetch warms L1 from
L2; delete per tier (``l1``/``l2``/``all``) skips L2-pinned keys unless ``force``; pins
are reference-counted and apply to L2. Not kept: LMCache's hashing of keys (a prefix
tuple stands in), ranks, quotas, events. ``MPServerStandIn`` is the MP server side only
(what a real coordinator proxies prefetch and delete calls to).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Key = tuple[int, ...]

_KEY_FIELDS = {"model_name": str, "world_size": int, "token_ids": list, "cache_salt": str}


class _Reply(Exception):
    def __init__(self, code: int, body: dict[str, Any]) -> None:
        self.code = code
        self.body = body


def _require(body: Any, fields: dict[str, type], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(body, dict):
        raise _Reply(422, {"detail": "body must be an object"})
    for name, kind in fields.items():
        if name not in body:
            if name in optional:
                continue
            raise _Reply(422, {"detail": [{"loc": ["body", name], "msg": "Field required"}]})
        value = body[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _Reply(422, {"detail": [{"loc": ["body", name], "msg": "wrong type"}]})


class LMCacheStandIn:
    """The coordinator's REST API on 127.0.0.1 (port 0: any free port), with one or more
    registered MP server instances and their L1/L2 contents in memory."""

    def __init__(
        self,
        *,
        chunk_size: int = 256,
        instances: tuple[str, ...] = ("mp-0",),
        capacity_bytes: dict[str, int] | None = None,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        self.chunk_size = chunk_size
        self.instances = set(instances)
        self.capacity_bytes = capacity_bytes or {"l1": 64 << 20, "l2": 1 << 30}
        self.chunk_bytes = chunk_bytes
        self.l1: set[Key] = set()
        self.l2: set[Key] = set()
        self.pins: Counter[Key] = Counter()
        self._by_hex: dict[str, Key] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.healthy = True
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LMCacheStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self, token_ids: list[int]) -> list[Key]:
        """The chunk keys of a token sequence (complete chunks only)."""
        n = len(token_ids) // self.chunk_size
        return [tuple(token_ids[: (i + 1) * self.chunk_size]) for i in range(n)]

    def encoded_key(self, key: Key, model_name: str = "", cache_salt: str = "") -> dict[str, Any]:
        """An ``EncodedObjectKey``: a stand-in chunk hash (sha256 of the prefix)."""
        digest = hashlib.sha256(repr(key).encode()).hexdigest()
        self._by_hex[digest] = key
        return {
            "chunk_hash_hex": digest,
            "model_name": model_name,
            "kv_rank": 0,
            "object_group_id": 0,
            "cache_salt": cache_salt,
        }

    def _instance(self, body: dict[str, Any]) -> None:
        if body.get("instance_id") not in self.instances:
            raise _Reply(
                404,
                {"detail": f"no MP server registered with instance_id={body.get('instance_id')!r}"},
            )

    def route(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.calls.append((method, path, body))
            try:
                return 200, self._route(method, path, body)
            except _Reply as reply:
                return reply.code, reply.body

    def _route(self, method: str, path: str, body: Any) -> dict[str, Any]:
        if (method, path) == ("GET", "/healthz"):
            if not self.healthy:
                raise _Reply(503, {"detail": "unhealthy"})
            return {"status": "healthy"}
        if (method, path) == ("POST", "/cache/prefetches"):
            _require(body, {"instance_id": str, **_KEY_FIELDS}, optional=("cache_salt",))
            self._instance(body)
            keys = self.keys(body["token_ids"])
            if not keys:
                return {
                    "instance_id": body["instance_id"],
                    "request_id": "",
                    "chunks": 0,
                    "status": "noop",
                }
            self.l1.update(k for k in keys if k in self.l2)
            return {
                "instance_id": body["instance_id"],
                "request_id": f"pf-{len(self.calls)}",
                "chunks": len(keys),
                "status": "submitted",
            }
        if path == "/cache/pins" and method in ("POST", "DELETE"):
            _require(body, _KEY_FIELDS, optional=("cache_salt",))
            keys = self.keys(body["token_ids"])
            for k in keys:
                if method == "POST":
                    self.pins[k] += 1
                elif self.pins[k]:
                    self.pins[k] -= 1
            self.pins += Counter()  # drop zero counts
            status = "pinned" if method == "POST" else "unpinned"
            return {"requested": len(keys), "affected": len(keys), "status": status}
        if (method, path) == ("POST", "/cache/delete"):
            _require(
                body,
                {"instance_id": str, **_KEY_FIELDS, "tier": str, "force": bool},
                optional=("cache_salt", "tier", "force"),
            )
            self._instance(body)
            tier = body.get("tier", "all")
            if tier not in ("l1", "l2", "all"):
                raise _Reply(422, {"detail": [{"loc": ["body", "tier"], "msg": "bad tier"}]})
            keys = self.keys(body["token_ids"])
            if not keys:
                return {
                    "instance_id": body["instance_id"],
                    "requested": 0,
                    "affected": 0,
                    "skipped": 0,
                    "status": "noop",
                }
            affected = skipped = 0
            for k in keys:
                if tier in ("l1", "all") and k in self.l1:
                    self.l1.discard(k)
                    affected += 1
                if tier in ("l2", "all") and k in self.l2:
                    if self.pins[k] and not body.get("force"):
                        skipped += 1
                    else:
                        self.l2.discard(k)
                        affected += 1
            return {
                "instance_id": body["instance_id"],
                "requested": len(keys),
                "affected": affected,
                "skipped": skipped,
                "status": "deleted",
            }
        if (method, path) == ("POST", "/directory/lookup"):
            _require(body, _KEY_FIELDS, optional=("cache_salt", "world_size"))
            keys = self.keys(body["token_ids"])
            results = []
            for k in keys:
                placements = [
                    {
                        "instance_id": i,
                        "incarnation": 0,
                        "tier": t,
                        "backend": "mem",
                        "size_bytes": self.chunk_bytes,
                        "shared": False,
                    }
                    for i in sorted(self.instances)
                    for t, held in (("l1", self.l1), ("l2", self.l2))
                    if k in held
                ]
                results.append(
                    {
                        "key": self.encoded_key(k, body["model_name"], body.get("cache_salt", "")),
                        "placements": placements,
                        "token_ids": [],
                        "access_count": 0,
                    }
                )
            return {"chunks": len(keys), "results": results}
        if (method, path) == ("GET", "/instances"):
            return {
                "instances": [
                    {"instance_id": i, "ip": "127.0.0.1", "http_port": self.port, "metadata": {}}
                    for i in sorted(self.instances)
                ]
            }
        if (method, path) == ("GET", "/cache/pins"):
            pins = [{"key": self.encoded_key(k), "pin_count": n} for k, n in self.pins.items()]
            return {"total": len(pins), "pins": pins}
        if (method, path) == ("DELETE", "/cache/objects"):  # the MP server's endpoint
            _require(body, {"keys": list, "tier": str, "force": bool}, optional=("tier", "force"))
            tier = body.get("tier", "l2")
            deleted = 0
            for encoded in body["keys"]:
                key = self._by_hex.get(encoded.get("chunk_hash_hex", ""))
                for name, held in (("l1", self.l1), ("l2", self.l2)):
                    if key is not None and tier in (name, "all") and key in held:
                        held.discard(key)
                        deleted += 1
            return {"deleted": deleted, "skipped": 0, "ok": True}
        if (method, path) == ("GET", "/instances/usage"):
            used = {"l1": len(self.l1) * self.chunk_bytes, "l2": len(self.l2) * self.chunk_bytes}
            return {
                "instances": [
                    {
                        "instance_id": i,
                        "registered": True,
                        "declared_capacity": True,
                        "modules": [
                            {
                                "tier": t,
                                "backend": "mem",
                                "shared": False,
                                "used_bytes": used[t],
                                "capacity_bytes": self.capacity_bytes[t],
                                "usage_ratio": used[t] / self.capacity_bytes[t],
                            }
                            for t in ("l1", "l2")
                        ],
                    }
                    for i in sorted(self.instances)
                ],
                "shared_modules": [],
            }
        raise _Reply(404, {"detail": "Not Found"})


class MPServerStandIn:
    """The MP server endpoints a real coordinator proxies to (``POST /cache/prefetches``,
    ``GET /cache/prefetches/{id}``, ``DELETE /cache/objects``), recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()

        def route(method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
            with self._lock:
                self.calls.append((method, path, body))
            if (method, path) == ("POST", "/cache/prefetches"):
                return 202, {
                    "request_id": f"pf-{len(self.calls)}",
                    "chunks": 1,
                    "status": "submitted",
                }
            if method == "GET" and path.startswith("/cache/prefetches/"):
                return 200, {
                    "request_id": path.rsplit("/", 1)[1],
                    "status": "completed",
                    "found_keys": 1,
                    "total_keys": 1,
                }
            if (method, path) == ("DELETE", "/cache/objects"):
                return 200, {"deleted": len(body.get("keys", [])), "skipped": 0, "ok": True}
            return 404, {"detail": "Not Found"}

        self.route = route
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(owner: Any) -> type[BaseHTTPRequestHandler]:
    route: Callable[[str, str, Any], tuple[int, dict[str, Any]]] = owner.route

    class Handler(BaseHTTPRequestHandler):
        timeout = 10

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                code, reply = 422, {"detail": "body is not JSON"}
            else:
                code, reply = route(method, self.path.split("?", 1)[0], body)
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def do_DELETE(self) -> None:  # noqa: N802
            self._serve("DELETE")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler
