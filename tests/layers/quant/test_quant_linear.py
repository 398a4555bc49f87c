"""The packed layers against float references built from the same GGUF bytes, for both kernels.

"torch" (Int4Linear, Int8BlockLinear on PyTorch's int4 kernel): bfloat16 activations (relative 2^-9 each),
each group's scale and zero in bfloat16, float32 sums, output rounded to bfloat16 (2^-9). "packed"
(PackedLinear, kvflow's VNNI kernel): the GGUF's own codes and float16 scales, inputs quantized to 16-bit
integers per block (2^-16 of the block's largest), float32 output. Both prefill paths multiply a bfloat16
copy of the weights. Measured max |y - y_ref| / max |y_ref| is 0.002 to 0.005 (torch) and 2e-5 (packed
kernel) here; we assert 1e-2 for every path, and 1e-4 for the packed kernel.
"""

import gguf
import numpy as np
import pytest
import torch

from kvflow.kernels import packed_matmul
from kvflow.layers.quant import Int4Linear, Int8BlockLinear, PackedLinear, build_quant_linear, from_gguf
from kvflow.layers.quant.factory import UnpackableCodes
from kvflow.layers.quant.packed_parts import PackedParts
from kvflow.layers.quant.packing import round_scales_to_f16

RTOL_Y = 1e-2
RTOL_PACKED_KERNEL = 1e-4
# The packed kernel builds for every CPU tier but needs a C++ compiler; CI's machines have one.
needs_packed_kernel = pytest.mark.skipif(not packed_matmul.available(), reason="kvflow's packed kernel needs a C++ compiler")
KERNELS = ["torch", pytest.param("packed", marks=needs_packed_kernel)]


@pytest.fixture(params=KERNELS)
def kernel(request):
    return request.param


def make_layer(qtype: str, n: int = 200, k: int = 576, seed: int = 0, kernel: str = "torch", **kw):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.02, 0.2, (n, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)))
    layer = build_quant_linear(from_gguf(raw, qtype), kernel=kernel, **kw)
    assert isinstance(layer, PackedLinear) == (kernel == "packed")
    return layer, ref


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_kernel_weights_match_gguf(qtype, kernel):
    """The weights the int kernel multiplies by, read back through an identity input."""
    layer, ref = make_layer(qtype, kernel=kernel)
    k = layer.in_features
    w_kernel = layer.kernel_mm(torch.eye(k, dtype=torch.bfloat16))[:, : layer.out_features].t().float()
    group_max = ref.view(ref.shape[0], -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(ref.shape)
    # bf16 scale/zero (2^-9 each, times |q - 8| <= 8 for the scale) plus the bf16 output: < 2^-6 of the group max.
    assert ((w_kernel - ref).abs() <= 2**-6 * group_max).all()
    assert ((layer.dequantize() - ref).abs() <= 2**-6 * group_max).all()  # the prefill path's bf16 copy
    if kernel == "packed":  # the file's own weights: a one-hot input quantizes exactly to +-1
        assert torch.equal(layer.dequantize(), ref)
        assert ((w_kernel - ref).abs() <= 1e-6 * group_max).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
def test_forward_matches_float_reference(qtype, rows, kernel):
    if qtype == "Q5_1" and kernel == "torch":
        # Q5_1's free offset would become a bfloat16 zero point in PyTorch's int4 kernel (a bias in every
        # weight of a block): the layer is refused, and the loader keeps such weights float.
        with pytest.raises(UnpackableCodes, match="Q5_1"):
            make_layer(qtype, kernel=kernel)
        return
    layer, ref = make_layer(qtype, kernel=kernel)
    x = torch.randn(rows, layer.in_features)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 200)
    assert rel_err(y, x.double() @ ref.double().t()) < RTOL_Y
    if kernel == "packed" and rows <= layer.max_kernel_rows:
        assert rel_err(y, x.double() @ ref.double().t()) < RTOL_PACKED_KERNEL
        bound = layer.error_bound(x)
        assert ((y.double() - x.double() @ ref.double().t()).abs() <= bound).all()
    yb = layer(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and rel_err(yb, x.double() @ ref.double().t()) < RTOL_Y


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_kernel_and_prefill_paths_agree_and_tiling_is_invisible(qtype, kernel):
    layer, _ = make_layer(qtype, n=1000, kernel=kernel)
    x = torch.randn(8, layer.in_features)
    kernel = layer(x)
    layer.max_kernel_rows = 0
    whole = layer(x)
    layer.tile_bytes = 1  # one 64-row tile at a time, and a ragged last tile
    tiled = layer(x)
    assert rel_err(whole, kernel) < RTOL_Y
    assert rel_err(tiled, whole) < 1e-3
    layer.cache_dense_bf16()
    assert rel_err(layer(x), whole) < 1e-3


def test_leading_dims_and_bias(kernel):
    layer, ref = make_layer("Q4_1", bias=torch.linspace(-1, 1, 200), kernel=kernel)
    x = torch.randn(2, 3, layer.in_features)
    y = layer(x)
    assert y.shape == (2, 3, 200)
    assert rel_err(y, x.double() @ ref.double().t() + torch.linspace(-1, 1, 200).double()) < RTOL_Y


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_embedding_rows(qtype, kernel):
    ids = torch.tensor([[0, 5, 63], [64, 130, 199]])
    exact, ref = make_layer(qtype, exact_rows=True, kernel=kernel)
    assert torch.equal(exact.embedding(ids), ref[ids])
    packed_only, _ = make_layer(qtype, kernel=kernel)
    assert isinstance(packed_only, (Int4Linear, Int8BlockLinear, PackedLinear))
    group_max = ref[ids].abs().amax(-1, keepdim=True)
    assert ((packed_only.embedding(ids) - ref[ids]).abs() <= 2**-6 * group_max).all()


def test_packed_size_is_what_we_promise(kernel):
    q4, _ = make_layer("Q4_1", n=256, k=512, kernel=kernel)
    q8, _ = make_layer("Q8_0", n=256, k=512, kernel=kernel)
    weights = 256 * 512
    assert q4.nbytes() == weights // 2 + weights // 32 * 4  # nibbles + 16-bit scale and zero per group
    if kernel == "torch":
        assert q8.nbytes() == weights + weights // 32 * 8  # two nibble halves, each with scale and zero
    else:
        assert q8.nbytes() == weights + weights // 32 * 2  # bytes + a float16 scale per group (offset -128 scale)
        q4_0, _ = make_layer("Q4_0", n=256, k=512, kernel=kernel)
        assert q4_0.nbytes() == weights // 2 + weights // 32 * 2  # the file's own 4.5 bits a weight


# type: (block bytes, where its float16 d (and dmin) sit, blocks per row)
RANDOM_BLOCK_TYPES = {"Q4_K": (144, slice(0, 4), 3), "Q5_K": (176, slice(0, 4), 3), "IQ4_NL": (18, slice(0, 2), 18),
                      "Q6_K": (210, slice(208, 210), 3), "Q3_K": (110, slice(108, 110), 3),
                      "Q2_K": (84, slice(80, 84), 3), "IQ4_XS": (136, slice(0, 2), 3)}


def random_blocks(qtype: str, n: int, seed: int) -> np.ndarray:
    """[n, bytes] of random blocks with finite float16 scales of about 0.01."""
    size, halves, per_row = RANDOM_BLOCK_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, per_row, size), dtype=np.uint8)
    count = (halves.stop - halves.start) // 2
    raw[..., halves] = rng.uniform(-0.01, 0.01, (n, per_row, count)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@needs_packed_kernel  # gguf_linear picks the packed kernel; without a compiler there is none to test
@pytest.mark.parametrize("qtype", RANDOM_BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_k_quants_and_iq4_run_on_the_packed_kernel(qtype, rows):
    """Random blocks (gguf has no quantizer for these): the layer gguf_linear builds is packed, and its
    output matches the float product with its own weights (the K-quants' scales rounded to float16)
    within the kernel's bound."""
    from kvflow.layers.quant import gguf_linear

    layer = gguf_linear([(random_blocks(qtype, 64, 4), qtype)])
    assert isinstance(layer, PackedLinear)
    assert layer.packed.group == (16 if qtype in ("Q6_K", "Q3_K", "Q2_K") else 32)
    if qtype.startswith("IQ4"):  # 4-bit indices into IQ4_NL's codebook and a float16 scale: 4.5 bits a weight
        assert (layer.packed.bits, layer.packed.codebook) == (4, 1)
        assert layer.nbytes() * 8 == layer.in_features * layer.out_features * 4.5
    w = layer.dequantize().float()
    x = torch.randn(rows, layer.in_features)
    y = layer(x)
    assert rel_err(y, x.double() @ w.double().t()) < RTOL_PACKED_KERNEL


@needs_packed_kernel  # gguf_linear picks the packed kernel; without a compiler there is none to test
def test_mxfp4_runs_on_the_packed_kernel_as_indices_with_the_files_weights():
    """MXFP4 (gpt-oss's experts): E2M1 values and a power-of-two scale per 32, held as 4-bit indices into its
    codebook with the scale in float16 (exact: a power of two float16 holds), so the layer multiplies by
    exactly the weights gguf's dequantizer gives, 4.5 bits a weight."""
    from kvflow.layers.quant import gguf_linear

    w = np.random.default_rng(6).standard_normal((48, 512)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    layer = gguf_linear([(raw, "MXFP4")])
    assert isinstance(layer, PackedLinear) and (layer.packed.bits, layer.packed.codebook) == (4, 2)
    exact = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4))
    assert torch.equal(layer.dequantize(), exact)
    x = torch.randn(5, 512)
    assert rel_err(layer(x), x.double() @ exact.double().t()) < RTOL_PACKED_KERNEL
    assert torch.equal(layer.exact_top(x).argmax(-1), (x.double() @ exact.double().t()).argmax(-1))


@needs_packed_kernel  # gguf_linear picks the packed kernel; without a compiler there is none to test
def test_a_fused_layer_of_group_32_and_group_16_parts_keeps_each_parts_weights():
    """Q4_K_M files put a Q6_K v beside a Q4_K q and k: each part keeps its own type's layout, side by side
    (layers/quant/packed_parts.py), with exactly the weights each has alone: the Q4_K part its own scales,
    the Q6_K part its scales rounded to float16. (Fused, both would be 6-bit codes in blocks of 16.)"""
    from kvflow.layers.quant import gguf_linear

    parts = [(random_blocks("Q4_K", 64, 6), "Q4_K"), (random_blocks("Q6_K", 32, 7), "Q6_K")]
    layer = gguf_linear(parts)
    assert isinstance(layer, PackedParts)
    assert [(p.packed.bits, p.packed.group) for p in layer.parts] == [(4, 32), (6, 16)]
    alone = torch.cat([from_gguf(parts[0][0], "Q4_K").dequantize(),
                       round_scales_to_f16(from_gguf(parts[1][0], "Q6_K")).dequantize()])
    assert torch.equal(layer.dequantize(), alone)


def test_blocks_of_16_are_refused_by_the_torch_kernels():
    bq = from_gguf(random_blocks("Q6_K", 16, 8), "Q6_K")
    with pytest.raises(UnpackableCodes, match="groups of 16"):
        build_quant_linear(round_scales_to_f16(bq), kernel="torch")


@needs_packed_kernel  # gguf_linear picks the packed kernel; without a compiler there is none to test
def test_a_fused_layer_of_4_and_8_bit_parts_is_packed_as_8_bit():
    """Q4_K_M and Q3_K_M files mix widths inside q/k/v (a 4-bit q beside a Q5_0 k): parts in three layouts
    (4-bit Q4_0, 6-bit Q5_0, 8-bit Q8_0) are held as one 8-bit layer, with exactly the parts' weights. (Two
    layouts would stay two packed weights: layers/quant/packed_parts.py.)"""
    from kvflow.layers.quant import gguf_linear

    rng = np.random.default_rng(5)
    parts, refs = [], []
    for qtype, n in (("Q4_0", 64), ("Q5_0", 32), ("Q8_0", 32)):
        raw = gguf.quants.quantize(rng.standard_normal((n, 256)).astype(np.float32),
                                   getattr(gguf.GGMLQuantizationType, qtype))
        parts.append((raw, qtype))
        refs.append(torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))))
    layer = gguf_linear(parts)
    assert isinstance(layer, PackedLinear) and layer.packed.bits == 8
    assert torch.equal(layer.dequantize(), torch.cat(refs))
