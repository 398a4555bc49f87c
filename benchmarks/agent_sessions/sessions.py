"""Captured agent sessions (benchmarks/agent_sessions/<client>.json, written by capture.py) and what replaying
them needs: the session's chain of requests, each made into a streamed replay request, and a streamed
answer read for its first token and for what the server says it prefilled.

A session's chain is its first request and the follow-ups that carry it (same system prompt and tools, the
conversation grown by the answer and a tool result or a user message); a client's other requests (a title,
a memory extraction) are "side" requests, kept in the capture and left out of the replay.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLIENT_API = {"codex": "responses", "claude": "messages", "qwen": "chat", "openclaw": "chat"}
TURN_1 = "Read the file notes.txt with your tool and say what it holds."
TURN_2 = "Thank you. Now explain in two sentences what that marker could be used for."
ANSWER = "notes.txt holds one line: kvflow-marker-7311."
API_PATH = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text") if isinstance(part, dict) else part) for part in content)
    return ""


def system_text(body: dict, api: str) -> str:
    if api == "chat":
        return "".join(_text(m.get("content")) for m in body.get("messages") or []
                       if m.get("role") in ("system", "developer"))
    if api == "responses":  # Codex sends its instructions as developer messages at the input's start
        return _text(body.get("instructions")) + "".join(_text(m.get("content")) for m in _system_items(body))
    return _text(body.get("system"))


def _system_items(body: dict) -> list[dict]:
    given = body.get("input")
    return [i for i in given if isinstance(i, dict) and i.get("role") in ("system", "developer")] \
        if isinstance(given, list) else []


def tool_names(body: dict, api: str) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        if api == "chat":
            names.append((tool.get("function") or {}).get("name") or tool.get("type"))
        elif tool.get("type") == "namespace":
            names += [t.get("name") for t in tool.get("tools") or []]
        else:
            names.append(tool.get("name") or tool.get("type"))
    return [str(n) for n in names]


def conversation(body: dict, api: str) -> list:
    if api == "responses":
        given = body.get("input")
        return [i for i in given if i not in _system_items(body)] if isinstance(given, list) else [given]
    return [m for m in body.get("messages") or [] if m.get("role") not in ("system", "developer")]


def _is_answer(item, api: str) -> bool:
    if not isinstance(item, dict):
        return False
    if api == "responses":
        return item.get("role") == "assistant" or str(item.get("type", "")).endswith("_call") or \
            item.get("type") == "reasoning"
    return item.get("role") == "assistant"


def _is_tool_result(item, api: str) -> bool:
    if not isinstance(item, dict):
        return False
    if api == "chat":
        return item.get("role") == "tool"
    if api == "responses":
        return str(item.get("type", "")).endswith("_call_output")
    content = item.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def last_kind(body: dict, api: str) -> str:
    """What the request adds after the last answer: "tool result" when it sends one back (OpenClaw follows it
    with a context message of its own), else "user"."""
    items = conversation(body, api)
    answers = [i for i, item in enumerate(items) if _is_answer(item, api)]
    tail = items[answers[-1] + 1:] if answers else items
    return "tool result" if any(_is_tool_result(item, api) for item in tail) else "user"


def chain_kinds(bodies: list[dict], api: str) -> list[str]:
    """Each request's kind: "first", "tool result" or "user" on the session's chain (the requests with the
    system prompt and tools most of them share, the earliest such on a tie), "side" off it."""
    keys = [json.dumps([system_text(body, api), tool_names(body, api)]) for body in bodies]
    if not keys:
        return []
    key = max(keys, key=lambda k: (keys.count(k), -keys.index(k)))
    kinds, seen = [], False
    for body, own in zip(bodies, keys, strict=True):
        if own != key:
            kinds.append("side")
        else:
            kinds.append(last_kind(body, api) if seen else "first")
            seen = True
    return kinds


def load(client: str, folder: Path = HERE) -> dict:
    return json.loads((folder / f"{client}.json").read_text())


def chain(session: dict) -> list[dict]:
    """The session's requests on its chain, in order (each {"turn", "kind", "body"}); a session captured with
    one turn only gets a second, synthesized as the clients make theirs (kind "user (synthesized)")."""
    found = [r for r in session["requests"] if r["kind"] != "side"]
    if found and found[-1]["turn"] == 1:
        found.append({"turn": 2, "kind": "user (synthesized)", "body": follow_up(found[-1]["body"], session["api"])})
    return found


def follow_up(body: dict, api: str, answer: str = ANSWER, question: str = TURN_2) -> dict:
    """The body with the model's answer and the user's next message appended, in the API's shapes."""
    out = copy.deepcopy(body)
    if api == "chat":
        out["messages"] += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    elif api == "messages":
        out["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": answer}]},
                            {"role": "user", "content": [{"type": "text", "text": question}]}]
    else:
        given = out["input"] if isinstance(out.get("input"), list) else [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": out.get("input") or ""}]}]
        out["input"] = [*given, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]},
                        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]}]
    return out


def _prefix_text(holder: dict, key: str, prefix: str) -> bool:
    value = holder.get(key)
    if isinstance(value, str):
        holder[key] = prefix + value
        return True
    if isinstance(value, list):
        for part in value:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = prefix + part["text"]
                return True
    return False


def replay_body(body: dict, api: str, model: str, max_tokens: int, nonce: str = "") -> dict:
    """The captured body as a replay sends it: to `model`, streamed, at most max_tokens of answer, and the
    nonce (when given) at the start of the system prompt, so that no earlier replay's cache serves it."""
    out = copy.deepcopy(body)
    out["model"], out["stream"] = model, True
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        out.pop(name, None)
    out[{"chat": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}[api]] = max_tokens
    if api == "chat":
        out["stream_options"] = {"include_usage": True}
    if nonce:
        if api == "responses":
            placed = _prefix_text(out, "instructions", nonce) or any(
                _prefix_text(m, "content", nonce) for m in _system_items(out))
        elif api == "messages":
            placed = _prefix_text(out, "system", nonce)
        else:
            placed = any(_prefix_text(m, "content", nonce) for m in out["messages"]
                         if m.get("role") in ("system", "developer"))
        if not placed:
            raise ValueError("the request has no system prompt to mark")
    return out


def is_first_token(event: dict) -> bool:
    """Whether a streamed event carries answer text or a tool call (in any of the three APIs)."""
    kind = str(event.get("type", ""))
    if kind.endswith(".delta") and event.get("delta"):  # Responses
        return True
    if kind == "content_block_delta":  # Messages
        return True
    if kind == "content_block_start":
        return (event.get("content_block") or {}).get("type") in ("tool_use", "server_tool_use")
    for choice in event.get("choices") or []:  # chat completions (and completions: "text")
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") or choice.get("text"):
            return True
    return False


def prefill_counts(events: list[dict]) -> tuple[int | None, int | None]:
    """(prompt tokens, of those served from cache): llama-server's `timings` (prompt_n new + cache_n reused)
    when present, else the usage in whichever API's shape (kvflow's cached_tokens, Anthropic's
    cache_read_input_tokens)."""
    usage: dict = {}
    timings: dict = {}
    for event in events:
        for holder in (event, event.get("response") or {}, event.get("message") or {}):
            if isinstance(holder, dict):
                if isinstance(holder.get("usage"), dict):
                    usage.update({k: v for k, v in holder["usage"].items() if v is not None})
                if isinstance(holder.get("timings"), dict):
                    timings.update(holder["timings"])
    if "prompt_n" in timings:
        cached = int(timings.get("cache_n") or 0)
        return int(timings["prompt_n"]) + cached, cached
    if "prompt_tokens" in usage:
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens excludes the cached ones
        cached = usage["cache_read_input_tokens"] or 0
        return usage.get("input_tokens", 0) + cached, cached
    if "input_tokens" in usage:
        return usage["input_tokens"], (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return None, None
