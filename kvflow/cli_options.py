"""Engine flags shared by every command that runs a model (generate, chat, serve, bench latency)."""

from __future__ import annotations

import argparse
import re

from kvflow.config import CacheConfig, ModelConfig, SchedulerConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes."""
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        try:
            return int(float(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 2GiB or 512MiB)") from None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_engine_options(p: argparse.ArgumentParser) -> None:
    m, c, s = ModelConfig(), CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None, help="path, .gguf file, alias or hub id (default: smollm2-135m)")
    g.add_argument("--mode", default=m.mode, choices=["auto", "fast", "exact"],
                   help="fast: packed weights, float16 cache, one C++ call a step on CPU; exact (CPU): float32, "
                        "outputs independent of batching; auto: exact with --dtype float32, else fast")
    g.add_argument("--dtype", default=m.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=m.device, help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--rope-scaling", type=_rope_scaling, default=None, metavar="TYPE:FACTOR[:ORIG]|JSON",
                   help="rotary scaling in place of the model's own, to run past its trained context: yarn or "
                        "linear, e.g. yarn:4:32768 (factor 4 over an original 32768 tokens; the original "
                        "defaults to the model's) or vLLM's '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}'; the context grows to match; auto: YaRN just "
                        "far enough for --max-model-len where that passes the model's trained context")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV cache budget, e.g. 2GiB")
    g.add_argument("--kv-cache-dtype", default=c.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="int8 (CPU): 8-bit K/V with a scale per token and head, about half the bytes of 16-bit")
    g.add_argument("--block-size", type=int, default=c.block_size)
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    g.add_argument("--long-prefill-token-threshold", type=int, default=s.long_prefill_token_threshold)
    g.add_argument("--max-decode-slowdown", type=float, default=s.max_decode_slowdown, metavar="X",
                   help="while others decode, prompts are prefilled so their tokens come on average at most X "
                        "times slower (step costs learned as the engine runs); 0: the token budget alone")
    g.add_argument("--max-step-ms", type=float, default=s.max_step_ms, metavar="MS",
                   help="...and a step with prompt rows beside decoders takes at most MS milliseconds (or X times "
                        "their decode step, if more)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep full KV blocks on disk too: a prefix evicted from memory, or cached before a restart, "
                        "is read back instead of recomputed")
    g.add_argument("--prefix-cache-disk", type=parse_bytes, default=None, metavar="SIZE",
                   help="bound of --prefix-cache-dir, e.g. 20GiB (default: 16GiB or half the free space)")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--scheduling-policy", default=s.scheduling_policy, choices=["lpm", "fcfs"],
                   help="which waiting request goes next: lpm, the one with the longest cached prefix (a few "
                        "passes at most ahead of older ones), or fcfs, arrival order")
    g.add_argument("--quantization", default=None, choices=["none", "gguf", "int8", "int4"],
                   help="CPU weight-only: gguf keeps a GGUF's Q4_x/Q5_x/Q8_0/K-quant/IQ4 weights packed (the default for GGUF files "
                        "with --dtype auto on CPU); none: float weights; int8/int4 quantize a float checkpoint")
    g.add_argument("--packed-cache", default=m.packed_cache, metavar="auto|off|DIR",
                   help="where a GGUF model's packed weights are kept after its first load, so later loads map "
                        "them instead of packing again (auto: ~/.cache/kvflow/packed, bounded by 32GiB or half "
                        "the free space; $KVFLOW_PACKED_CACHE sets the default)")
    g.add_argument("--compile", default=m.compile, choices=["auto", "on", "off"],
                   help="torch.compile the model (auto: on CPU with --dtype auto; first start about a minute, "
                        "then cached)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=m.tensor_parallel_size, metavar="N",
                   help="split the model across N ranks by attention heads (gloo on CPU, NCCL on CUDA); kvflow "
                        "starts them on this machine, or uses the ranks torchrun gives it (threads are per rank)")
    g.add_argument("--seed", type=int, default=m.seed)
    g.add_argument("--trace", default=None, metavar="FILE", help="append a JSON line per engine step")
    g.add_argument("--speculative-config", type=_speculative_config, default="auto", metavar="auto|off|JSON",
                   help='speculative decoding: auto (the default: n-gram lookup in the request\'s own tokens, '
                        'drafting only where it pays, on CPU), off, or e.g. \'{"method": "suffix", '
                        '"num_speculative_tokens": 16}\'')


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, mode=args.mode, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        rope_scaling=args.rope_scaling,
        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_decode_slowdown=args.max_decode_slowdown,
        max_step_ms=args.max_step_ms,
        enable_prefix_caching=not args.no_prefix_caching, enable_chunked_prefill=not args.no_chunked_prefill,
        prefix_cache_dir=args.prefix_cache_dir, prefix_cache_disk=args.prefix_cache_disk,
        scheduling_policy=args.scheduling_policy,
        quantization=args.quantization, packed_cache=args.packed_cache, compile=args.compile, threads=args.threads, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, trace_file=args.trace,
        speculative_config=args.speculative_config,
    )


def _rope_scaling(text: str) -> dict:
    from kvflow.rope_scaling import parse_rope_scaling

    try:
        return parse_rope_scaling(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative_config(text: str):
    """Checked as the command line is read, so a bad value fails before the model loads."""
    from kvflow.spec.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
