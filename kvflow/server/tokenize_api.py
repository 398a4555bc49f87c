"""POST /tokenize and /detokenize in vLLM's shapes (prompt or chat messages in; count, tokens and token
strings out) and llama.cpp's (content in, tokens or {id, piece} out), and GET /version. Tokenizing chat
messages gives exactly the prompt /v1/chat/completions would run."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from kvflow import __version__
from kvflow.server import openapi
from kvflow.server.chat_pipeline import prepare_chat
from kvflow.server.errors import bad_request
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.serving import get_state, parse_body
from kvflow.server.vllm_fields import check_generation_prompt

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (serving.unknown_fields)
    model: str | None = None
    prompt: str | None = None  # vLLM
    content: str | None = None  # llama.cpp
    messages: list[dict] | None = None  # vLLM's chat form
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the prompt ends inside the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # vLLM (default: true for a prompt, false for messages)
    add_special: bool | None = None  # llama.cpp (default false)
    return_token_strs: bool = False  # vLLM: the vocabulary's pieces (convert_ids_to_tokens), as vLLM returns
    with_pieces: bool = False  # llama.cpp


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (serving.unknown_fields)
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize", openapi_extra=openapi.body(TokenizeRequest))
async def tokenize(request: Request) -> dict:
    state = get_state(request)
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    tokenizer = state.tokenizer
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of prompt, content or messages", "prompt")
    if body.messages is not None:
        fields = {"messages": body.messages, "tools": body.tools, "chat_template_kwargs": body.chat_template_kwargs,
                  "continue_final_message": body.continue_final_message}
        if "add_generation_prompt" in body.model_fields_set:
            fields["add_generation_prompt"] = body.add_generation_prompt
        chat = ChatCompletionRequest.model_validate(fields)  # a bad message: a 400 naming it (app.py)
        check_generation_prompt(chat, chat.continue_final_message)
        if chat.continue_final_message and (not chat.messages or chat.messages[-1].role != "assistant"):
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        ids = state.engine.engine.tokenize(prepare_chat(tokenizer, chat).prompt)
    else:
        text = body.prompt if body.prompt is not None else body.content
        special = body.add_special_tokens if body.add_special_tokens is not None else (
            body.add_special if body.add_special is not None else body.prompt is not None)
        ids = tokenizer(text, add_special_tokens=special).input_ids
    tokens: list = [{"id": t, "piece": tokenizer.decode([t])} for t in ids] if body.with_pieces else ids  # text
    return {"count": len(ids), "max_model_len": state.engine.engine.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


@router.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
async def detokenize(request: Request) -> dict:
    state = get_state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    vocab = state.engine.engine.loaded.arch.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    text = state.tokenizer.decode(body.tokens)
    return {"prompt": text, "content": text}  # vLLM's key and llama.cpp's


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}
