"""Ollama-compatible routes: /api/generate and /api/chat (NDJSON streams by default), /api/tags,
/api/show, /api/version. Durations are in nanoseconds, as Ollama reports them.

/api/chat is an adapter of the chat pipeline (chat_pipeline.py): its messages, tools and format become the
internal chat request (ollama_protocol.py), sampled with Ollama's options and defaults, and the pipeline's
events become its lines. /api/generate's prompt (rendered as one user turn, or raw) runs through the same
pipeline as a prompt already made, its text all content."""

from __future__ import annotations

import datetime
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow import __version__
from kvflow.engine.async_engine import EngineDeadError
from kvflow.outputs import RequestOutput
from kvflow.server import openapi
from kvflow.server.answer_parser import Reasoning
from kvflow.server.chat_pipeline import (
    ChatPrompt,
    ChatRun,
    ChoiceDelta,
    check_constraint,
    render_chat,
    start_chat,
    start_prompt,
)
from kvflow.server.harmony import is_harmony
from kvflow.server.metrics import request_timings, timing_headers
from kvflow.server.ollama_protocol import ChatRequest, GenerateRequest, ShowRequest
from kvflow.server.serving import ServerState, get_state, parse_body
from kvflow.server.tool_calls import ToolCall

router = APIRouter()

NDJSON = "application/x-ndjson"


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return int((seconds or 0.0) * 1e9)


def _final_fields(out: RequestOutput, started_ns: int) -> dict:
    m, c = out.metrics, out.outputs[0]
    return {
        "done": True,
        "done_reason": c.finish_reason,
        "total_duration": time.monotonic_ns() - started_ns,
        "load_duration": 0,  # the model is loaded before the server opens
        "prompt_eval_count": m.num_prompt_tokens,
        "prompt_eval_duration": _ns(m.prefill_time),
        "eval_count": len(c.token_ids),
        "eval_duration": _ns(m.decode_time),
        "kvflow_timings": request_timings([out]),
    }


@router.post("/api/generate", openapi_extra=openapi.body(GenerateRequest))
async def generate(request: Request):
    started = time.monotonic_ns()
    state = get_state(request)
    body = await parse_body(request, GenerateRequest)
    state.check_model(body.model)
    body.check()
    params = body.sampling_params()
    check_constraint(state, params, "format")
    if not body.prompt:  # Ollama's way to load a model: answer at once
        return {"model": state.model_name, "created_at": _now_iso(), "response": "", "done": True,
                "done_reason": "load"}
    if body.raw:
        prompt = body.prompt
    else:
        system = [{"role": "system", "content": body.system}] if body.system else []
        prompt = render_chat(state.tokenizer, system + [{"role": "user", "content": body.prompt}], "prompt")
    run = await start_prompt(state, ChatPrompt(prompt, None, None, None), params, f"ollama-gen-{uuid.uuid4().hex}")

    def piece(text: str) -> dict:
        return {"model": state.model_name, "created_at": _now_iso(), "response": text, "done": False}

    def final(out: RequestOutput, text: str) -> dict:
        context = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        return {**piece(text), **_final_fields(out, started), "context": context}

    return await _respond(request, body.stream, run, piece, final)


@router.post("/api/chat", openapi_extra=openapi.body(ChatRequest))
async def chat(request: Request):
    started = time.monotonic_ns()
    state = get_state(request)
    body = await parse_body(request, ChatRequest)
    state.check_model(body.model)
    body.check()
    params = body.sampling_params()

    def piece(text: str, calls: list[ToolCall] | None = None, thinking: str = "") -> dict:
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:  # Ollama gives arguments as an object
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": _arguments(c)}} for c in calls]
        return {"model": state.model_name, "created_at": _now_iso(), "message": message, "done": False}

    if not body.messages:  # loads the model in Ollama
        return {**piece(""), "done": True, "done_reason": "load"}
    run = await start_chat(state, body.as_openai(), f"ollama-chat-{uuid.uuid4().hex}", params, "format")

    def final(out: RequestOutput, text: str, calls: list[ToolCall] | None = None, thinking: str = "") -> dict:
        return {**piece(text, calls, thinking), **_final_fields(out, started)}

    return await _respond(request, body.stream, run, piece, final)


def _arguments(call: ToolCall):
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


async def _respond(request: Request, stream: bool, run: ChatRun, piece, final):
    if not stream:
        out, (answer,) = await run.answers(request)
        extra = (answer.calls, answer.reasoning) if answer.calls or answer.reasoning else ()
        doc = final(out, answer.content, *extra)
        return JSONResponse(doc, headers=timing_headers(doc["kvflow_timings"]))
    return StreamingResponse(_lines(request, run, piece, final), media_type=NDJSON)


async def _lines(request: Request, run: ChatRun, piece, final) -> AsyncIterator[str]:
    """NDJSON lines: thinking and content as the pipeline lets them through, each call once complete (Ollama
    sends calls whole, arguments as an object), all of one step in one line; the last step's text goes in the
    final line, unless it held calls or thinking, which get a line of their own before it."""
    last = ("", [], "")  # the finishing step's content, calls and thinking
    try:
        async for event in run.events(request):
            if not isinstance(event, ChoiceDelta):
                text, calls, thinking = last
                if calls or thinking:
                    yield json.dumps(piece(text, calls, thinking)) + "\n"
                    text = ""
                yield json.dumps(final(event.output, text)) + "\n"
                continue
            text = "".join(p for p in event.pieces if isinstance(p, str) and not isinstance(p, Reasoning))
            thinking = "".join(p for p in event.pieces if isinstance(p, Reasoning))
            calls = [p for p in event.pieces if isinstance(p, ToolCall)]
            if event.finish_reason is not None:
                last = (text, calls, thinking)
            elif calls or thinking:
                yield json.dumps(piece(text, calls, thinking)) + "\n"
            elif text:
                yield json.dumps(piece(text)) + "\n"
    except EngineDeadError as exc:
        yield json.dumps({"error": str(exc)}) + "\n"


# ---- model information ---------------------------------------------------------------------------------
def _details(state: ServerState) -> dict:
    loaded = state.engine.engine.loaded
    family = loaded.arch.architecture.removesuffix("ForCausalLM").lower()
    return {
        "parent_model": "", "format": "gguf" if loaded.resolved.kind == "gguf" else "safetensors",
        "family": family, "families": [family], "parameter_size": _human(_num_parameters(state)),
        "quantization_level": str(loaded.dtype).removeprefix("torch."),
    }


def _num_parameters(state: ServerState) -> int:
    return state.engine.engine.model_summary.num_parameters


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0", "")
    return str(n)


def _size_bytes(state: ServerState) -> int:
    path = state.engine.engine.loaded.resolved.path
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _modified_at(state: ServerState) -> str:
    mtime = state.engine.engine.loaded.resolved.path.stat().st_mtime
    return datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@router.get("/api/tags")
async def tags(request: Request) -> dict:
    state = get_state(request)
    digest = hashlib.sha256(str(state.engine.engine.loaded.resolved.path).encode()).hexdigest()
    return {"models": [{
        "name": state.model_name, "model": state.model_name, "modified_at": _modified_at(state),
        "size": _size_bytes(state), "digest": digest, "details": _details(state),
    }]}


@router.post("/api/show", openapi_extra=openapi.body(ShowRequest))
async def show(request: Request) -> dict:
    state = get_state(request)
    body = await parse_body(request, ShowRequest)
    state.check_model(body.model or body.name or state.model_name)
    loaded = state.engine.engine.loaded
    arch = loaded.arch
    family = _details(state)["family"]
    return {
        "license": "", "modelfile": f"FROM {loaded.resolved.path}\n", "parameters": "",
        "template": getattr(state.tokenizer, "chat_template", None) or "",
        "details": _details(state),
        "model_info": {
            "general.architecture": family, "general.parameter_count": _num_parameters(state),
            f"{family}.context_length": state.engine.engine.max_model_len,
            f"{family}.embedding_length": arch.hidden_size, f"{family}.block_count": arch.num_layers,
            f"{family}.attention.head_count": arch.num_heads,
            f"{family}.attention.head_count_kv": arch.num_kv_heads,
        },
        "capabilities": ["completion", "tools"] + (["thinking"] if _thinks(state.tokenizer.chat_template) else []),
        "modified_at": _modified_at(state),
    }


def _thinks(chat_template: str | None) -> bool:
    return "<think>" in (chat_template or "") or is_harmony(chat_template)


@router.get("/api/version")
async def version() -> dict:
    return {"version": __version__}
