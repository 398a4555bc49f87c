"""The server's own page (GET /: chat with the model and watch prefill and decode happen) and the live data
it polls (GET /kvflow/live). The page is static files in server/page/, no build step; it talks to the
server's OpenAI-compatible streaming API like any client, and reads per answer where the time went from
usage.kvflow_timings.

/kvflow/live: the engine's gauges (running, waiting, KV cache use, prefix-cache hit rate), the steps run
since the step number the page last saw (prompt tokens against decode tokens per step), and what the
machine allows the model (server/machine.py). Off with --no-metrics, as /metrics is; the page then
stays a plain chat. POST /kvflow/probe measures the machine when no probe is saved.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response

from kvflow.server.errors import APIError
from kvflow.server.serving import ServerState, get_state, metrics_state

PAGE_DIR = Path(__file__).parent / "page"
PAGE_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
MAX_STEPS_PER_POLL = 400  # a page that fell far behind gets the newest steps

router = APIRouter(include_in_schema=False)


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: Request) -> Response:
    # Browsers get the page; clients that probe the root (Ollama's "is it running" check, curl) a line.
    # HEAD (Claude Code sends one before its requests) answers the same, without the body (uvicorn drops it).
    if not get_state(request).settings.ui or "text/html" not in request.headers.get("accept", ""):
        return PlainTextResponse("kvflow is running")
    root = request.scope.get("root_path", "").rstrip("/")
    html = (PAGE_DIR / "index.html").read_text().replace("__ROOT__", _html_attr(root + "/"))
    return HTMLResponse(html, headers={"Cache-Control": "no-store", **_PAGE_HEADERS})


@router.get("/ui/{name}")
async def page_file(request: Request, name: str) -> Response:
    if not get_state(request).settings.ui or name not in PAGE_FILES:
        raise APIError(404, f"no such file: {name}", None, "not_found")
    return FileResponse(PAGE_DIR / name, media_type=PAGE_FILES[name], headers=_PAGE_HEADERS)


@router.get("/kvflow/live")
async def live(request: Request, since: int = Query(0, ge=0)) -> JSONResponse:
    return JSONResponse(_live(metrics_state(request), since))


@router.post("/kvflow/probe")
async def probe(request: Request) -> JSONResponse:
    started = metrics_state(request).machine.start_probe()
    return JSONResponse({"started": started, "probing": True}, status_code=202)


def _live(state: ServerState, since: int) -> dict:
    s = state.engine.stats
    engine = state.engine.engine
    steps = engine.step_history.since(since, MAX_STEPS_PER_POLL)
    return {
        "model": state.model_name,
        "max_model_len": engine.max_model_len,
        "kv_capacity_tokens": engine.kv_capacity_tokens,
        "running": s.num_running,
        "waiting": s.num_waiting,
        "kv_cache_usage": s.kv_cache_usage,
        "kv_blocks_used": s.num_blocks_used,
        "kv_blocks_total": s.num_blocks,
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "prefix_queried_tokens": s.prefix_queried_tokens,
        "num_preemptions": s.num_preemptions,
        "num_steps": s.num_steps,
        "steps": [r.as_dict() for r in steps],
        "limits": state.machine.as_dict(),
    }


# The page runs only its own script and style, and no other site may frame it (clickjacking).
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _html_attr(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;")
