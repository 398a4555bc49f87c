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
from kvflow.bench.stats import summarize

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


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # tokens: the server's usage figure when reported, else the intended length
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    start: float = 0.0  # seconds after the benchmark began
    cached_tokens: int | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


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


# --- summary --------------------------------------------------------------------------------------

def meets_slos(res: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO (in ms); TPOT is vacuous for one-token outputs."""
    if not res.success:
        return False
    values = {"ttft": res.ttft, "tpot": res.tpot or 0.0, "e2e": res.e2e}
    return all(values[k] * 1000 <= limit for k, limit in slos.items())


def summarize_results(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in ok], 1000),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": summarize([x for r in ok for x in r.itl], 1000),
        "e2e_ms": summarize([r.e2e for r in ok], 1000),
    }
    if slos:
        met = sum(meets_slos(r, slos) for r in results)
        summary.update({"slo_ms": dict(slos), "slo_met": met, "goodput": met / duration})
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def request_record(r: RequestResult) -> dict[str, Any]:
    return {
        "success": r.success,
        "error": r.error,
        "start_s": r.start,
        "prompt_len": r.prompt_len,
        "output_tokens": r.output_tokens,
        "cached_tokens": r.cached_tokens,
        "ttft_ms": r.ttft * 1000,
        "tpot_ms": None if r.tpot is None else r.tpot * 1000,
        "e2e_ms": r.e2e * 1000,
        "itl_ms": [x * 1000 for x in r.itl],
    }


def per_turn_report(per_conv: list[list[RequestResult]]) -> list[dict[str, Any]]:
    turns = []
    for i, row in enumerate(zip(*per_conv, strict=True)):
        ok = [r for r in row if r.success]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        turns.append({
            "turn": i + 1,
            "prompt_tokens": round(sum(r.prompt_len for r in ok) / len(ok)) if ok else None,
            "ttft_ms": summarize([r.ttft for r in ok], 1000)["mean"] if ok else None,
            "ttft_ms_each": [r.ttft * 1000 for r in ok],
            "cached_tokens": round(sum(cached) / len(cached)) if cached else None,
            "output_tokens": round(sum(r.output_tokens for r in ok) / len(ok)) if ok else None,
            "failed": len(row) - len(ok),
        })
    return turns


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


def format_summary(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        f"== kvflow bench serve: {doc['label']} ({doc['scenario']}) at {doc['base_url']} ==",
        f"{'successful requests':<28}{s['completed']:>12}",
        f"{'failed requests':<28}{s['failed']:>12}",
        f"{'duration (s)':<28}{s['duration_s']:>12.2f}",
        f"{'input tokens':<28}{s['total_input_tokens']:>12}",
        f"{'output tokens':<28}{s['total_output_tokens']:>12}",
        f"{'requests/s':<28}{s['request_throughput']:>12.2f}",
        f"{'output tokens/s':<28}{s['output_throughput']:>12.2f}",
        f"{'total tokens/s':<28}{s['total_token_throughput']:>12.2f}",
    ]
    if "goodput" in s:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in s["slo_ms"].items())
        lines.append(f"{'goodput (req/s, ' + slo + ')':<28}{s['goodput']:>12.2f}  ({s['slo_met']} met)")
    lines.append(f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{name}_ms"]
        cells = ("-" if m[k] is None else f"{m[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<8}" + "".join(f"{c:>10}" for c in cells))
    if doc.get("turns"):
        lines.append(f"{'turn':>5}{'prompt tok':>12}{'cached tok':>12}{'TTFT ms':>10}")
        for t in doc["turns"]:
            cached = "-" if t["cached_tokens"] is None else str(t["cached_tokens"])
            ttft = "-" if t["ttft_ms"] is None else f"{t['ttft_ms']:.1f}"
            lines.append(f"{t['turn']:>5}{t['prompt_tokens'] or '-':>12}{cached:>12}{ttft:>10}")
    for err in s.get("errors", []):
        lines.append(f"error: {err}")
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"bad SLO {item!r}: want ttft:MS, tpot:MS or e2e:MS")
        slos[key] = float(value)
    return slos
