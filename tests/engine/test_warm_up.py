"""The warm-up `kvflow serve` and `kvflow chat` run before the first request: a short request run and
forgotten, which leaves no trace in the cache, the statistics or the outputs."""

from __future__ import annotations

from kvflow import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (40, 9)]


def test_warm_up_leaves_no_trace(tiny_checkpoints):
    cold = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory=8 << 20, dtype="float32")
    warm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory=8 << 20, dtype="float32")
    engine = warm.engine
    manager = engine.scheduler.kv_cache_manager
    engine.warm_up()
    assert engine.num_steps == 0 and engine.step_history.since(0) == [] and not engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0
    assert manager.queried_tokens == 0 and manager.hit_tokens == 0
    outputs = [o.outputs[0].token_ids for o in warm.generate(PROMPTS, PARAMS)]
    assert outputs == [o.outputs[0].token_ids for o in cold.generate(PROMPTS, PARAMS)]
    assert engine.num_steps == len(engine.step_history.since(0)) > 0
