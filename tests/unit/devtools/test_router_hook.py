"""The router hook: a proxy in front of an engine tells the sidecar about each request
(token ids from the engine's own /tokenize), and never fails a request because the
sidecar is down."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from devtools.router_hook import ProxyHook, serve_proxy
from features.block_hash import HashParams, engine_block_ids
from serving.http import HealthServer, SidecarMetrics
from serving.request_intake import REQUESTS_PATH, RequestIntake

CHAT_TOKENS = list(range(100, 140))  # what the engine's chat template yields


def engine_standin() -> ThreadingHTTPServer:
    """vLLM's OpenAI server, as far as the hook uses it: /tokenize and completions."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                tokens = CHAT_TOKENS if "messages" in body else [7] * len(body["prompt"])
                reply: dict[str, Any] = {
                    "count": len(tokens),
                    "max_model_len": 4096,
                    "tokens": tokens,
                }
            else:
                reply = {"object": "chat.completion", "echo_model": body.get("model")}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


def test_proxy_announces_engine_tokens_then_forwards() -> None:
    engine = engine_standin()
    intake = RequestIntake()
    sidecar = HealthServer(
        SidecarMetrics(), dict, lambda: True, port=0, posts={REQUESTS_PATH: intake.submit}
    ).start()
    hook = ProxyHook(f"http://127.0.0.1:{engine.server_address[1]}", sidecar.url, "vllm-0")
    proxy = serve_proxy(hook)
    try:
        base = f"http://127.0.0.1:{proxy.server_address[1]}"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert post(base + "/v1/chat/completions", chat)["echo_model"] == "m"
        post(base + "/v1/completions", {"model": "m", "prompt": list(range(33))})
        first, second = intake.take(10)
        assert first.engine_id == "vllm-0" and first.token_ids == tuple(CHAT_TOKENS)
        assert list(first.block_hashes) == engine_block_ids(CHAT_TOKENS, HashParams())
        assert second.token_ids == tuple(range(33)) and len(second.block_hashes) == 2
    finally:
        proxy.shutdown()
        sidecar.close()
    # The sidecar is gone: the request still goes through.
    hook = ProxyHook(hook.engine_url, "http://127.0.0.1:9", "vllm-0", timeout_s=0.2)
    assert hook.announce_request("/v1/completions", {"prompt": [1, 2, 3]}) is None
    proxy = serve_proxy(hook)
    try:
        reply = post(
            f"http://127.0.0.1:{proxy.server_address[1]}/v1/completions",
            {"model": "x", "prompt": "abc"},
        )
        assert reply["echo_model"] == "x"
    finally:
        proxy.shutdown()
        engine.shutdown()
