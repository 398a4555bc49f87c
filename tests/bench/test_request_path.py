"""The request path stays short: a plain chat request to the real server runs code in at most 19 of
kvflow's Python files, none of them in loader/ or models/ (the fast CPU path runs the native decoder), and
none of the tool-calling, reasoning, structured-output or vLLM-extension code it does not use. Each is
there for one part of the request. Five are the server's, one per step of its chat pipeline:

    server/serving.py        the middleware every request passes (its id), the server's state, the body read
                             within its size limit and checked for fields kvflow ignores
    server/openai_api.py     the OpenAI adapter: the route, and the pipeline's events written as a
                             chat.completion or its SSE chunks, with usage
    server/protocol.py       its request model, which is also the internal chat request: checked and turned
                             into the sampling parameters
    server/chat_pipeline.py  the chat pipeline: the chat template's prompt, fitting max_tokens to the context,
                             submitting to the engine, following its outputs as events
    server/metrics.py        what is recorded of the finished request (Prometheus, the log line, timings)

Then sampling_params.py, what the request asks for, checked when built; the engine's eleven:
async_engine.py, the asynchronous front (the step thread, one stream per request); intake.py, the prompt
checked and the request's sequences made; engine.py, the step loop and its record of each step;
request.py, a request's tokens and progress and its share of a step; scheduler.py, which tokens each step
computes; step_budget.py, how much prompt a step may carry beside decoders; kv_cache_manager.py, the block
tables and the prefix cache; block_pool.py, the blocks themselves; speculation.py, the drafts speculation
(on by default on a CPU) verifies, from the prompt-lookup source; runner.py, a step's flat batch;
detokenizer.py, the text and the stop strings; and executors/cpu_fast.py runs the forward (the native
decoder), layers/sampler.py picks the tokens. Plain data the path builds but runs no code of
(engine/stats.py's EngineStats, kvflow/outputs.py) does not count."""

from __future__ import annotations

import pytest

from kvflow.bench.request_path import trace_chat_request
from kvflow.kernels import packed_matmul

MAX_FILES = 19  # issue 53's goal is 16: merging any two of the engine's files would pass 400 lines (README, "Layout")


# Without a C++ compiler the PyTorch layers carry the step (models/, layers/): a longer path by design.
@pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler for the native decoder")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_request_crosses_at_most_max_files(stream):
    files = trace_chat_request(None, stream)
    assert "kvflow/server/openai_api.py" in files and "kvflow/executors/cpu_fast.py" in files  # it saw the path
    assert len(files) <= MAX_FILES, files
    assert not [f for f in files if f.startswith(("kvflow/loader/", "kvflow/models/"))], files
