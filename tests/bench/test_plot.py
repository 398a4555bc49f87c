"""Plots from small synthetic inputs of each kind."""

import json

import pytest

from kvflow.bench.plot import load_input, plot_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def latency_doc(label: str, scale: float) -> dict:
    results = []
    for n in (128, 512, 2048):
        tps = scale * 1000 * (1 - n / 8192)
        results.append({"test": f"pp{n}", "n_prompt": n, "n_gen": 0, "depth": 0, "batch": 1,
                        "tokens_per_s": tps, "roofline_tokens_per_s": 7000.0, "fraction_of_roofline": tps / 7000})
    for depth in (0, 4096):
        for batch in (1, 4, 16):
            tps = scale * 100 * batch**0.7
            roof = 176.0 * batch / (1 + 0.01 * batch)
            results.append({"test": "tg128", "n_prompt": 0, "n_gen": 128, "depth": depth, "batch": batch,
                            "tokens_per_s": tps, "roofline_tokens_per_s": roof, "fraction_of_roofline": tps / roof})
    return {"kind": "latency", "model": label, "probe": {"kind": "probe", "results": []}, "results": results}


def serve_doc(label: str, base_ms: float, agent: bool = False) -> dict:
    requests = [{"success": True, "ttft_ms": base_ms + i, "tpot_ms": 10.0 + i / 10, "e2e_ms": base_ms + 500 + i,
                 "itl_ms": [10.0] * 5, "output_tokens": 6, "prompt_len": 20} for i in range(20)]
    requests.append({"success": False, "ttft_ms": 0, "tpot_ms": None, "e2e_ms": 0, "itl_ms": []})
    doc = {"kind": "serve", "label": label, "scenario": "agent" if agent else "random", "requests": requests,
           "summary": {}}
    if agent:
        doc["turns"] = [{"turn": i + 1, "prompt_tokens": 4000 + 400 * i, "ttft_ms": 50.0 + i,
                         "cached_tokens": 3900 + 400 * i if i else 0, "output_tokens": 100} for i in range(5)]
    return doc


def write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_every_kind_is_plotted(tmp_path):
    inputs = [
        write(tmp_path / "kvflow_latency.json", latency_doc("kvflow", 1.0)),
        write(tmp_path / "llamacpp_latency.json", latency_doc("llama.cpp", 0.8)),
        write(tmp_path / "kvflow_serve.json", serve_doc("kvflow", 100)),
        write(tmp_path / "llamacpp_agent.json", serve_doc("llama.cpp", 200, agent=True)),
    ]
    trace = tmp_path / "engine.jsonl"
    steps = [{"t": 100 + 0.02 * i, "prefill_tokens": 512 if i % 5 == 0 else 0, "decode_tokens": min(i, 8),
              "batch_size": min(i, 8) + (i % 5 == 0), "kv_usage": i / 50} for i in range(40)]
    trace.write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    out = tmp_path / "plots"
    written = plot_results([*inputs, trace], out)
    names = sorted(p.name for p in written)
    assert names == sorted(["ttft_vs_prompt.png", "decode_vs_batch.png", "serve_cdf.png", "agent_turns.png",
                            "trace_engine.png"])
    for p in written:
        assert p.parent == out
        assert_png(p)


def test_serve_without_agent_turns_writes_only_the_cdfs(tmp_path):
    written = plot_results([write(tmp_path / "s.json", serve_doc("x", 10))], tmp_path)
    assert [p.name for p in written] == ["serve_cdf.png"]
    assert_png(written[0])


def test_kind_detection(tmp_path):
    assert load_input(write(tmp_path / "a.json", latency_doc("m", 1)))[0] == "latency"
    assert load_input(write(tmp_path / "t.json", {"kind": "trace", "steps": []})) == ("trace", [])
    with pytest.raises(ValueError, match="unknown result kind"):
        load_input(write(tmp_path / "b.json", {"kind": "probe"}))


def test_cli_plot(tmp_path, capsys):
    from kvflow.bench.cli import main

    src = write(tmp_path / "lat.json", latency_doc("m", 1.0))
    assert main(["plot", str(src), "--out-dir", str(tmp_path / "out")]) == 0
    assert_png(tmp_path / "out" / "ttft_vs_prompt.png")
    assert "decode_vs_batch.png" in capsys.readouterr().out
