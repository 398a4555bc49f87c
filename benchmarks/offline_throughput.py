"""Offline throughput: kvflow's LLM.generate against transformers' generate on the same prompts and weights.

64 prompts of 100 to 1000 tokens, 128 output tokens each (EOS ignored), greedy. kvflow gets every prompt
at once (continuous batching); transformers gets them in padded batches. Prints output tokens/s for both
and the ratio, and adds a section to the day's file of benchmarks/history/ with --record (results_file.py).

    python benchmarks/offline_throughput.py [--num-prompts 64] [--hf-batch-size 16] [--record]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from results_file import publish

from kvflow import LLM, SamplingParams
from kvflow.loader.resolve import resolve_model


def make_prompts(tokenizer, n: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    text = Path(__file__).read_text() * 40  # plenty of real-looking tokens to cut prompts from
    ids = tokenizer(text).input_ids
    prompts = []
    for _ in range(n):
        length = int(torch.randint(low, high + 1, (1,), generator=g))
        start = int(torch.randint(0, len(ids) - length, (1,), generator=g))
        prompts.append(ids[start : start + length])
    return prompts


def run_kvflow(prompts: list[list[int]], output_len: int, threads: int | None) -> tuple[float, int]:
    llm = LLM(threads=threads, max_num_seqs=len(prompts), max_num_batched_tokens=2048,
              speculative_config="off")  # as transformers: no drafts
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:32]}, SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(prompts: list[list[int]], output_len: int, batch_size: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    gguf = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 2
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    tokens = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = [prompts[i] for i in order[b : b + batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        tokens += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--record", action="store_true", help="add the result to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvflow.loader.gguf_tokenizer import load_gguf_tokenizer_from_path

    prompts = make_prompts(load_gguf_tokenizer_from_path(resolve_model(None).path), args.num_prompts,
                           args.min_len, args.max_len, seed=0)
    k_time, k_tokens = run_kvflow(prompts, args.output_len, args.threads)
    h_time, h_tokens = run_transformers(prompts, args.output_len, args.hf_batch_size,
                                        getattr(torch, args.hf_dtype))
    k_rate, h_rate = k_tokens / k_time, h_tokens / h_time
    from kvflow.kernels import cpu_features

    prompt_tokens = sum(len(p) for p in prompts)
    lines = [
        f"### Offline throughput ({time.strftime('%Y-%m-%d %H:%M')}, {torch.get_num_threads()} threads)",
        "",
        f"`python benchmarks/offline_throughput.py --num-prompts {args.num_prompts} --output-len {args.output_len} "
        f"--hf-batch-size {args.hf_batch_size} --hf-dtype {args.hf_dtype}`: {args.num_prompts} prompts "
        f"({prompt_tokens} prompt tokens, {args.min_len} to {args.max_len} each), {args.output_len} output "
        f"tokens each, greedy, EOS ignored, default model. CPU {cpu_features.cpu_name()}.",
        "",
        "| engine | output tokens | seconds | output tokens/s |",
        "|---|---|---|---|",
        f"| kvflow (fast mode, kernel tier {cpu_features.isa_tier()}; all prompts at once) | {k_tokens} | "
        f"{k_time:.1f} | {k_rate:.1f} |",
        f"| transformers generate ({args.hf_dtype}, batches of {args.hf_batch_size}) | {h_tokens} | "
        f"{h_time:.1f} | {h_rate:.1f} |",
        "",
        f"Ratio kvflow / transformers: **{k_rate / h_rate:.2f}x**",
        "",
    ]
    publish("\n".join(lines), args.record)


if __name__ == "__main__":
    main()
