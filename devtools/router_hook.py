"""A router-side hook: how a gateway in front of vLLM feeds kvwarm request events.

The hook sits where an OpenAI-compatible proxy (or a KV-aware router) has chosen the
engine for a request, before forwarding it:

1. token ids: a ``/v1/completions`` prompt given as token ids is used as is; text and
   chat prompts are tokenized by the engine itself (``POST /tokenize`` on vLLM's
   OpenAI server, with ``messages`` for chat so the chat template is applied exactly as
   the engine applies it);
2. ``announce``: the token ids go to the sidecar's ``POST /v1/requests`` with the
   engine's id, block size and hash algorithm (what kvwarm needs to hash them into the
   engine's block ids); a short timeout, and a failure is logged, never raised: kvwarm
   being down must not fail user requests;
3. the request is forwarded to the engine unchanged.

``ProxyHook`` does 1-2 for one request; ``serve_proxy`` is a minimal proxy built on it
(a demo and a test fixture; a production gateway calls ``ProxyHook.announce_request``
from its own request path, or publishes the same JSON to the Kafka events topic).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ProxyHook:
    """What a router knows about the engine it routes to."""

    engine_url: str
    """``http://HOST:PORT`` of the vLLM OpenAI server."""
    sidecar_url: str
    """``http://HOST:PORT`` of the kvwarm sidecar (its ``--http-port``)."""
    engine_id: str
    block_size: int = 16
    """The engine's ``--block-size``."""
    hash_algo: str = "sha256"
    """The engine's ``--prefix-caching-hash-algo``."""
    timeout_s: float = 0.5

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            return json.loads(reply.read())

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the engine will see them."""
        prompt = body.get("prompt")
        if (
            path == "/v1/completions"
            and isinstance(prompt, list)
            and all(isinstance(t, int) for t in prompt)
        ):
            return list(prompt)
        if path == "/v1/chat/completions":
            query = {"model": body.get("model"), "messages": body.get("messages", [])}
        else:
            query = {
                "model": body.get("model"),
                "prompt": prompt if isinstance(prompt, str) else "",
            }
        return list(self._post(self.engine_url.rstrip("/") + "/tokenize", query)["tokens"])

    def announce_request(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Tell the sidecar a request is on its way to the engine. Returns the sidecar's
        reply (request id, block hashes), or None when it could not be told."""
        try:
            event = {
                "request_id": str(body.get("request_id") or f"router-{uuid.uuid4().hex}"),
                "engine_id": self.engine_id,
                "token_ids": self.token_ids(path, body),
                "block_size": self.block_size,
                "hash_algo": self.hash_algo,
                "model": body.get("model"),
            }
            salt = body.get("cache_salt")
            if isinstance(salt, str):
                event["cache_salt"] = salt
            return dict(self._post(self.sidecar_url.rstrip("/") + "/v1/requests", event))
        except (OSError, ValueError, KeyError) as exc:  # never fail the user's request
            log.warning("kvwarm not told about a request: %s", exc)
            return None


def serve_proxy(hook: ProxyHook, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A minimal OpenAI-compatible proxy in a daemon thread: announce, then forward the
    body to the engine and relay its answer (no streaming). ``server_address`` says
    the port."""

    class Handler(BaseHTTPRequestHandler):
        timeout = 30

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path in OPENAI_PATHS:
                with contextlib.suppress(ValueError):  # not JSON: the engine answers it
                    hook.announce_request(path, json.loads(raw))
            request = urllib.request.Request(
                hook.engine_url.rstrip("/") + self.path,
                data=raw,
                headers={"Content-Type": self.headers.get("Content-Type", "application/json")},
            )
            try:
                with urllib.request.urlopen(request, timeout=600) as reply:
                    code, data = reply.status, reply.read()
            except urllib.error.HTTPError as exc:
                code, data = exc.code, exc.read()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("proxy: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvwarm-proxy", daemon=True).start()
    return server
