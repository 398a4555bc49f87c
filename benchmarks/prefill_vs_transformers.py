"""pp512 of kvflow (default fast mode) against transformers in bf16 and float32 on the same GGUF weights.

Both run the same 512 random tokens through one forward pass, same thread count, in one process, taking
turns pass by pass, and report the median of the repetitions. kvflow's pass goes through its engine (one
request, max_tokens=1, prefix caching off): the prefill a user gets, with its KV cache, attention backend
and many-row path.

    python benchmarks/prefill_vs_transformers.py [--threads 2] [--tokens 512] [--reps 5] [--record]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_quant_linear import time_round_robin
from results_file import publish, table_section

from kvflow.kernels import cpu_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from kvflow import LLM, SamplingParams

    llm = LLM(max_model_len=args.tokens + 16, threads=args.threads, enable_prefix_caching=False)
    gguf = llm.engine.loaded.resolved.path
    ids = torch.randint(100, 20000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    one_token = SamplingParams(temperature=0, max_tokens=1)

    def kvflow_pass() -> None:
        llm.generate([{"prompt_token_ids": ids.tolist()}], one_token)

    passes = {f"kvflow (default fast mode: packed Q4_1, kernel tier {cpu_features.isa_tier()})": kvflow_pass}
    for dtype in (torch.bfloat16, torch.float32):
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()

        def hf_pass(model=hf) -> None:
            with torch.inference_mode():
                model(ids[None], logits_to_keep=1)

        passes[f"transformers ({str(dtype).split('.')[-1]})"] = hf_pass
    # Round-robin, one pass of each engine in turn: a host whose speed drifts shifts all of them alike.
    rows = time_round_robin(passes, args.reps).items()
    base = {name: args.tokens / (micros * 1e-6) for name, micros in rows}
    hf_bf16 = base["transformers (bfloat16)"]
    publish(table_section(
        f"pp{args.tokens} against transformers ({time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads, "
        f"CPU {cpu_features.cpu_name()}, kernel tier {cpu_features.isa_tier()})",
        f"`python benchmarks/prefill_vs_transformers.py --threads {args.threads}`, file {gguf.name}, one forward "
        f"pass of {args.tokens} tokens, median of {args.reps}.",
        ["engine", "tokens/s", "/ transformers bf16"],
        [f"| {name} | {tps:,.0f} | {tps / hf_bf16:.2f} |" for name, tps in base.items()]), args.record)


if __name__ == "__main__":
    main()
