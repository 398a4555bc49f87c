"""The GPU check's transformers step: the same shapes as kvflow's, through transformers, on random weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from gpu_common import bench_setup, kv_plan, models_within_budget, plan, rows_within_budget, timed

from kvflow.loader.model_loader import default_dtype


# ---- transformers ----------------------------------------------------------------------------------------
def random_hf_model(cfg: dict, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    with default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(config)
    return model.eval()


def filled_cache(cfg: dict, batch: int, depth: int, dtype: torch.dtype, device: torch.device):
    """A transformers DynamicCache already holding `depth` tokens (zeros) per layer, or None at depth 0."""
    if depth == 0:
        return None
    from transformers import DynamicCache

    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    cache = DynamicCache()
    for layer in range(cfg["num_hidden_layers"]):
        kv = torch.zeros(batch, cfg["num_key_value_heads"], depth, head_dim, dtype=dtype, device=device)
        cache.update(kv, kv.clone(), layer)
    return cache


def cache_arg(model) -> str:
    """transformers 5.2x names the KV-cache argument and output `cache`; earlier releases `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_prefill(model, cfg, n: int, depth: int, dtype, device) -> Callable[[], object]:
    ids = torch.randint(0, cfg["vocab_size"], (1, n), device=device)

    def run():
        cache = filled_cache(cfg, 1, depth, dtype, device)
        kwargs = {cache_arg(model): cache, "use_cache": depth > 0}
        try:
            return model(input_ids=ids, logits_to_keep=1, **kwargs)  # last token's logits, as kvflow
        except TypeError:  # transformers without logits_to_keep
            return model(input_ids=ids, **kwargs)

    return run


def hf_generate(model, cfg, batch: int, depth: int, n: int, dtype, device) -> Callable[[], object]:
    ids = torch.randint(0, cfg["vocab_size"], (batch, depth + 1), device=device)

    def run():
        cache = filled_cache(cfg, batch, depth, dtype, device)
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0, **{cache_arg(model): cache},
        )

    return run


def bench_transformers(out: Path, budget: float, tiny: bool) -> None:
    device, dtype, deadline, emit, s = bench_setup(out, budget, tiny, "bench_transformers")
    for name, cfg, model_deadline in models_within_budget(s, deadline, emit, "transformers"):
        model = random_hf_model(cfg, dtype, device)
        rows = plan(s)
        fits, _ = kv_plan(rows, cfg, device)
        for key, test, batch, depth, n in rows_within_budget(rows, fits, model_deadline, emit, "transformers", name):
            try:
                with torch.inference_mode():
                    if test.startswith("pp"):
                        seconds = timed(hf_prefill(model, cfg, n, depth, dtype, device), device, reps=3)
                        emit(**key, mode="forward", tokens_per_s=n / seconds, seconds=seconds)
                    else:
                        seconds = timed(hf_generate(model, cfg, batch, depth, n, dtype, device), device, reps=1,
                                        warm=hf_generate(model, cfg, batch, depth, 2, dtype, device))
                        emit(**key, mode="generate", tokens_per_s=batch * n / seconds, seconds=seconds)
            except Exception as exc:  # one shape failing (memory, API drift) must not stop the others
                emit(**key, skipped=f"{type(exc).__name__}: {str(exc)[:200]}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
