"""The text benchmarks/gguf_fidelity.py prints (and --record writes): where each engine's answer parts from the
float model's, the gaps at the decision point and their spreads, the dequantizers' differences, and what
they come to.
"""

from __future__ import annotations

import numpy as np
from fidelity_engines import JITTER, SAMPLES, Engine
from gguf_types import QUESTION


def tok(tokenizer, i: int) -> str:
    return repr(tokenizer.decode([int(i)]))


def top2(ref: Engine, k: int) -> tuple[int, int, float]:
    row = ref.forced[k]
    a, b = (int(i) for i in np.argsort(-row)[:2])
    return a, b, float(row[a] - row[b])  # log-softmax differences are logit differences


def answers_rows(result: dict, tokenizer) -> list[str]:
    ref: Engine = result["engines"][0]
    rows = [f"| {result['label']} | float (transformers) | {ref.text.strip()!r} | reference | | |"]
    engines = result["engines"][1:]
    for e in [e for e in engines if not e.name.startswith("emu")] + [e for e in engines if e.name.startswith("emu")]:
        at = e.parts_at(result["path"])
        odd = [e.note] if e.note else []
        if (bad := e.check(result["path"])) is not None:
            k, forced, free = bad
            odd.append(f"teacher-forced, one forward over the prompt and the float answer, it picks "
                       f"{tok(tokenizer, forced)} at token {k + 1}" if e.name.startswith("emu") else
                       f"odd: teacher-forced it picks {tok(tokenizer, forced)} at token {k + 1}, free {tok(tokenizer, free)}")
        odd = "; ".join(odd)
        answer = repr(e.text.strip()) + (f" ({odd})" if odd else "")
        if at is None:
            rows.append(f"| {result['label']} | {e.name} | {answer} | never | | |")
            continue
        if at >= len(result["path"]):
            rows.append(f"| {result['label']} | {e.name} | {answer} | after the float answer's end | | |")
            continue
        a, b, margin = top2(ref, at)
        mine = e.tokens[at] if at < len(e.tokens) else None
        took = "" if mine in (a, b) or mine is None else f"; it takes {tok(tokenizer, mine)} ({e.forced[at][mine]:.3f})"
        rows.append(f"| {result['label']} | {e.name} | {answer} | token {at + 1}: {tok(tokenizer, result['path'][at])}"
                    f" -> {tok(tokenizer, mine) if mine is not None else 'end'} | {tok(tokenizer, a)} vs "
                    f"{tok(tokenizer, b)}: {margin:.3f} | {e.forced[at][a]:.3f} / {e.forced[at][b]:.3f}{took} |")
    return rows


def decision_point(result: dict) -> int:
    """The first position where an engine parts from the float answer (else an emulation); where none does,
    the float answer's closest call."""
    for emulated in (False, True):
        ats = [at for e in result["engines"][1:] if e.name.startswith("emu") == emulated
               and (at := e.parts_at(result["path"])) is not None and at < len(result["path"])]
        if ats:
            return min(ats)
    ref = result["engines"][0]
    return min(range(len(result["path"])), key=lambda k: top2(ref, k)[2])


def gap_at(e: Engine, result: dict) -> float:
    k = decision_point(result)
    a, b, _ = top2(result["engines"][0], k)
    return float(e.forced[k][a] - e.forced[k][b])


def spread_text(gaps: list[float]) -> str:
    return f"{np.mean(gaps):+.3f} ± {np.std(gaps):.3f} ({sum(g < 0 for g in gaps)}/{len(gaps)} < 0)"


def margin_row(result: dict, names: list[str], tokenizer) -> str:
    k = decision_point(result)
    a, b, _ = top2(result["engines"][0], k)
    by = {e.name: e for e in result["engines"]}
    cells = []
    for n in names:
        if n == "float":
            cells.append(f"{gap_at(by[n], result):+.3f} ± {np.std(result['spread'][n]):.0e}")
        elif n.startswith("emu"):  # one run's gap turns on float32 noise: the jittered runs' spread
            cells.append(spread_text(result["spread"][n]) if n in result["spread"] else "-")
        else:
            cells.append(f"{gap_at(by[n], result):+.3f}")
    mix = ", ".join(f"{n} {c}" for n, c in result["mix"].most_common())
    return (f"| {result['label']} | {mix} | {k + 1} | {tok(tokenizer, a)} vs {tok(tokenizer, b)} | "
            + " | ".join(cells) + " |")


def rms_row(result: dict, names: list[str]) -> list[str]:
    """Centred logit RMS distance to the float model at the decision point, per engine."""
    ref = result["engines"][0]
    k = decision_point(result)
    by = {e.name: e for e in result["engines"]}

    def rms(e: Engine) -> str:
        d = (e.forced[k] - e.forced[k].mean()) - (ref.forced[k] - ref.forced[k].mean())
        return f"{float(np.sqrt((d * d).mean())):.3f}"

    return [rms(by[n]) if n in by else "-" for n in names]


def summary(results: list[dict], tokenizer) -> str:
    """The figures the conclusion rests on, over all files."""
    def gaps(name: str) -> list[float]:
        return [gap_at(next(e for e in r["engines"] if e.name == name), r) for r in results]

    def rms(name: str) -> list[float]:
        return [float(rms_row(r, [name])[0]) for r in results]

    ref, fast, llama, plain = gaps("float"), gaps("kvflow fast"), gaps("llama.cpp"), gaps("llama.cpp plain")
    tensors = sum(v[0] for r in results for v in r["gaps"].values())
    equal = sum(v[1] for r in results for v in r["gaps"].values())
    parted = [r["label"] for r in results if next(e for e in r["engines"] if e.name == "llama.cpp").parts_at(r["path"])
              is not None]
    kvflow_parted = [f"{r['label']} ({e.name})" for r in results for e in r["engines"]
                     if e.name.startswith("kvflow") and e.parts_at(r["path"]) is not None]
    emu = [r["spread"]["emu q8+f16"] for r in results]
    lines = [
        f"- Dequantizers: {equal} of {tensors} quantized tensors in the {len(results)} files dequantize bitwise "
        "equal in the gguf package (transformers', and kvflow's for what it does not keep packed) and in llama.cpp's "
        "dequantize_row_*" + ("." if equal == tensors else ": the others differ, see the table."),
        "- kvflow: exact and fast mode give the float model's answer on "
        f"{len(results) - len({x.split(' (')[0] for x in kvflow_parted})} of {len(results)} files"
        + (f" (not: {', '.join(kvflow_parted)})" if kvflow_parted else "")
        + f"; at the decision points the fast mode moves the float gap by at most "
        f"{max(abs(f - g) for f, g in zip(fast, ref)):.3f}, and its logits lie {max(rms('kvflow fast')):.3f} RMS or "
        "less from the float model's.",
        f"- llama.cpp parts from the float answer on {len(parted)} of {len(results)} files ({', '.join(parted)}), each "
        f"time at a float margin of {min(ref):.3f} to {max(ref):.3f} logits; its logits lie "
        f"{min(rms('llama.cpp')):.3f} to {max(rms('llama.cpp')):.3f} RMS from the float model's and move the gap by "
        f"{min(g - f for f, g in zip(ref, llama)):+.3f} to {max(g - f for f, g in zip(ref, llama)):+.3f}; its own two "
        f"kernel sets (AMX/repacked vs plain vec_dot) differ from each other by up to "
        f"{max(abs(a - b) for a, b in zip(llama, plain)):.3f} there.",
        f"- The float model with llama.cpp's 8-bit activations and float16 attention: logits "
        f"{min(rms('emu q8+f16')):.3f} to {max(rms('emu q8+f16')):.3f} RMS from float (llama.cpp's: "
        f"{min(rms('llama.cpp')):.3f} to {max(rms('llama.cpp')):.3f}), "
        f"gap sd {min(np.std(g) for g in emu):.3f} to {max(np.std(g) for g in emu):.3f} under a {JITTER:g} jitter "
        f"(without the roundings: {max(np.std(r['spread']['float']) for r in results):.0e}), picking the runner-up "
        f"in {sum(sum(x < 0 for x in g) for g in emu)} of {SAMPLES * len(emu)} runs over the files.",
    ]
    kq = [r for r in results if "emu no Q8_K" in r["spread"]]
    if kq:
        with_k = sum(sum(x < 0 for x in r["spread"]["emu q8+f16"]) for r in kq)
        without = sum(sum(x < 0 for x in r["spread"]["emu no Q8_K"]) for r in kq)
        lines.append(f"- On the files with K-quants ({', '.join(r['label'] for r in kq)}), the same emulation picks the "
                     f"runner-up in {with_k} of {SAMPLES * len(kq)} runs; with the K-quant matmuls' inputs left in "
                     f"float32 (no Q8_K), in {without}. Q8_K (one scale per 256) loses a median "
                     f"{np.median([x for r in kq for x in r['rounding']['q8_K']]):.2%} of an input's RMS (max "
                     f"{max(x for r in kq for x in r['rounding']['q8_K']):.2%}), Q8_0 (per 32) "
                     f"{np.median([x for r in kq for x in r['rounding'].get('q8_0', [])]):.2%} on their other matmuls; the K-quant "
                     f"matmuls are {', '.join(sorted({n for r in kq for n in r['kquant_tensors']}))}, whose inputs' "
                     f"largest |x| is {min(x for r in kq for x in r['peaks']['q8_K']):.0f} to "
                     f"{max(x for r in kq for x in r['peaks']['q8_K']):.0f} times their median (the other matmuls' "
                     f"inputs: up to {max(x for r in kq for x in r['peaks'].get('q8_0', [0])):.0f}).")
    return "\n".join(lines)


def conclusion(results: list[dict], tokenizer) -> str:
    lines = []
    for r in results:
        by = {e.name: e for e in r["engines"]}
        k = decision_point(r)
        a, b, margin = top2(by["float"], k)
        gap = {n: gap_at(e, r) for n, e in by.items()}
        parted = [n for n, e in by.items() if not n.startswith("emu") and e.parts_at(r["path"]) is not None]
        spread = r["spread"]
        dq = max(v[2] for v in r["gaps"].values())
        equal = sum(v[1] for v in r["gaps"].values())
        total = sum(v[0] for v in r["gaps"].values())
        line = (f"- **{r['label']}**: float answers {by['float'].text.strip()[:32]!r}...; "
                + (f"{', '.join(parted)} part from it at token {k + 1}" if parted else f"no engine parts from it; its "
                   f"closest call is token {k + 1}")
                + f", where float prefers {tok(tokenizer, a)} to {tok(tokenizer, b)} by {margin:.3f}. Gaps there: "
                f"kvflow exact {gap['kvflow exact']:+.3f}, fast {gap['kvflow fast']:+.3f}, llama.cpp "
                f"{gap['llama.cpp']:+.3f} (plain kernels {gap['llama.cpp plain']:+.3f}); float with llama.cpp's "
                f"8-bit activations and float16 attention {spread_text(spread['emu q8+f16'])} over {SAMPLES} "
                f"jitters of {JITTER:g} (float alone: ± {np.std(spread['float']):.1e})")
        if "emu no Q8_K" in spread:
            line += f", without the Q8_K rounding {spread_text(spread['emu no Q8_K'])}"
        line += ". llama.cpp's rounding of the matmul inputs (prompt's last row, relative RMS error, median / max " \
            "over the matmuls): " + ", ".join(f"{kind.upper()} {np.median(e):.2%} / {max(e):.2%} ({len(e)})"
                                              for kind, e in sorted(r["rounding"].items()))
        line += (f". Dequantizers: {equal} of {total} quantized tensors bitwise equal to llama.cpp's (max |diff| "
                 f"{dq:.1e}).")
        lines.append(line)
    return "\n".join(lines)


def report(results: list[dict], tokenizer, tokens: int, threads: int) -> str:
    """The whole text, for the results of study() on each file."""
    from kvflow.kernels import cpu_features

    names = ["float", "kvflow exact", "kvflow fast", "llama.cpp", "llama.cpp plain", "emu q8", "emu q8+f16",
             "emu no Q8_K"]
    out = [f"### Fidelity across engines on the default model's GGUF types ({results[0].get('when', '') if results else ''}, "
           f"CPU {cpu_features.cpu_name()}, kvflow tier {cpu_features.isa_tier()})", "",
           f"`python benchmarks/gguf_fidelity.py`: {QUESTION!r} in the chat template, greedy, {tokens} tokens, "
           f"{threads} threads. Float: transformers in float32 on the GGUF's dequantized weights. Where an "
           "engine's answer parts from the float model's: the float model's top two tokens there and their "
           "logit margin, and the engine's log-probabilities of those two, conditioned on the same prefix. The emu rows "
           "are one run each: their answers turn on float32 noise (spreads in the next table).", "",
           "| file | engine | answer | parts from float at | float's top 2 (margin) | engine's logprobs |",
           "|---|---|---|---|---|---|"]
    for r in results:
        out += answers_rows(r, tokenizer)
    out += ["", "At each file's decision point (the first token where an engine, else an emulation, parts from the "
            "float answer): the gap logprob(float's first) - logprob(float's second), teacher-forced along the float "
            "answer; a negative gap picks the second. emu: the float model with llama.cpp's roundings (q8: each "
            "matmul's input through llama.cpp's Q8_0/Q8_K quantizer; +f16: q, k, v and softmax weights in float16 "
            "as its KV cache; no Q8_K: the K-quant matmuls' inputs left in float32); one such run's gap turns on "
            f"float32 noise, so each is run {SAMPLES} times with every matmul input jittered by a relative {JITTER:g} "
            "(the float column's ± is the same jitter without the roundings): mean ± sd of the gap, and how many runs "
            "pick the second. Then the centred-logit RMS distance to the float model there.", "",
            "| file | 2-D tensors | token | float's top 2 | " + " | ".join(names) + " |",
            "|" + "---|" * (4 + len(names))]
    for r in results:
        out.append(margin_row(r, names, tokenizer))
    for r in results:
        out.append(f"| {r['label']} | RMS vs float | | | " + " | ".join(rms_row(r, names)) + " |")
    out += ["", "The gguf package's dequantizer (transformers' and kvflow's) against llama.cpp's dequantize_row_*, "
            "every quantized tensor of the file:", "",
            "| file | type | tensors | bitwise equal | max abs diff | max diff / max abs w |", "|---|---|---|---|---|---|"]
    for r in results:
        for name, (n, equal, diff, rel) in r["gaps"].items():
            out.append(f"| {r['label']} | {name} | {n} | {equal} | {diff:.2e} | {rel:.2e} |")
    out += ["", "Summary:", "", summary(results, tokenizer), "", "Per file:", "", conclusion(results, tokenizer), ""]
    return "\n".join(out)
