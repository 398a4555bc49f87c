"""The request path stays short: a plain chat request to the real server runs code in at most 23 of
kvflow's Python files, none of them in loader/ or models/ (the fast CPU path runs the native decoder), and
none of the tool-calling, reasoning or structured-output code it does not use. Each is there for one part
of the request:
- the server's nine: the ASGI middleware, the route, reading and checking the body, the fields it ignores
  or maps from vLLM's, the chat prompt, fitting max_tokens to the context, the metrics;
- sampling_params.py: what the request asks for, checked when built;
- the engine's eleven: async_engine.py, the asynchronous front (the step thread, one stream per request);
  intake.py, the prompt checked and the request's sequences made; engine.py, the step loop and its record
  of each step; request.py, a request's tokens and progress and its share of a step; scheduler.py, which
  tokens each step computes; step_budget.py, how much prompt a step may carry beside decoders;
  kv_cache_manager.py, the block tables and the prefix cache; block_pool.py, the blocks themselves;
  speculation.py, the drafts speculation (on by default on a CPU) verifies, from the prompt-lookup source;
  runner.py, a step's flat batch; detokenizer.py, the text and the stop strings;
- executors/cpu_fast.py runs the forward (the native decoder); layers/sampler.py picks the tokens.
Plain data the path builds but runs no code of (engine/stats.py's EngineStats, kvflow/outputs.py) does not
count."""

from __future__ import annotations

import pytest

from kvflow.bench.request_path import trace_chat_request
from kvflow.kernels import packed_matmul

MAX_FILES = 23  # issue 53's goal is 16: the rest waits on the server's one chat pipeline (README, "Layout")


# Without a C++ compiler the PyTorch layers carry the step (models/, layers/): a longer path by design.
@pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler for the native decoder")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_request_crosses_at_most_max_files(stream):
    files = trace_chat_request(None, stream)
    assert "kvflow/server/openai_api.py" in files and "kvflow/executors/cpu_fast.py" in files  # it saw the path
    assert len(files) <= MAX_FILES, files
    assert not [f for f in files if f.startswith(("kvflow/loader/", "kvflow/models/"))], files
