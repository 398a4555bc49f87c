"""The fast CPU executor and its native decoder (executors/cpu_fast.py, csrc/decoder_forward.cpp).

Against the exact mode on the same packed weights, with 16-bit matmul inputs (the sixteen_bit fixture):
both multiply by the same packed weights with the same kernel and differ in how norms, rotary and SiLU
round and in the cache's dtype, so logits agree closely rather than bitwise, and greedy text agrees. The dense path (many-row steps on bfloat16 copies)
against the packed path: both round activations to bfloat16 differently, so again close logits and the
same greedy text. The fast mode's 8-bit inputs for batched decode and long prompts (executors/thresholds.py) are checked
on their own, against 16-bit inputs over the same prompt."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, assert_close_outputs, make_llm
from gguf_files import requantize
from hf_to_gguf import hf_to_gguf
from tiny_models import make_tiny_checkpoint

from kvflow import SamplingParams
from kvflow.config import ModelConfig
from kvflow.engine.request import Request, ScheduledSequence
from kvflow.executors import native_model
from kvflow.executors import plan as plan_module
from kvflow.executors.cpu_fast import CpuFastExecutor
from kvflow.executors.model_setup import load_model, make_bf16_copies
from kvflow.executors.native_model import NativeModel
from kvflow.executors.thresholds import ROW_THRESHOLDS, RowThresholds
from kvflow.kernels import abi, cpu_features, packed_matmul
from kvflow.layers.quant import PackedLinear, quantize_weight
from kvflow.layers.quant.packed_parts import PackedParts

# The native decoder needs the kernel library, which builds on every CPU tier but needs a C++ compiler.
pytestmark = pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler to build the kernels")
# oneDNN's bfloat16 matmul is emulated (about 200x slower) without AVX512-BF16 or AMX: the dense path's
# tests need one of them to finish in time.
needs_bf16 = pytest.mark.skipif(not {"avx512_bf16", "amx_bf16"} & cpu_features.cpu_flags(),
                                reason="needs native bfloat16 matmuls (AVX512-BF16 or AMX)")

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
DENSE_TOLERANCE = 0.4  # nats, from the float32 model's logprobs (see test_dense_many_row_steps_...)
LONG = ("The history of the Roman Empire began with the founding of the city and grew over centuries of war, "
        "trade and law. Historians still argue about why it fell, and the reasons they give include")


@pytest.fixture
def native_steps(monkeypatch) -> list[int]:
    """How many steps the native decoder runs from now on, and how many of them on the dense path."""
    counts = [0, 0]
    original = abi.native().kvflow_decoder_forward

    def counting(**kwargs):
        counts[0] += 1
        counts[1] += kwargs["dense"] is not None
        return original(**kwargs)

    monkeypatch.setattr(abi.native(), "kvflow_decoder_forward", counting)
    return counts


@pytest.fixture
def sixteen_bit_inputs(monkeypatch) -> None:
    """16-bit matmul inputs for every step of the executors made from now on, for the tests that hold the
    fast mode close to the exact mode or to float32 (neither quantizes inputs to 8 bits; on the AVX2 tier
    even a decode step of two sequences would take 8-bit ones)."""
    monkeypatch.setattr(RowThresholds, "eight_bit_min_rows", lambda self, tier: 0)


@pytest.fixture
def packed_matmuls_only(monkeypatch) -> None:
    """No bfloat16 weight copies in the models loaded from now on (as on a CPU without native bfloat16):
    every matmul of both the native decoder and the PyTorch layers runs on the packed kernel. For the tests
    that hold the two to one packed path; with copies (AMX), a prompt's steps round weights and activations
    to bfloat16 at different points on each side, a difference the dense tests bound on their own."""
    monkeypatch.setattr(plan_module, "bf16_copies_pay", lambda: False)


@pytest.fixture
def sixteen_bit(fast_loaded, sixteen_bit_inputs):
    """The fast mode's loaded default model, with 16-bit matmul inputs throughout."""
    return fast_loaded


@pytest.fixture(scope="module")
def dense_loaded():
    """The fast mode with the bfloat16 copies the plan makes where bfloat16 is native (AMX), made here
    whatever the CPU, so the dense path runs."""
    loaded = load_model(ModelConfig(device="cpu", max_model_len=4096))
    if loaded.native.dense_t is None:
        make_bf16_copies(loaded.model, ROW_THRESHOLDS.layers_dense_min_rows)
        loaded.native = NativeModel.for_model(loaded.model)
    return loaded


def test_fast_mode_runs_the_native_decoder(fast_loaded):
    assert fast_loaded.plan.executor == "cpu_fast"
    assert native_model.reason_unsupported(fast_loaded.model) is None
    assert isinstance(make_llm(fast_loaded).engine.runner.executor, CpuFastExecutor)


def test_same_greedy_text_and_close_logprobs_as_the_exact_mode(sixteen_bit, packed_loaded, native_steps):
    """Measured: logprobs within 9e-3 nats. The prompts' prefill (about 50 rows) goes through it too."""
    prompts = PROMPTS[:6]
    fast = make_llm(sixteen_bit).generate(prompts, PARAMS)
    assert native_steps[0] >= 24  # the prefill and every decode step
    exact = make_llm(packed_loaded).generate(prompts, PARAMS)
    assert_close_outputs(fast, exact, 3e-2)


def test_many_row_packed_steps_match_the_exact_mode(sixteen_bit, packed_loaded, native_steps):
    """Steps of 64 rows or more without bfloat16 copies: still the packed kernel, every row its own."""
    prompts = [LONG, LONG.replace("Roman", "Ottoman") + " the economy", "Hello " * 70]  # prefilled as one step
    fast = make_llm(sixteen_bit, enable_prefix_caching=False).generate(prompts, PARAMS)
    if sixteen_bit.native.dense_t is None:
        assert native_steps[1] == 0
    exact = make_llm(packed_loaded, enable_prefix_caching=False).generate(prompts, PARAMS)
    assert_close_outputs(fast, exact, 0.15 if sixteen_bit.native.dense_t is not None else 3e-2)


# Only AMX CPUs have the tile kernel; elsewhere the packed path attends row by row, as the other tests check.
@pytest.mark.skipif(cpu_features.machine_tier() != "amx", reason="the tile kernel needs AMX (amx_bf16)")
def test_a_short_chunk_deep_in_a_context_attends_on_tiles(sixteen_bit, packed_loaded, monkeypatch):
    """An agent's next turn: a few new rows over a cached context past prompt_tiles_min_context run on the
    packed path (fewer rows than the dense path's) with their attention on AMX tiles, the earlier steps row
    by row; the answer stays close to the exact mode's, within the bfloat16 paths' bound."""
    tiles = []
    original = abi.native().kvflow_decoder_forward
    monkeypatch.setattr(abi.native(), "kvflow_decoder_forward",
                        lambda **k: tiles.append((k["rows"], k["prompt_tiles"])) or original(**k))
    context = LONG * 30  # about 1,200 tokens
    follow_up = [context, context + " In the end, the empire"]
    fast_llm, exact_llm = make_llm(sixteen_bit), make_llm(packed_loaded)
    fast = [fast_llm.generate([p], PARAMS)[0] for p in follow_up]  # the second finds the first's blocks
    exact = [exact_llm.generate([p], PARAMS)[0] for p in follow_up]
    chunk_rows = len(fast[1].prompt_token_ids) - fast[1].metrics.num_cached_tokens
    assert 1 < chunk_rows < ROW_THRESHOLDS.native_dense_min_rows
    assert (chunk_rows, 1) in tiles  # the follow-up's chunk, on tiles
    assert all(flag == 0 for rows, flag in tiles if rows == 1)  # decode steps row by row
    assert_close_outputs(fast, exact, 0.15)


def prompt_log_probs(llm, token_ids: list[int], eight_bit: bool) -> torch.Tensor:
    """Teacher-forced: log-probabilities at every position of one prompt, prefilled as one native step
    with 8-bit or 16-bit matmul inputs."""
    executor = llm.engine.runner.executor
    executor.eight_bit_min_rows = executor.eight_bit_prompt_min_rows = 1 if eight_bit else 0
    blocks = list(range(-(-len(token_ids) // llm.engine.runner.block_size)))
    seq = ScheduledSequence(Request("r", token_ids, SamplingParams()), 0, len(token_ids), blocks, True)
    inputs = llm.engine.runner.prepare([seq])
    inputs.logits_indices = torch.arange(len(token_ids))
    return torch.log_softmax(executor.execute(inputs), dim=-1)


def test_eight_bit_inputs_keep_the_predictions(fast_loaded):
    """The same prompt prefilled with 8-bit and with 16-bit matmul inputs (the 8-bit step error is 2^-8 of
    each block's largest input, as llama.cpp's q8 activations): at nearly every position the same most
    likely next token, and its log-probability close. Measured (Zen 4, every tier alike, since the
    kernels are bitwise equal): argmax agreement 1.0 over 190 positions, mean gap 0.02 nats."""
    llm = make_llm(fast_loaded)
    llm.generate(["hello"], SamplingParams(max_tokens=1))  # binds this engine's cache
    ids = fast_loaded.tokenizer.encode(" ".join([LONG] * 4))[:190]
    sixteen, eight = prompt_log_probs(llm, ids, False), prompt_log_probs(llm, ids, True)
    top = sixteen.argmax(-1)
    agree = (eight.argmax(-1) == top).float().mean().item()
    gap = (eight.gather(1, top[:, None]) - sixteen.gather(1, top[:, None])).abs().mean().item()
    print(f"argmax agreement {agree:.3f}, mean gap {gap:.4f} nats")
    assert agree >= 0.95 and gap < 0.05, (agree, gap)
    assert not torch.equal(eight, sixteen)  # the 8-bit path really ran


def test_chat_answers_paris(fast_loaded):
    out = make_llm(fast_loaded).chat([{"role": "user", "content": "What is the capital of France?"}],
                                     SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text, (out[0].outputs[0].text, torch.get_num_threads())


def test_float_model_is_not_taken(default_loaded):
    assert "not packed" in native_model.reason_unsupported(default_loaded.model)
    assert default_loaded.plan.executor == "cpu_exact"


def test_bad_positions_and_token_ids_are_refused_before_any_write(fast_loaded):
    llm = make_llm(fast_loaded)
    llm.generate(["hello"], SamplingParams(max_tokens=1))  # binds this engine's cache
    executor = llm.engine.runner.executor
    k_cache = executor.kv_caches[0][0]
    before = k_cache.clone()
    inputs = llm.engine.runner.prepare([_one_token_sequence(llm)])
    inputs.positions[0] = fast_loaded.model.rotary.cos.shape[0]
    with pytest.raises(ValueError, match="past the model's context"):
        executor.execute(inputs)
    inputs = llm.engine.runner.prepare([_one_token_sequence(llm)])
    inputs.input_ids[0] = fast_loaded.arch.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        executor.execute(inputs)
    assert torch.equal(k_cache, before)


def _one_token_sequence(llm):
    return ScheduledSequence(Request("r", [5], SamplingParams()), 0, 1, [0], True)


def generate_without_native(loaded, prompts, **options):
    """The same loaded weights through the PyTorch layers (which use the bfloat16 copies too, from 32 rows)."""
    saved, loaded.native = loaded.native, None
    try:
        return make_llm(loaded, **options).generate(prompts, PARAMS)
    finally:
        loaded.native = saved


def deviation(a_outs, b_outs) -> tuple[float, float]:
    """(largest logprob gap over every step's shared top tokens, mean gap of the chosen tokens), for
    outputs whose greedy tokens agree."""
    gaps, chosen = [0.0], []
    for a, b in zip(a_outs, b_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            gaps += [abs(lp_a[t].logprob - lp_b[t].logprob) for t in lp_a.keys() & lp_b.keys()]
            chosen.append(abs(lp_a[token].logprob - lp_b[token].logprob))
    return max(gaps), sum(chosen) / len(chosen)


@needs_bf16
@pytest.mark.usefixtures("sixteen_bit_inputs")
@pytest.mark.parametrize("chunk", [2048, 64], ids=["whole prompts", "chunks of 64 over cached context"])
def test_dense_many_row_steps_stay_as_close_to_float32_as_the_pytorch_layers(dense_loaded, default_loaded,
                                                                            native_steps, chunk):
    """Both multiply the same bfloat16 copies, with activations rounded to bfloat16 before each matmul, and
    differ in how norms, rotary, SiLU and attention round (the C++ side in one pass, PyTorch op by op):
    a last-bit difference flips a bfloat16 rounding now and then, so the two drift apart about as far as
    each sits from float32. Against the float32 model (default_loaded): the same greedy text, every top
    logprob within DENSE_TOLERANCE, and the chosen tokens' logprobs on average as close as the PyTorch
    layers'. Measured (Zen 4, AVX512-BF16): largest gaps 0.07 to 0.27 (dense) and 0.11 (layers); mean
    gap of the chosen tokens 0.005 for both."""
    prompts = [LONG, LONG.replace("Roman", "Ottoman") + " the economy", "Hello " * 70, " ".join([LONG] * 4)]
    options = dict(enable_prefix_caching=False, max_num_batched_tokens=chunk)
    dense = make_llm(dense_loaded, **options).generate(prompts, PARAMS)
    assert native_steps[1] >= (1 if chunk > 64 else 3)
    layers = generate_without_native(dense_loaded, prompts, **options)
    exact = make_llm(default_loaded, **options).generate(prompts, PARAMS)
    (dense_max, dense_mean), (_, layers_mean) = deviation(dense, exact), deviation(layers, exact)
    assert dense_max < DENSE_TOLERANCE
    assert dense_mean <= 1.5 * layers_mean + 2e-3, (dense_mean, layers_mean)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3_longrope", "mistral_window", "qwen3_moe", "mixtral",
                                  "gemma2", "gemma3", "gpt_oss"])
@pytest.mark.usefixtures("sixteen_bit_inputs", "packed_matmuls_only")
def test_bias_and_head_norms_against_the_pytorch_layers(tiny_checkpoints, arch, native_steps, tmp_path):
    """Qwen2's q/k/v bias, Qwen3's per-head q/k norms, LongRoPE's scaled rotary table, a sliding window
    on every layer, mixtures of experts (Qwen3-MoE with a dense layer, without renormalized weights;
    Mixtral with them), and Gemma (GeGLU, four norms a layer, the scaled embedding, sliding-window layers
    beside global ones in KV groups of their own, Gemma 2's soft-caps, Gemma 3's local rotary), and gpt-oss
    (sinks, o's bias, a biased router, biased experts with the clamped SwiGLU, YaRN) (int4-packed
    tiny models: a float32 embedding table and a float output head, which the executor applies after the
    native call). 16-bit inputs throughout, as the PyTorch layers'."""
    folder = (make_tiny_checkpoint("mistral", tmp_path / "m", sliding_window=24) if arch == "mistral_window"
              else tiny_checkpoints[arch])
    loaded = load_model(ModelConfig(model=str(folder), device="cpu", quantization="int4"))
    assert loaded.native is not None and not loaded.native.head_packed
    prompts = [{"prompt_token_ids": list(range(3, 3 + 90))}, {"prompt_token_ids": list(range(200, 270))}]
    ours = make_llm(loaded, kv_cache_memory=16 << 20).generate(prompts, PARAMS)
    assert native_steps[0] >= 24
    theirs = generate_without_native(loaded, prompts, kv_cache_memory=16 << 20)
    assert_close_outputs(ours, theirs, 3e-2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.usefixtures("sixteen_bit_inputs")
def test_native_experts_do_not_depend_on_the_batch(tiny_checkpoints, native_steps, arch):
    """The native decoder's MoE layers (csrc/moe_mlp.cpp) choose and sum a row's experts from that row
    alone, and the grouped expert matmuls compute each row on its own: prompts alone, batched together and
    prefilled 16 tokens at a time give the same greedy tokens, and logprobs that differ only by the float
    output head's rounding (PyTorch's float32 matmul rounds by the rows in the call: 1e-5)."""
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints[arch]), device="cpu", quantization="int4"))
    assert loaded.native is not None and loaded.native.dense_t is None
    prompts = [{"prompt_token_ids": list(range(3 + i, 50 + 9 * i))} for i in range(4)]
    alone = [make_llm(loaded, kv_cache_memory=16 << 20).generate([p], PARAMS)[0] for p in prompts]
    steps_alone = native_steps[0]
    together = make_llm(loaded, kv_cache_memory=16 << 20, max_num_batched_tokens=16,
                        enable_prefix_caching=False).generate(prompts, PARAMS)
    assert native_steps[0] - steps_alone >= 24 and native_steps[1] == 0
    assert_close_outputs(alone, together, 1e-5, ties=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bf16_copies_only_where_the_native_decoder_multiplies_them(tiny_checkpoints, monkeypatch, arch):
    """Where the copies pay (AMX), a dense model gets them and the native decoder's many-row steps use
    them; a mixture of experts runs natively on the packed kernel alone (the dense path has no experts),
    so it gets none: they would cost memory, and make its PyTorch layers round unlike its native steps."""
    monkeypatch.setattr(plan_module, "bf16_copies_pay", lambda: True)
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints[arch]), device="cpu", quantization="int4"))
    copies = [name for name, m in loaded.model.named_modules()
              if getattr(m, "weight_bf16", None) is not None or getattr(m, "dense_bf16", None) is not None]
    assert loaded.native is not None
    if arch == "llama":
        assert copies and loaded.native.dense_t is not None
    else:
        assert not copies and loaded.native.dense_t is None


@pytest.mark.usefixtures("sixteen_bit_inputs")
def test_a_packed_router_routes_as_the_pytorch_layers(tiny_checkpoints, native_steps):
    """A quantized file's router (a PackedLinear; llama.cpp keeps routers float, other writers may not):
    the native decoder multiplies it with 16-bit inputs, as PackedLinear does, so both pick the same
    experts and give the same greedy text."""
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["qwen3_moe"]), device="cpu", quantization="int4"))
    moe_layers = [layer.mlp for layer in loaded.model.layers if hasattr(layer.mlp, "experts")]
    assert moe_layers
    for mlp in moe_layers:  # Q4_1-like codes: float16 scales and offsets, as a file has them
        bq = quantize_weight(mlp.gate.weight, "int4", 32)
        bq.scale, bq.offset = bq.scale.half().float(), bq.offset.half().float()
        mlp.gate = PackedLinear(bq)
    loaded.native = NativeModel.for_model(loaded.model)
    assert loaded.native is not None and loaded.native._moe
    prompts = [{"prompt_token_ids": list(range(3, 3 + 60))}, {"prompt_token_ids": list(range(150, 190))}]
    ours = make_llm(loaded, kv_cache_memory=16 << 20).generate(prompts, PARAMS)
    assert native_steps[0] >= 24
    theirs = generate_without_native(loaded, prompts, kv_cache_memory=16 << 20)
    assert_close_outputs(ours, theirs, 3e-2)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.usefixtures("sixteen_bit_inputs")
def test_gemma_file_with_a_packed_head_against_the_pytorch_layers(arch, native_steps, tmp_path, monkeypatch):
    """A Gemma GGUF file re-quantized to Q8_0 (as llama.cpp's converter lays it out): the tied head packed,
    so the native decoder computes the logits and the executor soft-caps them (Gemma 2) as the model does.
    Then prompts prefilled natively and decoded by the PyTorch layers: each reads the K/V the other wrote,
    which holds only where the native decoder keeps each KV group's slots and block tables."""
    folder = make_tiny_checkpoint(arch, tmp_path / arch, **({"query_pre_attn_scalar": 16} if arch == "gemma2" else {}))
    q8 = requantize(hf_to_gguf(folder, tmp_path / f"{arch}.gguf"), tmp_path / "q8.gguf",
                    lambda name: "Q8_0" if name.endswith(".weight") else None)
    loaded = load_model(ModelConfig(model=str(q8), device="cpu", max_model_len=512))
    assert loaded.native is not None and loaded.native.head_packed
    assert (loaded.native.final_softcap > 0) == (arch == "gemma2")
    prompts = [{"prompt_token_ids": list(range(3, 3 + 90))}, {"prompt_token_ids": list(range(200, 270))}]
    ours = make_llm(loaded, kv_cache_memory=16 << 20).generate(prompts, PARAMS)
    assert native_steps[0] >= 24
    theirs = generate_without_native(loaded, prompts, kv_cache_memory=16 << 20)
    assert_close_outputs(ours, theirs, 3e-2)

    execute = CpuFastExecutor.execute

    def prompts_natively(self, inputs):
        if inputs.input_ids.shape[0] > inputs.num_decode_rows:
            return execute(self, inputs)
        saved, self.native = self.native, None
        try:
            return execute(self, inputs)
        finally:
            self.native = saved

    monkeypatch.setattr(CpuFastExecutor, "execute", prompts_natively)
    mixed = make_llm(loaded, kv_cache_memory=16 << 20).generate(prompts, PARAMS)
    assert_close_outputs(mixed, theirs, 3e-2)


@needs_bf16
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_prompts_on_the_dense_path_against_the_pytorch_layers(tiny_checkpoints, arch, native_steps):
    """Gemma's output norms on the dense path (bfloat16 matmul outputs normed in float32 before the
    residual add): a 90-row prompt step natively on bfloat16 copies and through the PyTorch layers on the
    same copies give the first token's top logprobs within bfloat16's rounding (0.1 nats)."""
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints[arch]), device="cpu", quantization="int4"))
    make_bf16_copies(loaded.model, ROW_THRESHOLDS.layers_dense_min_rows)
    loaded.native = NativeModel.for_model(loaded.model)
    assert loaded.native.dense_t is not None
    prompts = [{"prompt_token_ids": list(range(3, 3 + 90))}, {"prompt_token_ids": list(range(200, 290))}]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    options = dict(kv_cache_memory=16 << 20, enable_prefix_caching=False)
    ours = make_llm(loaded, **options).generate(prompts, params)
    assert native_steps[1] >= 1
    saved, loaded.native = loaded.native, None
    try:
        theirs = make_llm(loaded, **options).generate(prompts, params)
    finally:
        loaded.native = saved
    for a, b in zip(ours, theirs):
        lp_a, lp_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = lp_a.keys() & lp_b.keys()
        assert len(shared) >= 3
        assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in shared) < 0.1


@pytest.mark.usefixtures("sixteen_bit_inputs", "packed_matmuls_only")
def test_fused_projections_of_two_types_against_the_pytorch_layers(native_steps, tmp_path):
    """A file whose v and up are Q6_K beside Q8_0 q, k and gate (as a Q4_K_M file's are beside Q4_K): each
    fused projection runs as two packed weights in their own types (layers/quant/packed_parts.py), which
    the native decoder multiplies into one row of outputs (KvflowDecoderLayer.qkv_rest, gate_up_rest)."""
    folder = make_tiny_checkpoint("llama", tmp_path / "llama", hidden_size=256, intermediate_size=256)
    six = (".attn_v.", ".ffn_up.")
    mixed = requantize(hf_to_gguf(folder, tmp_path / "f32.gguf"), tmp_path / "mixed.gguf",
                       lambda name: ("Q6_K" if any(s in name for s in six) else "Q8_0") if "blk." in name else None)
    loaded = load_model(ModelConfig(model=str(mixed), device="cpu", max_model_len=512))
    attention, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    assert isinstance(attention.qkv_proj, PackedParts) and isinstance(mlp.gate_up_proj, PackedParts)
    assert loaded.native is not None
    prompts = [{"prompt_token_ids": list(range(3, 3 + 60))}, {"prompt_token_ids": list(range(150, 190))}]
    ours = make_llm(loaded, kv_cache_memory=16 << 20).generate(prompts, PARAMS)
    assert native_steps[0] >= 24
    theirs = generate_without_native(loaded, prompts, kv_cache_memory=16 << 20)
    assert_close_outputs(ours, theirs, 3e-2)
