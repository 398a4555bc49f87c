"""The serving benchmark's results: per-request records, the summary (percentiles, throughput, goodput
under SLOs), the per-turn report of the agent scenario, and the printed table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.bench.stats import summarize


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # tokens: the server's usage figure when reported, else the intended length
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    start: float = 0.0  # seconds after the benchmark began
    cached_tokens: int | None = None
    # Speculative decoding, as the server's usage.kvflow_timings reports it (None: not reported).
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def meets_slos(res: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO (in ms); TPOT is vacuous for one-token outputs."""
    if not res.success:
        return False
    values = {"ttft": res.ttft, "tpot": res.tpot or 0.0, "e2e": res.e2e}
    return all(values[k] * 1000 <= limit for k, limit in slos.items())


def summarize_results(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in ok], 1000),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": summarize([x for r in ok for x in r.itl], 1000),
        "e2e_ms": summarize([r.e2e for r in ok], 1000),
    }
    if slos:
        met = sum(meets_slos(r, slos) for r in results)
        summary.update({"slo_ms": dict(slos), "slo_met": met, "goodput": met / duration})
    reported = [r for r in ok if r.draft_tokens is not None]
    drafted = sum(r.draft_tokens for r in reported)
    if drafted:
        accepted = sum(r.accepted_tokens or 0 for r in reported)
        summary["speculative"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                                  "acceptance_rate": accepted / drafted}
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def request_record(r: RequestResult) -> dict[str, Any]:
    return {
        "success": r.success,
        "error": r.error,
        "start_s": r.start,
        "prompt_len": r.prompt_len,
        "output_tokens": r.output_tokens,
        "cached_tokens": r.cached_tokens,
        "draft_tokens": r.draft_tokens,
        "accepted_tokens": r.accepted_tokens,
        "ttft_ms": r.ttft * 1000,
        "tpot_ms": None if r.tpot is None else r.tpot * 1000,
        "e2e_ms": r.e2e * 1000,
        "itl_ms": [x * 1000 for x in r.itl],
    }


def per_turn_report(per_conv: list[list[RequestResult]]) -> list[dict[str, Any]]:
    turns = []
    for i, row in enumerate(zip(*per_conv, strict=True)):
        ok = [r for r in row if r.success]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        turns.append({
            "turn": i + 1,
            "prompt_tokens": round(sum(r.prompt_len for r in ok) / len(ok)) if ok else None,
            "ttft_ms": summarize([r.ttft for r in ok], 1000)["mean"] if ok else None,
            "ttft_ms_each": [r.ttft * 1000 for r in ok],
            "cached_tokens": round(sum(cached) / len(cached)) if cached else None,
            "output_tokens": round(sum(r.output_tokens for r in ok) / len(ok)) if ok else None,
            "failed": len(row) - len(ok),
        })
    return turns


def format_summary(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        f"== kvflow bench serve: {doc['label']} ({doc['scenario']}) at {doc['base_url']} ==",
        f"{'successful requests':<28}{s['completed']:>12}",
        f"{'failed requests':<28}{s['failed']:>12}",
        f"{'duration (s)':<28}{s['duration_s']:>12.2f}",
        f"{'input tokens':<28}{s['total_input_tokens']:>12}",
        f"{'output tokens':<28}{s['total_output_tokens']:>12}",
        f"{'requests/s':<28}{s['request_throughput']:>12.2f}",
        f"{'output tokens/s':<28}{s['output_throughput']:>12.2f}",
        f"{'total tokens/s':<28}{s['total_token_throughput']:>12.2f}",
    ]
    if "goodput" in s:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in s["slo_ms"].items())
        lines.append(f"{'goodput (req/s, ' + slo + ')':<28}{s['goodput']:>12.2f}  ({s['slo_met']} met)")
    lines.append(f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{name}_ms"]
        cells = ("-" if m[k] is None else f"{m[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<8}" + "".join(f"{c:>10}" for c in cells))
    if "speculative" in s:
        sp = s["speculative"]
        lines.append(f"{'speculative: accepted':<28}{sp['accepted_tokens']:>12}  of {sp['draft_tokens']} drafted "
                     f"({100 * sp['acceptance_rate']:.0f}%)")
    if doc.get("turns"):
        lines.append(f"{'turn':>5}{'prompt tok':>12}{'cached tok':>12}{'TTFT ms':>10}")
        for t in doc["turns"]:
            cached = "-" if t["cached_tokens"] is None else str(t["cached_tokens"])
            ttft = "-" if t["ttft_ms"] is None else f"{t['ttft_ms']:.1f}"
            lines.append(f"{t['turn']:>5}{t['prompt_tokens'] or '-':>12}{cached:>12}{ttft:>10}")
    for err in s.get("errors", []):
        lines.append(f"error: {err}")
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"bad SLO {item!r}: want ttft:MS, tpot:MS or e2e:MS")
        slos[key] = float(value)
    return slos
