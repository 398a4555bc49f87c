"""Running one engine at several tensor-parallel sizes and comparing what their steps computed."""

from __future__ import annotations

import torch

from kvflow import LLM, SamplingParams

REL_TOL = 1e-5  # float32 logits of a split model against the whole one (sums in another order)


def run_capturing_logits(model: str | None, tp: int, prompts: list, params: SamplingParams, **options):
    """Greedy outputs and every step's float32 logits (rank 0's), with the model split over tp ranks."""
    steps: list[torch.Tensor] = []
    device = {} if "loaded_model" in options else {"device": "cpu"}  # a model already loaded has its own
    # Step by step: the same steps in both runs, which speculation (its drafts follow measured step times)
    # would not give.
    options.setdefault("speculative_config", "off")
    with LLM(model, tensor_parallel_size=tp, threads=1, **device, **options) as llm:
        execute = llm.engine.runner.execute

        def spy(scheduler_output):
            out = execute(scheduler_output)
            steps.append(out.logits.clone())
            return out

        llm.engine.runner.execute = spy
        outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], steps


def worst_relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) and a, "the two runs took different steps"
    return max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(a, b))
