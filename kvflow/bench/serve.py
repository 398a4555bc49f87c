"""Serving benchmark: a load generator that speaks plain OpenAI HTTP with streaming, so it can measure
kvflow and other servers (llama.cpp, vLLM) alike.

Per request it records TTFT (first non-empty text), every inter-token latency, end-to-end latency and
the output token count; the summary gives mean/p50/p90/p99 of TTFT, TPOT, ITL and E2E, throughput, and
goodput (requests per second meeting every SLO).  ``scenario="agent"`` replays growing conversations
and reports TTFT and server-reported cached tokens per turn.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvflow.bench.serve_dataset import (
    AgentConversation,
    PromptMaker,
    RequestSpec,
    make_agent_conversation,
    make_requests,
)
from kvflow.bench.serve_report import RequestResult, per_turn_report, request_record, summarize_results

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ServeConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    concurrency: int | None = None  # clients in flight; with request_rate, a cap
    request_rate: float | None = None  # Poisson arrivals per second
    num_prompts: int = 64
    input_len: int | tuple[int, int] = 200
    output_len: int | tuple[int, int] = 128
    shared_prefix_len: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms: ttft, tpot, e2e
    seed: int = 0
    tokenizer: str | None = None
    scenario: str = "random"  # or "agent"
    turns: int = 40
    system_len: int = 4000
    user_len: int = 300
    label: str | None = None
    timeout_s: float = 600.0
    progress: bool = True


# --- one streaming request ------------------------------------------------------------------------

def build_payload(endpoint: str, model: str, prompt: str | list[dict[str, str]], max_tokens: int) -> dict:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # not OpenAI's, but vLLM/llama.cpp/kvflow honour it: fixed output lengths
        # llama-cpp-python's server ignores ignore_eos but honours min_tokens (as vLLM and kvflow do).
        "min_tokens": max_tokens,
    }
    if endpoint == "chat":
        payload["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


def _chunk_text(obj: dict, endpoint: str) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def split_gaps(gaps: list[float], chunk_tokens: list[int | None], total_tokens: int) -> list[float]:
    """Inter-token latencies from gaps between chunks.  A chunk carrying n tokens contributes n
    latencies of gap/n.  Per-chunk counts come from per-chunk usage when the server sends it;
    otherwise the tokens beyond one per chunk are spread evenly over the gaps."""
    if not gaps:
        return []
    known = chunk_tokens[1:]
    if all(n is not None for n in known):
        counts = [max(int(n), 1) for n in known]  # type: ignore[arg-type]
    elif total_tokens > len(gaps) + 1:
        per_gap = (total_tokens - 1) / len(gaps)
        counts = [round((i + 1) * per_gap) - round(i * per_gap) for i in range(len(gaps))]
    else:
        counts = [1] * len(gaps)
    itl = []
    for gap, n in zip(gaps, counts, strict=True):
        itl.extend([gap / max(n, 1)] * max(n, 1))
    return itl


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict,
    endpoint: str,
    prompt_len: int,
    t0: float,
) -> RequestResult:
    """Send one streaming request and time its chunks."""
    res = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    res.start = start - t0
    chunk_times: list[float] = []
    chunk_tokens: list[int | None] = []  # tokens in each chunk when per-chunk usage reveals it
    texts: list[str] = []
    usage: dict | None = None
    last_completion_tokens = 0
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"])[:300]
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                text = _chunk_text(obj, endpoint)
                if not text:
                    continue
                n_in_chunk = None
                if obj.get("usage") and obj["usage"].get("completion_tokens") is not None:
                    n_in_chunk = obj["usage"]["completion_tokens"] - last_completion_tokens
                    last_completion_tokens = obj["usage"]["completion_tokens"]
                chunk_times.append(now)
                chunk_tokens.append(n_in_chunk)
                texts.append(text)
            end = time.perf_counter()  # the stream's end, before closing the connection
    except Exception as exc:  # a benchmark reports failures instead of dying on them
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not chunk_times:
        res.error = "no output text"
        return res
    res.success = True
    res.text = "".join(texts)
    res.ttft = chunk_times[0] - start
    res.e2e = end - start
    res.output_tokens = len(chunk_times)
    if usage:
        res.output_tokens = usage.get("completion_tokens") or res.output_tokens
        res.prompt_len = usage.get("prompt_tokens") or res.prompt_len
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")
        timings = usage.get("kvflow_timings") or {}
        res.draft_tokens = timings.get("spec_draft_tokens")
        res.accepted_tokens = timings.get("spec_accepted_tokens")
    gaps = [b - a for a, b in itertools.pairwise(chunk_times)]
    res.itl = split_gaps(gaps, chunk_tokens, res.output_tokens)
    return res


# --- load generation ------------------------------------------------------------------------------

class Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.done = 0
        self.t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        filled = int(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:6.1f}s")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _limit(concurrency: int | None) -> asyncio.Semaphore | None:
    return asyncio.Semaphore(concurrency) if concurrency else None


async def _guarded(sem: asyncio.Semaphore | None, coro_fn, *args):
    if sem is None:
        return await coro_fn(*args)
    async with sem:
        return await coro_fn(*args)


def arrival_gaps(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals (exponential gaps) at ``rate`` per
    second, the first at once; all zeros when rate is None or infinite."""
    if not rate or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


async def run_requests(
    cfg: ServeConfig, model: str, specs: list[RequestSpec]
) -> tuple[list[RequestResult], float]:
    """Send ``specs`` at fixed concurrency or Poisson arrivals; return results and the wall time."""
    url = cfg.base_url + ENDPOINTS[cfg.endpoint]
    concurrency = cfg.concurrency if (cfg.concurrency or cfg.request_rate) else 1
    sem = _limit(concurrency)
    progress = Progress(len(specs), cfg.progress)
    limits = httpx.Limits(max_connections=concurrency or len(specs), max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            payload = build_payload(cfg.endpoint, model, spec.prompt, spec.output_len)
            res = await _guarded(sem, stream_request, client, url, payload, cfg.endpoint, spec.prompt_len, t0)
            progress.update()
            return res

        tasks = []
        arrivals = itertools.accumulate(arrival_gaps(len(specs), cfg.request_rate, cfg.seed))
        for spec, arrival in zip(specs, arrivals, strict=True):
            # Sleep to an absolute schedule so that oversleeping does not accumulate.
            delay = t0 + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return results, duration


async def run_agent(
    cfg: ServeConfig, model: str, conversations: list[AgentConversation], output_len: int
) -> tuple[list[list[RequestResult]], float]:
    """Each conversation plays its turns in order (the answer goes back into the context);
    the conversations run side by side."""
    url = cfg.base_url + ENDPOINTS[cfg.endpoint]
    progress = Progress(len(conversations) * cfg.turns, cfg.progress)
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        t0 = time.perf_counter()

        async def play(conv: AgentConversation) -> list[RequestResult]:
            out = []
            for turn in range(cfg.turns):
                conv.add_user(turn)
                prompt = conv.messages if cfg.endpoint == "chat" else conv.as_prompt()
                est = sum(len(m["content"].split()) for m in conv.messages)
                payload = build_payload(cfg.endpoint, model, prompt, output_len)
                res = await stream_request(client, url, payload, cfg.endpoint, est, t0)
                out.append(res)
                progress.update()
                conv.add_answer(res.text)
            return out

        results = list(await asyncio.gather(*(play(c) for c in conversations)))
        duration = time.perf_counter() - t0
    return results, duration


# --- entry points ---------------------------------------------------------------------------------

def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def discover_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model the server lists, or "default" when it lists none."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.get(base_url + "/v1/models")
            data = resp.json().get("data") or []
            if data:
                return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return "default"


async def benchmark_serving(cfg: ServeConfig) -> dict[str, Any]:
    """Run the configured benchmark and return the result document (see ``kvflow.bench.plot``)."""
    cfg.base_url = normalize_base_url(cfg.base_url)
    model = cfg.model or await discover_model(cfg.base_url)
    maker = PromptMaker(cfg.seed, cfg.tokenizer, cfg.shared_prefix_len)
    doc: dict[str, Any] = {
        "kind": "serve",
        "label": cfg.label or model,
        "base_url": cfg.base_url,
        "model": model,
        "scenario": cfg.scenario,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: v for k, v in asdict(cfg).items() if k != "progress"},
    }
    if cfg.scenario == "agent":
        n_conv = cfg.concurrency or 1
        out_len = cfg.output_len if isinstance(cfg.output_len, int) else cfg.output_len[0]
        convs = [
            make_agent_conversation(maker, cfg.system_len, cfg.user_len, cfg.turns, cfg.seed + i)
            for i in range(n_conv)
        ]
        per_conv, duration = await run_agent(cfg, model, convs, out_len)
        results = [r for conv in per_conv for r in conv]
        doc["turns"] = per_turn_report(per_conv)
    elif cfg.scenario == "random":
        specs = make_requests(cfg.num_prompts, cfg.input_len, cfg.output_len, maker)
        results, duration = await run_requests(cfg, model, specs)
    else:
        raise ValueError(f"unknown scenario {cfg.scenario!r}")
    doc["summary"] = summarize_results(results, duration, cfg.goodput)
    doc["requests"] = [request_record(r) for r in results]
    return doc


def run_serve(cfg: ServeConfig, out: str | Path | None = None) -> dict[str, Any]:
    """Synchronous wrapper: run, optionally save JSON to ``out``, and return the document."""
    doc = asyncio.run(benchmark_serving(cfg))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc
