"""--rope-scaling (models/rope_override.py): linear and YaRN rotary scaling stated at load time, against
transformers on a checkpoint whose config states the same scaling. The tables against ROPE_INIT_FUNCTIONS,
float32 logits past the model's trained context in the exact mode, the native CPU decoder's steps against
the PyTorch layers on the same scaled table, a GGUF file, and the flag's parsing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from engine_helpers import assert_close_outputs, make_llm
from hf_to_gguf import hf_to_gguf
from tiny_models import COMMON, make_tiny_checkpoint

from kvflow import SamplingParams
from kvflow.config import ModelConfig, engine_config
from kvflow.executors.model_setup import load_model
from kvflow.kernels import packed_matmul
from kvflow.layers.rotary import RotaryEmbedding, rope_inv_freq, yarn_gain
from kvflow.models.arch import ArchConfig
from kvflow.models.rope_override import apply_rope_scaling
from kvflow.rope_scaling import parse_rope_scaling
from models.test_parity import assert_relative_close, flat_logits, random_prompts, reference_logits

CONTEXT = COMMON["max_position_embeddings"]  # the tiny checkpoints' trained context: 512
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT}
LINEAR = {"rope_type": "linear", "factor": 2.0}
# Past the trained 512 positions: the scaled context is what lets them in.
LENGTHS = [1, 40, 700]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny Llama whose config states no scaling: --rope-scaling adds it."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("rope") / "plain")


def scaled_reference(folder, scaling: dict, tmp_path):
    """transformers' model on plain's weights with the scaling written into its config."""
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = scaling
    config.pop("rope_parameters", None)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(config))
    for f in folder.glob("*.safetensors"):
        (ref_dir / f.name).symlink_to(f)
    return AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("scaling", [
    LINEAR, {"rope_type": "linear", "factor": 8.0},
    YARN, {**YARN, "original_max_position_embeddings": 64}, {**YARN, "beta_fast": 16.0, "truncate": False},
    {**YARN, "attention_factor": 0.8}, {**YARN, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 0.5},
], ids=["linear2", "linear8", "yarn4", "yarn-orig64", "yarn-beta-untruncated", "yarn-attn", "yarn-mscale"])
@pytest.mark.parametrize("theta,head_dim", [(10000.0, 16), (1000000.0, 128)])
def test_tables_are_transformers_rope_init_functions(scaling, theta, head_dim):
    """The inverse frequencies and the cos/sin gain, to the bit."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**{**COMMON, "hidden_size": 4 * head_dim, "head_dim": head_dim, "rope_theta": theta,
                            "rope_scaling": dict(scaling)})
    inv_freq, gain = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    ours = apply_rope_scaling(_arch(head_dim, theta), parse_rope_scaling(scaling)).rope_scaling
    assert torch.equal(rope_inv_freq(head_dim, theta, ours), inv_freq)
    assert (yarn_gain(ours) if scaling["rope_type"] == "yarn" else 1.0) == gain
    table = RotaryEmbedding(head_dim, 64, theta, ours)
    positions = torch.arange(64, dtype=torch.float32)[:, None]
    assert torch.equal(table.cos[:, : head_dim // 2], (positions * inv_freq).cos() * gain)


def _arch(head_dim: int, theta: float) -> ArchConfig:
    return ArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=4 * head_dim,
                      intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=head_dim,
                      rms_norm_eps=1e-6, rope_theta=theta, rope_scaling=None, max_position_embeddings=CONTEXT,
                      tie_word_embeddings=True)


@pytest.mark.parametrize("stated,scaling", [("yarn:4", YARN), ('{"type": "linear", "factor": 2}', LINEAR),
                                            ("yarn:4:64", {**YARN, "original_max_position_embeddings": 64})],
                         ids=["yarn-short", "linear-json-old-key", "yarn-orig64"])
def test_exact_mode_logits_past_the_trained_context(plain, stated, scaling, tmp_path):
    ours = load_model(ModelConfig(model=str(plain), dtype="float32", device="cpu", mode="exact",
                                  rope_scaling=parse_rope_scaling(stated)))
    reach = scaling.get("original_max_position_embeddings", CONTEXT) * scaling["factor"]
    assert ours.max_model_len == ours.arch.max_position_embeddings == max(CONTEXT, reach)
    ref = scaled_reference(plain, scaling, tmp_path)
    prompts = random_prompts(ours.arch.vocab_size, [n for n in LENGTHS if n < ours.max_model_len] + [400])
    assert_relative_close(flat_logits(ours.model, prompts), reference_logits(ref, prompts))
    # ...and the scaling changes them (the test could not pass on the plain table).
    unscaled = load_model(ModelConfig(model=str(plain), dtype="float32", device="cpu", mode="exact"))
    assert not torch.allclose(flat_logits(unscaled.model, prompts[1:2]), flat_logits(ours.model, prompts[1:2]))


def test_yarn_in_the_config_without_its_original_context(tmp_path):
    """A config's yarn that names no original context takes the model's (transformers' default), and the
    context grows to what the scaling reaches."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint("llama", tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    ours = load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu", mode="exact"))
    assert ours.arch.rope_scaling["original_max_position_embeddings"] == CONTEXT
    assert ours.max_model_len == 4 * CONTEXT  # as far as the scaling reaches (vLLM's derived length)
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = random_prompts(ours.arch.vocab_size, [9, 90])
    assert_relative_close(flat_logits(ours.model, prompts), reference_logits(ref, prompts))


# The native decoder is C++: only a machine without a compiler skips (CI has g++).
@pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler to build the kernels")
@pytest.mark.parametrize("scaling", [YARN, LINEAR], ids=["yarn", "linear"])
def test_native_decoder_runs_on_the_scaled_table(plain, scaling, monkeypatch):
    """The fast CPU path (int4-packed, the native decoder) against the PyTorch layers on the same weights,
    past the trained context: the table the C++ decoder reads is the scaled one. 16-bit matmul inputs and
    no bfloat16 copies on either side, so both multiply alike (as tests/executors/test_cpu_fast.py)."""
    from kvflow.executors import plan as plan_module
    from kvflow.executors.thresholds import RowThresholds
    from kvflow.kernels import abi

    monkeypatch.setattr(RowThresholds, "eight_bit_min_rows", lambda self, tier: 0)
    monkeypatch.setattr(plan_module, "bf16_copies_pay", lambda: False)
    loaded = load_model(ModelConfig(model=str(plain), device="cpu", quantization="int4", rope_scaling=scaling))
    assert loaded.native is not None and loaded.max_model_len > CONTEXT
    assert loaded.native.struct.max_positions == loaded.model.rotary.cos.shape[0] == loaded.max_model_len
    assert loaded.native.struct.cos == loaded.model.rotary.cos.data_ptr()
    expected = RotaryEmbedding(loaded.arch.head_dim, loaded.max_model_len, loaded.arch.rope_theta,
                               apply_rope_scaling(_arch(loaded.arch.head_dim, loaded.arch.rope_theta),
                                                  parse_rope_scaling(scaling)).rope_scaling)
    assert torch.equal(loaded.model.rotary.cos, expected.cos)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(loaded.arch.vocab_size, [600, 30], seed=1)]
    calls = []
    original = abi.native().kvflow_decoder_forward
    monkeypatch.setattr(abi.native(), "kvflow_decoder_forward", lambda **k: calls.append(1) or original(**k))
    ours = make_llm(loaded, kv_cache_memory=32 << 20).generate(prompts, params)
    assert len(calls) >= 12
    saved, loaded.native = loaded.native, None
    try:
        layers = make_llm(loaded, kv_cache_memory=32 << 20).generate(prompts, params)
    finally:
        loaded.native = saved
    assert_close_outputs(ours, layers, 3e-2)


def test_gguf_file_with_an_override_and_with_yarn_keys(plain, tmp_path):
    """--rope-scaling on a GGUF file; and a GGUF whose keys state YaRN (rope.scaling.*), read as such."""
    ref = scaled_reference(plain, YARN, tmp_path)
    prompts = random_prompts(384, [9, 600])
    (tmp_path / "a").mkdir()
    overridden = load_model(ModelConfig(model=str(hf_to_gguf(plain, tmp_path / "a" / "plain.gguf")),
                                        dtype="float32", device="cpu", rope_scaling=YARN))
    assert_relative_close(flat_logits(overridden.model, prompts), reference_logits(ref, prompts))
    folder = make_tiny_checkpoint("llama", tmp_path / "yarn", rope_scaling=YARN)
    (tmp_path / "b").mkdir()
    stated = load_model(ModelConfig(model=str(hf_to_gguf(folder, tmp_path / "b" / "yarn.gguf")),
                                    dtype="float32", device="cpu"))
    assert stated.arch.rope_scaling["rope_type"] == "yarn"
    assert stated.arch.rope_scaling["original_max_position_embeddings"] == CONTEXT
    assert_relative_close(flat_logits(stated.model, prompts), reference_logits(ref, prompts))


@pytest.mark.parametrize("text,expected", [
    ("yarn:4", {"rope_type": "yarn", "factor": 4.0}),
    ("YARN:2.5:32768", {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 32768}),
    ("linear:2", {"rope_type": "linear", "factor": 2.0}),
    ('{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}',
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ('{"type": "linear", "factor": 3}', {"rope_type": "linear", "factor": 3}),
    ("auto", {"rope_type": "auto"}), (" AUTO ", {"rope_type": "auto"}),
])
def test_flag_spellings(text, expected):
    assert parse_rope_scaling(text) == expected
    assert engine_config(rope_scaling=text).model.rope_scaling == expected


@pytest.mark.parametrize("own,max_model_len,expected", [
    (None, 4 * CONTEXT, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT}),
    (None, 700, {"rope_type": "yarn", "factor": 700 / CONTEXT, "original_max_position_embeddings": CONTEXT}),
    (None, CONTEXT, None), (None, None, None),  # fits, or the model's own context: nothing to stretch
    # a YaRN of the model's own is stretched further over its own original context
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": CONTEXT // 2}, 4 * CONTEXT,
     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": CONTEXT // 2}),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": CONTEXT}, 4 * CONTEXT, "own"),
], ids=["x4", "x1.37", "fits", "unset", "own-yarn", "own-llama3"])
def test_auto_stretches_with_yarn_to_the_context_asked_for(own, max_model_len, expected):
    """`--rope-scaling auto` (what kvflow launch starts its server with): YaRN with the factor that reaches
    --max-model-len from the trained context; nothing where the context fits or the model scales otherwise."""
    arch = dataclasses.replace(_arch(16, 10000.0), rope_scaling=own)
    stretched = apply_rope_scaling(arch, parse_rope_scaling("auto"), max_model_len)
    if expected in (None, "own"):
        assert stretched == arch
        return
    assert stretched.rope_scaling == expected
    assert stretched.max_position_embeddings == max_model_len


def test_auto_stretches_a_loaded_model(plain):
    loaded = load_model(ModelConfig(model=str(plain), dtype="float32", device="cpu",
                                    rope_scaling=parse_rope_scaling("auto"), max_model_len=4 * CONTEXT))
    assert loaded.arch.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": CONTEXT}
    assert loaded.arch.max_position_embeddings == 4 * CONTEXT


@pytest.mark.parametrize("text,message", [
    ("dynamic:2", "type 'dynamic' is not supported"),
    ("yarn", "neither JSON nor TYPE:FACTOR"),
    ("yarn:four", "the factor must be a number"),
    ("yarn:0.5", "factor >= 1"),
    ('{"rope_type": "yarn"}', "factor >= 1"),
    ('{"rope_type": "yarn", "factor": 4, "orig_ctx": 8}', "unknown key(s) orig_ctx"),
    ('{"rope_type": "linear", "factor": 2, "beta_fast": 3}', "unknown key(s) beta_fast"),
    ('{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}', "positive integer"),
    ('{"rope_type": "yarn", "factor": "4"}', "factor must be a number"),
    ("{rope_type: yarn}", "not valid JSON"),
])
def test_bad_values_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=None) as info:
        parse_rope_scaling(text)
    assert message in str(info.value)
    with pytest.raises(ValueError):
        engine_config(rope_scaling=text)


def test_command_line_refuses_a_bad_value_before_loading():
    proc = subprocess.run([sys.executable, "-m", "kvflow", "serve", "--model", "/nonexistent",
                           "--rope-scaling", "ntk:2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--rope-scaling" in proc.stderr and "'ntk' is not supported" in proc.stderr
