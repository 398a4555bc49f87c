"""The request path stays short: a plain chat request to the real server runs code in at most 22 of
kvflow's Python files, none of them in loader/ or models/ (the fast CPU path runs the native decoder), and
none of the tool-calling, reasoning, structured-output or vLLM-extension code it does not use. Five are the
server's, one per step of its chat pipeline:

    server/serving.py        the middleware every request passes (its id), the server's state, the body read
                             within its size limit and checked for fields kvflow ignores
    server/openai_api.py     the OpenAI adapter: the route, and the pipeline's events written as a
                             chat.completion or its SSE chunks, with usage
    server/protocol.py       its request model, which is also the internal chat request: checked and turned
                             into the sampling parameters
    server/chat_pipeline.py  the chat pipeline: the chat template's prompt, fitting max_tokens to the context,
                             submitting to the engine, following its outputs as events
    server/metrics.py        what is recorded of the finished request (Prometheus, the log line, timings)

Then the sampling parameters; thirteen of the engine, from its asynchronous front and intake through the
scheduler, the runner and its stats; the n-gram draft source of the speculation that is on by default on a
CPU; the fast executor and the sampler."""

from __future__ import annotations

import pytest

from kvflow.bench.request_path import trace_chat_request
from kvflow.kernels import packed_matmul

MAX_FILES = 22  # issue 53's goal is 16: the server's share is down to five; the rest is the engine's


# Without a C++ compiler the PyTorch layers carry the step (models/, layers/): a longer path by design.
@pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler for the native decoder")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_request_crosses_at_most_max_files(stream):
    files = trace_chat_request(None, stream)
    assert "kvflow/server/openai_api.py" in files and "kvflow/executors/cpu_fast.py" in files  # it saw the path
    assert len(files) <= MAX_FILES, files
    assert not [f for f in files if f.startswith(("kvflow/loader/", "kvflow/models/"))], files
