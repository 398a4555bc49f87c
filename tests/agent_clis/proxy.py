"""A recording reverse proxy in front of `kvflow serve`, for the agent CLIs' tests.

Every request a client sends passes through (streams included) and is recorded: method, path, JSON body,
status and response text, from which `usage()` reads what the prefix cache served it. Two test-side changes
may be made to a request's JSON body before it is forwarded, never in the server: `output_cap` bounds the
answer's length (the default model rarely stops by itself on an agent's prompt, and Codex sends no bound
at all), and `steer`, a function, may rewrite the body (to make the model call one of the client's tools:
`steered` marks the request it forced).
Each request also gets an X-Request-Id of the proxy's own (`agent-1`, ...), for reading the server's log.
"""

from __future__ import annotations

import itertools
import json
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
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # until the response's last byte

    @property
    def is_generation(self) -> bool:
        """A request that asks the model for an answer (not a model list, a HEAD or a token count)."""
        return self.method == "POST" and self.path.split("?")[0].rstrip("/").endswith(
            ("/chat/completions", "/responses", "/messages", "/completions", "/api/chat", "/api/generate"))

    @property
    def api(self) -> str:
        """Which wire API: "chat", "responses" or "messages"."""
        path = self.path.split("?")[0]
        return "messages" if path.endswith("/messages") else "responses" if path.endswith("/responses") else "chat"

    def events(self) -> list[dict]:
        """The response's JSON objects: each SSE event's data, or the whole body."""
        found = []
        for line in self.response.splitlines() or [""]:
            text = line.removeprefix("data:").strip() if line.startswith("data:") else line.strip()
            if text.startswith("{"):
                try:
                    found.append(json.loads(text))
                except ValueError:
                    pass
        return found

    def answer(self) -> str:
        """The answer's text and tool-call arguments, joined (for reports)."""
        parts: list[str] = []

        def walk(node) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if key in ("tools", "response", "instructions", "input"):  # echoes of the request
                        continue
                    if key in ("content", "text", "arguments", "partial_json", "delta") and isinstance(value, str):
                        parts.append(value)
                    elif key == "name" and isinstance(value, str):
                        parts.append(f"[{value}]")
                    else:
                        walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)

        for event in self.events():
            if event.get("type") not in ("response.completed", "response.output_item.done", "message_start"):
                walk(event)
        return "".join(parts)

    def usage(self) -> tuple[int, int] | None:
        """(prompt tokens, of those served from the prefix cache) from the response's usage, in whichever
        API's shape; None when the response carried none."""
        merged: dict = {}
        for event in self.events():
            for holder in (event, event.get("response") or {}, event.get("message") or {}):
                if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                    merged.update(holder["usage"])
        if "prompt_tokens" in merged:  # chat completions
            return merged["prompt_tokens"], (merged.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if "cache_read_input_tokens" in merged:  # Anthropic: input_tokens excludes the cached ones
            cached = merged["cache_read_input_tokens"] or 0
            return merged.get("input_tokens", 0) + cached, cached
        if "input_tokens" in merged:  # Responses
            return merged["input_tokens"], (merged.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return None


@dataclass
class AgentProxy:
    upstream: str
    steer: Callable[[Exchange], tuple[dict, bool] | None] | None = None  # (new body, forced a tool call)
    output_cap: int | None = None  # at most this many tokens per answer (steered answers: steered_cap)
    # A JSON schema every answer but the steered one is held to (response_format, Responses text.format,
    # Anthropic output_config.format), with tool_choice none: for clients that take an answer cut at its
    # bound as an error.
    answer_schema: dict | None = None
    steered_cap: int = 160
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
        if isinstance(exchange.body, dict) and exchange.is_generation:
            steered = self.steer(exchange) if self.steer is not None else None
            if steered is not None:
                exchange.body, exchange.steered = steered
            if exchange.steered:  # room for the whole call, whatever bound the client set
                cap_output(exchange, self.steered_cap, raise_to=True)
            else:
                if self.output_cap is not None:
                    cap_output(exchange, self.output_cap)
                if self.answer_schema is not None:
                    hold_answer(exchange, self.answer_schema)
            raw = json.dumps(exchange.body).encode()
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
                exchange.seconds = time.monotonic() - exchange.started
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


def hold_answer(exchange: Exchange, schema: dict) -> None:
    """The answer held to `schema`, in the field the request's API uses, and no tool called (a model this
    small, shown a tool's result, calls the tool again and again)."""
    body = exchange.body
    assert body is not None
    if body.get("tools"):
        body["tool_choice"] = {"type": "none"} if exchange.api == "messages" else "none"
    if exchange.api == "messages":
        body["output_config"] = {**(body.get("output_config") or {}), "format": {"type": "json_schema", "schema": schema}}
    elif exchange.api == "responses":
        body["text"] = {**(body.get("text") or {}),
                        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def cap_output(exchange: Exchange, cap: int, raise_to: bool = False) -> None:
    """At most `cap` tokens of answer (raise_to: exactly `cap`), in the field the request's API uses."""
    body = exchange.body
    assert body is not None
    fields = {"messages": ["max_tokens"], "responses": ["max_output_tokens"]}.get(
        exchange.api, [f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None] or ["max_tokens"])
    for name in fields:
        given = body.get(name)
        body[name] = cap if given is None or raise_to else min(int(given), cap)
