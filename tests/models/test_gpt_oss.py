"""gpt-oss's parts that the parity tests (test_parity.py, test_gguf_architectures.py) do not reach alone:
its MXFP4 checkpoint format, and that its sinks and clamp really act on the tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.models.gpt_oss import FP4_VALUES, dequantize_mxfp4
from models.test_parity import flat_logits, random_prompts


def test_mxfp4_decoding_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 8]: transposed
    assert ours.shape == (3, 8, 128)
    assert torch.equal(ours, theirs.transpose(1, 2))


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] (n a multiple of 32) as MXFP4 blocks and scales: each group's power-of-two scale makes its
    largest magnitude at most 6, and each value takes its nearest E2M1 code."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    values = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - values).abs().argmin(-1).to(torch.uint8)  # [..., groups, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_checkpoint_loads_as_its_decoded_weights(tiny_checkpoints, tmp_path):
    """A folder whose experts are MXFP4 blocks and scales, as the released gpt-oss checkpoints store them
    (rows as nn.Linear's, gate and up interleaved), gives the logits of the same folder with those experts
    decoded to float and stored as transformers' float checkpoints are ([experts, in, out])."""
    source = tiny_checkpoints["gpt_oss"]
    weights = load_file(source / "model.safetensors")
    packed, decoded = dict(weights), dict(weights)
    for name, t in weights.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = to_mxfp4(t.transpose(1, 2).contiguous())  # rows out, groups along in
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            decoded[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    folders = {}
    for kind, tensors in (("mxfp4", packed), ("decoded", decoded)):
        folder = tmp_path / kind
        shutil.copytree(source, folder)
        save_file(tensors, folder / "model.safetensors")
        folders[kind] = folder
    cfg = json.loads((folders["mxfp4"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (folders["mxfp4"] / "config.json").write_text(json.dumps(cfg))
    models = {k: load_model(ModelConfig(model=str(f), dtype="float32", device="cpu")) for k, f in folders.items()}
    prompts = random_prompts(models["mxfp4"].arch.vocab_size, [5, 30])
    assert torch.equal(flat_logits(models["mxfp4"].model, prompts), flat_logits(models["decoded"].model, prompts))
    original = load_model(ModelConfig(model=str(source), dtype="float32", device="cpu"))
    assert not torch.allclose(flat_logits(original.model, prompts), flat_logits(models["decoded"].model, prompts))


def test_blocks_without_scales_are_one_clear_error(tiny_checkpoints, tmp_path):
    from kvflow.errors import ModelLoadError

    folder = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["gpt_oss"], folder)
    weights = load_file(folder / "model.safetensors")
    t = weights.pop("model.layers.1.mlp.experts.down_proj")
    weights["model.layers.1.mlp.experts.down_proj_blocks"] = to_mxfp4(t.transpose(1, 2).contiguous())[0]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"blocks or scales without their pair.*layers\.1\.mlp\.experts\.down_proj"):
        load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu"))


@pytest.mark.parametrize("part", ["sinks", "clamp"])
def test_sinks_and_clamp_change_the_tiny_model(tiny_checkpoints, part):
    """The parity tests would pass with sinks or the clamp missing on both sides: show that both act on the
    tiny checkpoint (so parity covers them)."""
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["gpt_oss"]), dtype="float32", device="cpu"))
    prompts = random_prompts(loaded.arch.vocab_size, [40])
    before = flat_logits(loaded.model, prompts)
    for layer in loaded.model.layers:
        if part == "sinks":
            layer.self_attn.sinks.fill_(-float("inf"))
        else:
            for expert in layer.mlp.experts:
                expert.act_and_mul.keywords["limit"] = float("inf")
    after = flat_logits(loaded.model, prompts)
    assert ((after - before).abs().max() / before.abs().max()).item() > 1e-2


def test_mxfp4_experts_stay_packed_and_run_natively(tiny_checkpoints, tmp_path, monkeypatch):
    """gpt-oss as its GGUF files ship: MXFP4 experts (4-bit indices into the E2M1 table, a power-of-two
    scale per 32), Q8_0 attention. The experts stay packed, the exact mode's logits are those of the same
    file dequantized to float32 (to the packed kernel's 16-bit input rounding), and the fast mode's native
    decoder gives the PyTorch layers' greedy text (up to a tie) and logprobs."""
    from engine_helpers import assert_close_outputs
    from gguf_files import requantize
    from hf_to_gguf import hf_to_gguf

    import kvflow.executors.plan as plan_module
    from kvflow import LLM, SamplingParams
    from kvflow.executors.thresholds import RowThresholds
    from kvflow.layers.quant.packed_linear import PackedLinear

    (tmp_path / "f32").mkdir()
    f32 = hf_to_gguf(tiny_checkpoints["gpt_oss"], tmp_path / "f32" / "gpt-oss.gguf")
    path = requantize(f32, tmp_path / "mxfp4.gguf",
                      lambda name: "MXFP4" if "_exps.weight" in name else "Q8_0" if name.endswith(".weight") else None)
    exact = load_model(ModelConfig(model=str(path), device="cpu", mode="exact", quantization="gguf"))
    expert = exact.model.layers[0].mlp.experts[1].gate_up_proj
    assert isinstance(expert, PackedLinear) and expert.packed.codebook == 2 and expert.bias is not None
    dequantized = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu"))
    prompts = random_prompts(exact.arch.vocab_size, [9, 40])
    ours, ref = flat_logits(exact.model, prompts), flat_logits(dequantized.model, prompts)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-3
    # The layers on the same packed weights as the native decoder: no bfloat16 copies for many-row steps,
    # which this CPU's start-up measure may or may not find paying (with them, 0.27 nats apart was seen).
    monkeypatch.setattr(plan_module, "bf16_copies_pay", lambda: False)
    # and 16-bit matmul inputs, as the layers': the AVX2 tier's decode of two sequences would take 8-bit ones
    monkeypatch.setattr(RowThresholds, "eight_bit_min_rows", lambda self, tier: 0)
    fast = load_model(ModelConfig(model=str(path), device="cpu"))
    assert fast.native is not None and not fast.plan.bf16_copies
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    native = LLM(loaded_model=fast, kv_cache_memory=16 << 20, speculative_config="off").generate(requests, params)
    fast.native = None  # the same weights through the PyTorch layers
    layers = LLM(loaded_model=fast, kv_cache_memory=16 << 20, speculative_config="off").generate(requests, params)
    assert_close_outputs(native, layers, 5e-3)  # measured: 4e-4 nats apart at most
