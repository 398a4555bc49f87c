"""Every supported architecture read from a GGUF file laid out as llama.cpp's converter lays it out
(tests/hf_to_gguf.py): float32 logits and greedy text against transformers on the checkpoint the file was
made from, and the same file re-quantized to Q8_0 with its layers (MoE experts one by one) kept packed."""

from __future__ import annotations

import pytest
import torch
from gguf_files import requantize, rewrite
from hf_to_gguf import hf_to_gguf
from models.test_parity import (
    assert_relative_close,
    flat_logits,
    random_prompts,
    reference_greedy,
    reference_logits,
)
from tiny_models import TINY_ARCHS, make_tiny_checkpoint

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.layers.quant.packed_linear import PackedLinear

# llama.cpp has no key for Gemma's query_pre_attn_scalar: its files assume head_dim (tiny_models' Gemma 2
# sets another value, for the Hugging Face parity test); nor for gpt-oss's expert clamp, which it fixes at 7.
GGUF_OVERRIDES = {"gemma2": {"query_pre_attn_scalar": 16}, "gpt_oss": {"swiglu_limit": 7.0}}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (Hugging Face folder, GGUF file in a folder of its own)."""
    root = tmp_path_factory.mktemp("gguf_archs")
    out = {}
    for name in TINY_ARCHS:
        folder = make_tiny_checkpoint(name, root / name, **GGUF_OVERRIDES.get(name, {}))
        (root / f"{name}-gguf").mkdir()
        out[name] = folder, hf_to_gguf(folder, root / f"{name}-gguf" / f"{name}.gguf")
    return out


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_gguf_matches_transformers(arch, converted):
    from transformers import AutoModelForCausalLM

    folder, path = converted[arch]
    ours = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu"))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # llama.cpp writes Mistral as a Llama (the same network: its sliding window is not kept).
    assert ours.arch.architecture == ref.config.architectures[0].replace("Mistral", "Llama")
    prompts = random_prompts(ours.arch.vocab_size, [1, 9, 70])
    assert_relative_close(flat_logits(ours.model, prompts), reference_logits(ref, prompts))
    llm = LLM(loaded_model=ours, kv_cache_memory=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts[1:], outs):
        assert out.outputs[0].token_ids == reference_greedy(ref, prompt, 24)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "phi3", "gemma3", "gpt_oss"])
def test_q8_0_file_stays_packed(arch, converted, tmp_path):
    """Q8_0 weights load packed (each MoE expert its own packed layer, read from its slice of the stacked
    tensor), and give the logits of the same file's weights dequantized to float32 (to the rounding of the
    packed kernel's 16-bit inputs). Against the float file itself the tiny random MoE models differ far
    more: Q8_0's rounding moves some tokens to other experts."""
    _, path = converted[arch]
    q8 = requantize(path, tmp_path / "q8.gguf", lambda name: "Q8_0" if name.endswith(".weight") else None)
    packed = load_model(ModelConfig(model=str(q8), device="cpu", mode="exact", quantization="gguf"))
    dequantized = load_model(ModelConfig(model=str(q8), dtype="float32", device="cpu"))
    layer = packed.model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    if packed.arch.is_moe_layer(0):
        projections += [p for e in layer.mlp.experts for p in (e.gate_up_proj, e.down_proj)]
        # Packed in one call a stacked tensor: the experts sit back to back in one buffer.
        data = [e.down_proj.packed.data for e in layer.mlp.experts]
        assert all(b.data_ptr() == a.data_ptr() + a.numel() for a, b in zip(data, data[1:]))
    else:
        projections += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(p, PackedLinear) for p in projections)
    prompts = random_prompts(packed.arch.vocab_size, [9, 40])
    ours, ref = flat_logits(packed.model, prompts), flat_logits(dequantized.model, prompts)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-3, f"packed Q8_0 logits differ from the dequantized weights' by {rel:.2e} relative"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def drop_last_expert(src, dst, tensor_name: str):
    """A copy of a GGUF file with one stacked expert tensor missing its last expert."""
    import numpy as np

    def tensor(t):
        data = np.asarray(t.data)
        return (data[:-1] if t.name == tensor_name else data), t.tensor_type

    return rewrite(src, dst, tensor)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_moe_file_missing_an_expert_is_one_clear_error(converted, tmp_path, quantization):
    from kvflow.errors import ModelLoadError

    _, path = converted["mixtral"]
    bad = drop_last_expert(path, tmp_path / "bad.gguf", "blk.1.ffn_up_exps.weight")
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up_exps\.weight holds 3 experts.*says 4"):
        load_model(ModelConfig(model=str(bad), device="cpu", quantization=quantization))
