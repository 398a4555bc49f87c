"""The opt-in per-step trace: one JSON line per step with prefill/decode tokens, batch size and KV usage."""

from __future__ import annotations

import json

from kvflow import LLM, SamplingParams
from kvflow.bench.plot import plot_results


def test_trace_records_every_step_and_plots(tmp_path, tiny_checkpoints):
    trace = tmp_path / "trace.jsonl"
    llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory=8 << 20, trace_file=str(trace),
              max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (30, 7)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == llm.engine.num_steps
    assert sum(r["prefill_tokens"] for r in records) == 37
    assert sum(r["decode_tokens"] for r in records) == 2 * 4  # the first token of each comes from prefill
    assert all(r["prefill_tokens"] + r["decode_tokens"] <= 16 for r in records)
    assert all(0.0 <= r["kv_usage"] <= 1.0 and r["batch_size"] >= 1 for r in records)
    written = plot_results([trace], tmp_path / "plots")
    assert any(p.name.startswith("trace_") and p.stat().st_size > 0 for p in written)

