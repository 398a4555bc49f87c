"""Parity with transformers on the same weights, in float32: logits of a ragged flat batch, and greedy text."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_ARCHS

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.layers.attention.metadata import AttentionMetadata

REL_TOL = 1e-4


def flat_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Every position's logits for several prompts run back to back in one flat batch (no padding)."""
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        hidden = model(ids, positions, AttentionMetadata.for_prompts(lengths))
        return model.compute_logits(hidden)


def reference_logits(hf_model, prompts: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])


def reference_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, ignoring EOS."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        tokens = []
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = hf_model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
    return tokens


def assert_relative_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < REL_TOL, f"logits differ by {rel:.2e} relative (limit {REL_TOL})"


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_architecture_parity(arch, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints[arch]
    ours = load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu"))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = random_prompts(ours.arch.vocab_size, [1, 7, 33, 130])
    assert_relative_close(flat_logits(ours.model, prompts), reference_logits(ref, prompts))

    llm = LLM(loaded_model=ours, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    for prompt, out in zip(prompts[1:], outs):
        assert out.outputs[0].token_ids == reference_greedy(ref, prompt, 32)


def test_default_model_logits_parity(default_loaded, hf_default):
    tok = default_loaded.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "안녕하세요", "Hi"]
    prompts = [tok(t).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must have different lengths"
    assert_relative_close(flat_logits(default_loaded.model, prompts), reference_logits(hf_default, prompts))


def test_default_model_greedy_parity(default_loaded, hf_default):
    llm = LLM(loaded_model=default_loaded, kv_cache_memory=64 << 20)
    tok = llm.get_tokenizer()
    texts = ["Once upon a time", "The three primary colors are", "import numpy as np\n"]
    prompts = [tok(t).input_ids for t in texts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(hf_default, prompt, 32)


def test_gemma3_image_text_checkpoint_runs_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: kvflow reads the text model out of it
    (config and weights, the vision tower left alone) and matches transformers on text input."""
    import transformers

    text = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=5, boi_token_index=3, eoi_token_index=4)
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    ref.save_pretrained(tmp_path)
    ours = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    assert ours.arch.architecture == "Gemma3ForCausalLM"
    prompts = random_prompts(384, [5, 30])
    assert_relative_close(flat_logits(ours.model, prompts), reference_logits(ref, prompts))
