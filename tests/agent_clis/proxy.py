"""A recording reverse proxy in front of `kvflow serve`, for the agent CLIs' tests.

Every request a client sends passes through unchanged (streams included) and is recorded: method, path,
JSON body, status and response text. Each gets an X-Request-Id of the proxy's own (`agent-1`, `agent-2`,
...), which the server uses as the request's id in its log, so a test can read from the server's log what
the prefix cache served to that one request. A test may set `steer`: a function that may rewrite a request's
JSON body before it is forwarded (to make the model call a client's tool); the server itself is never told.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import uvicorn
from server.server_process import free_port
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

# Headers that belong to one hop, not to the message: the proxy's own connections set them.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding",
        "content-encoding", "x-request-id"}
_FINISHED = re.compile(r"request (\S+) finished \((.*?)\): (\d+) prompt tokens \((\d+) cached\), (\d+) generated")
RESPONSE_CAP = 1 << 20


@dataclass
class Exchange:
    request_id: str
    method: str
    path: str
    body: dict | None  # the JSON body as forwarded (after steering), None when not JSON
    steered: bool = False
    status: int | None = None
    response: str = ""  # the response's text, cut at RESPONSE_CAP characters
    done: bool = False

    @property
    def is_generation(self) -> bool:
        """A request that asks the model for an answer (not a model list, a HEAD or a token count)."""
        return self.method == "POST" and self.path.split("?")[0].rstrip("/").endswith(
            ("/chat/completions", "/responses", "/messages", "/completions", "/api/chat", "/api/generate"))

    def prompt_text(self) -> str:
        return json.dumps(self.body) if self.body is not None else ""


@dataclass
class Served:
    """What the server's log says of one finished request."""

    finish: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


@dataclass
class AgentProxy:
    upstream: str
    steer: Callable[[Exchange], dict | None] | None = None
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        config = uvicorn.Config(self._app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="agent-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the agent proxy did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    def generations(self) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.is_generation]

    async def _app(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        raw = await request.body()
        exchange = Exchange(f"agent-{next(self._ids)}", request.method, _path(scope), None)
        with self._lock:
            self.exchanges.append(exchange)
        try:
            exchange.body = json.loads(raw) if raw else None
        except ValueError:
            exchange.body = None
        if isinstance(exchange.body, dict) and self.steer is not None:
            steered = self.steer(exchange)
            if steered is not None:
                exchange.body, exchange.steered = steered, True
                raw = json.dumps(steered).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["x-request-id"] = exchange.request_id
        client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600.0, connect=10.0))
        try:
            upstream = await client.send(client.build_request(request.method, exchange.path, headers=headers,
                                                              content=raw), stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            exchange.status, exchange.response, exchange.done = 502, f"proxy: {exc!r}", True
            await Response(exchange.response, status_code=502)(scope, receive, send)
            return
        exchange.status = upstream.status_code
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    if len(exchange.response) < RESPONSE_CAP:
                        exchange.response += chunk.decode("utf-8", "replace")
                    yield chunk
            finally:
                exchange.done = True
                await upstream.aclose()
                await client.aclose()

        await StreamingResponse(body(), status_code=upstream.status_code, headers=out_headers)(scope, receive, send)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until every recorded exchange has finished (a client may leave a background request behind)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(e.done for e in self.exchanges):
                    return
            time.sleep(0.1)


def _path(scope) -> str:
    query = scope.get("query_string", b"").decode()
    return scope["path"] + (f"?{query}" if query else "")


def served(server_log: str) -> dict[str, Served]:
    """Each finished request in the server's log (`--log-level info`), by its id."""
    return {m.group(1): Served(m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5)))
            for m in _FINISHED.finditer(server_log)}
