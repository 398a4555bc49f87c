"""Fidelity across engines: which answer the float model gives on a GGUF file, and where the engines part.

For each file type (made from the default model's Q4_1 file by llama.cpp's quantizer, as
benchmarks/gguf_types.py makes them; Q4_1 is the file itself) the question is answered greedily, in the
model's chat template, by:

  float          transformers in float32 on the GGUF's dequantized weights (the gguf package's dequantizer);
                 the reference
  kvflow exact   LLM(file, mode="exact"): float32 weights from the same dequantizer, float32 cache
  kvflow fast    LLM(file): the packed weights, 16-bit kernel inputs at batch 1, float16 cache
  llama.cpp      llama-cpp-python (its own virtualenv, a subprocess): default settings (AMX and repacked
                 kernels where the CPU has them); "llama.cpp plain" turns the extra buffer types off
                 (use_extra_bufts=False), so every matmul is ggml's vec_dot on Q8 activations
  emu q8         the float model with each matmul's input rounded as llama.cpp rounds it (by llama.cpp's
                 own quantize_row_q8_*_ref / dequantize_row_q8_*): Q8_K, one scale per 256, for the K-quant
                 weights; Q8_0, one scale per 32, for the others (Q8_1 for Q4_1/Q5_1 rounds x the same way)
  emu q8+f16     emu q8, and attention as llama.cpp's float16 KV cache computes it: q, k, v and the
                 softmax weights rounded to float16
  emu no Q8_K    emu q8+f16 with the K-quant matmuls' inputs left in float32 (only for files with K-quants)

Every engine gets the same prompt token ids (checked against each engine's own chat path). Each engine is
also teacher-forced along the float model's answer (kvflow by a sampler that records the logits and
substitutes the float model's token; llama.cpp's own greedy pass is that up to where it parts), so its
log-probabilities at a position are conditioned on the same prefix as the float model's. The emulations'
answers turn on float32 noise (a forward over more rows, another blocking of a float32 matmul, flips them), so
at the decision point they are run 16 times with jittered inputs and reported as a spread. A third table
compares the gguf package's dequantization of every quantized tensor in the file with llama.cpp's
dequantize_row_* (max |difference|).

    python benchmarks/gguf_fidelity.py [--types Q6_K,Q4_K_M,Q5_K_M,Q5_1,Q8_0,Q4_1] [--tokens 24] [--record]

--record writes the text to benchmarks/fidelity_section.md (not RESULTS.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import tempfile
import time
from collections import Counter
from pathlib import Path

from fidelity_engines import (
    EMULATIONS,
    MODE,
    PLAIN,
    activation_type,
    dequantizer_gaps,
    gap_spread,
    hf_run,
    kvflow_run,
    llamacpp_run,
    load_float_model,
    rounding_errors,
)
from fidelity_report import decision_point, report, top2
from gguf_types import QUESTION, ggml_library, peer

TYPES = ("Q6_K", "Q4_K_M", "Q5_K_M", "Q5_1", "Q8_0", "Q4_1")
SECTION = Path(__file__).resolve().parent / "fidelity_section.md"


def study(path: Path, label: str, tokenizer, prompt: list[int], args, ggml, tmp: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    mix = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    has_k = any(activation_type(t) == "q8_K" for t in types.values())
    del reader

    start = time.perf_counter()
    clock = {}

    def lap(name: str) -> None:
        clock[name] = time.perf_counter() - start - sum(clock.values())

    model = load_float_model(path, types, ggml)
    MODE.update(PLAIN)
    ref = hf_run(model, tokenizer, "float", prompt, args.tokens, None)
    path_ids = ref.tokens
    emulations = {name: mode for name, mode in EMULATIONS.items() if has_k or not mode.get("skip_q8k")}
    engines = [ref]
    for name, mode in emulations.items():
        MODE.update({**PLAIN, **mode})
        engines.append(hf_run(model, tokenizer, name, prompt, args.tokens, path_ids))
    MODE.update(PLAIN)
    lap("float and emulations")
    for mode in ("exact", "fast"):
        engines.append(kvflow_run(path, mode, prompt, args.tokens, path_ids, args.threads))
    lap("kvflow")
    engines.append(llamacpp_run(path, "llama.cpp", True, prompt, args.tokens, path_ids, args.threads, tokenizer, tmp))
    engines.append(llamacpp_run(path, "llama.cpp plain", False, prompt, args.tokens, path_ids, args.threads,
                                tokenizer, tmp))
    lap("llama.cpp")
    result = {"label": label, "mix": mix, "engines": engines, "path": path_ids, "when": time.strftime("%Y-%m-%d %H:%M")}
    k = decision_point(result)
    a, b, _ = top2(ref, k)
    result["spread"] = {name: gap_spread(model, prompt, path_ids, k, a, b, mode)
                        for name, mode in {"float": {}, **emulations}.items()}
    result["rounding"], result["peaks"] = rounding_errors(model, ggml, prompt)
    result["kquant_tensors"] = sorted({name.split(".")[-2] for name, t in types.items()
                                       if activation_type(t) == "q8_K"})
    del model
    gc.collect()
    lap("spreads")
    result["gaps"] = dequantizer_gaps(path, ggml)
    lap("dequantizers")
    print(f"{label}: {time.perf_counter() - start:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in clock.items())})",
          flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help=f"write the text to {SECTION.name}")
    ap.add_argument("--dump", type=Path, help="also pickle the results here")
    ap.add_argument("--report", type=Path, help="only print the report of results pickled by --dump")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvflow.loader.resolve import resolve_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    src = resolve_model(None).path
    ggml = ggml_library()
    # Every requantization keeps the source's vocabulary and chat template: one tokenizer for all files.
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    results = []
    if args.report:
        results = pickle.loads(args.report.read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        for ftype in [] if args.report else args.types.split(","):
            if ftype == "Q4_1":
                path = src
            else:
                path = Path(tmp) / f"smollm2.{ftype}.gguf"
                made = peer("quantize", str(src), str(path))
                if made.returncode != 0 or not path.exists():
                    print(f"{ftype}: llama.cpp's quantizer failed: {made.stderr.strip()[-200:]}")
                    continue
            results.append(study(path, ftype if ftype != "Q4_1" else "Q4_1 (original)", tokenizer, prompt,
                                 args, ggml, Path(tmp)))

    if args.dump:
        args.dump.write_bytes(pickle.dumps(results))
    text = report(results, tokenizer, args.tokens, args.threads)
    print(text)
    if args.record:
        SECTION.write_text(text)


if __name__ == "__main__":
    main()
