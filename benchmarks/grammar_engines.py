"""Which grammar engine kvflow constrains decoding with: xgrammar against llguidance, measured on this CPU
with the default model's tokenizer (49,152 tokens) over the committed schema suite
(tests/structured/schemas.json).

For each engine: the time to prepare the tokenizer once, the time to compile each schema (cold, no cache),
which schemas it refuses, and the time to compute one token mask along a seeded random walk through
each grammar (a token drawn from the allowed set, consumed, the next mask computed).

    python benchmarks/grammar_engines.py [--steps 48] [--record] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from results_file import publish, table_section

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "tests" / "structured" / "schemas.json"


def _default_tokenizer():
    from kvflow.loader.gguf_file import open_gguf
    from kvflow.loader.resolve import resolve_model
    from kvflow.loader.tokenizer import load_tokenizer

    resolved = resolve_model(None)
    return load_tokenizer(resolved, open_gguf(resolved.path))


def _allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = bitmask[0].numpy().view("uint32")
    ids = []
    for word_index, word in enumerate(bits.tolist()):
        while word:
            low = word & -word
            token = word_index * 32 + low.bit_length() - 1
            if token < vocab:
                ids.append(token)
            word ^= low
    return ids


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def walk(self, compiled, steps: int, rng: random.Random) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        return _timed_walk(matcher.is_terminated, lambda: matcher.fill_next_token_bitmask(bitmask), bitmask,
                           matcher.accept_token, self.vocab, steps, rng)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        # Not llguidance.torch: importing it compiles a mask kernel with torch.compile; kvflow fills the
        # bitmask through the matcher itself (kvflow/structured/masks.py), as here.
        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def walk(self, grammar: str, steps: int, rng: random.Random) -> list[float]:
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        bitmask = torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)
        fill = lambda: matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)  # noqa: E731
        return _timed_walk(matcher.is_stopped, fill, bitmask, matcher.consume_token, self.vocab, steps, rng)


def _timed_walk(done, fill, bitmask: torch.Tensor, accept, vocab: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds of each mask fill along a walk that takes a random allowed token each step."""
    times = []
    for _ in range(steps):
        if done():
            break
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        allowed = _allowed(bitmask, vocab)
        if not allowed:
            break
        accept(rng.choice(allowed))
    return times


def measure(engine_cls, tokenizer, vocab: int, cases: list[dict], steps: int) -> dict:
    start = time.perf_counter()
    engine = engine_cls(tokenizer, vocab)
    setup_s = time.perf_counter() - start
    compile_ms, mask_us, refused = [], [], {}
    for case in cases:
        start = time.perf_counter()
        try:
            compiled = engine.compile(case["schema"])
        except Exception as exc:  # noqa: BLE001 - an engine's refusal is a result here
            refused[case["name"]] = str(exc).splitlines()[0][:160]
            continue
        compile_ms.append((time.perf_counter() - start) * 1000)
        mask_us += [t * 1e6 for t in engine.walk(compiled, steps, random.Random(case["name"]))]
    return {
        "engine": engine.name, "tokenizer_setup_s": round(setup_s, 3),
        "compile_ms_median": round(statistics.median(compile_ms), 2), "compile_ms_max": round(max(compile_ms), 2),
        "mask_us_median": round(statistics.median(mask_us), 1),
        "mask_us_p99": round(sorted(mask_us)[int(0.99 * (len(mask_us) - 1))], 1),
        "masks": len(mask_us), "compiled": len(compile_ms), "refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48, help="tokens walked through each grammar")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    parser.add_argument("--out", type=Path, default=None, help="also save the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from kvflow.kernels.cpu_features import cpu_name

    tokenizer = _default_tokenizer()
    vocab = len(tokenizer)
    cases = json.loads(SCHEMAS.read_text())
    rows = [measure(cls, tokenizer, vocab, cases, args.steps) for cls in (XGrammar, LLGuidance)]
    lines = [f"| {r['engine']} | {r['tokenizer_setup_s']} | {r['compile_ms_median']} / {r['compile_ms_max']} "
             f"| {r['mask_us_median']} / {r['mask_us_p99']} | {len(r['refused'])} of {len(cases)} |" for r in rows]
    lines += [f"\n{r['engine']} refused {name}: {why}" for r in rows for name, why in r["refused"].items()]
    intro = (f"`python benchmarks/grammar_engines.py --steps {args.steps}`, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"CPU: {cpu_name()} ({platform.machine()}), {args.threads} threads; the default model's tokenizer "
             f"({vocab} tokens), the {len(cases)} schemas of tests/structured/schemas.json. Compile: each schema "
             "cold, no cache. Mask: one token mask along a seeded random walk through each grammar.")
    publish(table_section("Grammar engines for structured output", intro,
                          ["engine", "tokenizer setup s", "compile ms median / max", "mask us median / p99",
                           "schemas refused"], lines), args.record)
    if args.out is not None:
        args.out.write_text(json.dumps({"cpu": cpu_name(), "vocab": vocab, "engines": rows}, indent=1))


if __name__ == "__main__":
    main()
