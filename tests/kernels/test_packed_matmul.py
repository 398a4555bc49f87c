"""kvflow's packed matmul kernel (kernels/packed_matmul): its byte layout, accuracy, stated error bound,
and row independence across row counts (VNNI for few rows, AMX int8 tiles for more) and thread counts."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import packed_matmul, packed_weight
from kvflow.layers.quant import BlockQuant, PackedLinear, quantize_weight

# The kernel builds for every CPU tier but needs a C++ compiler; CI's machines have one.
pytestmark = pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler to build the kernels")


def parts(bq: BlockQuant) -> tuple:
    return bq.q, bq.scale, bq.offset, bq.group_size, bq.bits, bq.centre, bq.codebook


def pack(bq: BlockQuant) -> packed_weight.PackedWeight:
    return packed_weight.pack(*parts(bq))


LAYOUTS = [4, 6, 8, "IQ4_NL", "MXFP4"]  # code widths, and the codebook types (4-bit indices)
BOOKS = {"IQ4_NL": 1, "MXFP4": 2}


def codes(bits: int | str, n: int, k: int, seed: int = 0) -> BlockQuant:
    """GGUF-like codes: float16 scales (Q4_1-style offsets for 4 bits, Q6_K's -32 d for 6 (stored), Q8_0's
    -128 d for 8); for a codebook type, random entries of its codebook centred on 128 (MXFP4's scales powers
    of two)."""
    g = torch.Generator().manual_seed(seed)
    if bits in BOOKS:
        book = BOOKS[bits]
        q = packed_weight.CODEBOOKS[book][torch.randint(0, 16, (n, k), generator=g)]
        if bits == "MXFP4":
            scale = torch.ldexp(torch.ones(n, k // 32), -torch.randint(5, 9, (n, k // 32), generator=g))
        else:
            scale = (torch.rand(n, k // 32, generator=g) * 0.002).half().float()
        return BlockQuant(q, scale, -128.0 * scale, 32, 8, 128, book)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    bq = quantize_weight(w, "int4" if bits == 4 else "int8", 32)
    if bits == 6:  # the 8-bit codes' top six bits, four times the step
        bq = BlockQuant(bq.q >> 2, bq.scale * 4, bq.offset, 32, 6)
    bq.scale = bq.scale.half().float()
    bq.offset = {4: bq.offset.half().float(), 6: -32.0 * bq.scale, 8: -128.0 * bq.scale}[bits]
    return bq


@pytest.mark.parametrize("bits", LAYOUTS)
@pytest.mark.parametrize(("n", "k"), [(100, 64), (960, 576), (576, 1536)])
def test_layout_round_trip_and_accuracy(bits, n, k):
    bq = codes(bits, n, k)
    pw = pack(bq)
    assert pw.bits == (4 if bits in BOOKS else bits)  # a codebook type: 4.5 bits a weight, not 8.5
    assert torch.equal(packed_weight.dequantize(pw), bq.dequantize())  # the file's weights, bit for bit
    rows = torch.tensor([0, 17, n - 1])
    assert torch.equal(packed_weight.dequantize(pw, rows), bq.dequantize()[rows])
    x = torch.randn(5, k)
    ref = x.double() @ bq.dequantize().double().t()
    y = packed_matmul.matmul(x, pw)
    # Inputs quantized to 16-bit integers per block: measured 2e-5 of the output's range.
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-4
    bound = PackedLinear(bq).error_bound(x)
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("bits", LAYOUTS)
# 200 x 576: VNNI below 16 rows, AMX int8 tiles from 16 where the CPU has them; on one thread at one row.
# 960 x 576: the same paths, split across threads already at one row (a layer's qkv projection). 2048 x 64:
# a wide, shallow matrix like the output head, on tiles 8 rows high at 8 rows and 16 high from 16.
@pytest.mark.parametrize(("n", "k"), [(200, 576), (960, 576), (2048, 64)])
def test_rows_do_not_depend_on_the_batch_or_threads(bits, n, k):
    bq = codes(bits, n, k, seed=1)
    pw = pack(bq)
    x = torch.randn(37, k)
    single = torch.cat([packed_matmul.matmul(x[i : i + 1], pw) for i in range(37)])  # VNNI, one row
    for m in (3, 8, 16, 37):
        assert torch.equal(packed_matmul.matmul(x[:m], pw), single[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed_matmul.matmul(x, pw), single)
    finally:
        torch.set_num_threads(threads)


def test_zero_rows_and_strided_input():
    bq = codes(4, 48, 64)
    pw = pack(bq)
    x = torch.randn(4, 128)[:, :64]  # rows with a stride of 128
    assert torch.equal(packed_matmul.matmul(x, pw), packed_matmul.matmul(x.contiguous(), pw))
    assert torch.equal(packed_matmul.matmul(torch.zeros(2, 64), pw), torch.zeros(2, 48))
    assert packed_matmul.matmul(torch.zeros(0, 64), pw).shape == (0, 48)


def test_codes_it_cannot_keep_exactly_are_refused():
    bq = codes(4, 32, 64)
    assert packed_weight.can_pack(*parts(bq))
    inexact = BlockQuant(bq.q, bq.scale * (1 + 2**-20), bq.offset, 32, 4)  # scales not float16 values
    wide = quantize_weight(torch.randn(32, 128), "int8", 64)
    eight_in_six = BlockQuant(codes(8, 32, 64).q | 0x80, bq.scale, bq.offset, 32, 6)  # codes past 63
    iq4 = codes("IQ4_NL", 32, 64)
    off_the_book = BlockQuant(iq4.q ^ 1, iq4.scale, iq4.offset, 32, 8, 128, 1)  # codes not in the codebook
    for bad in (inexact, wide, eight_in_six, off_the_book):
        assert not packed_weight.can_pack(*parts(bad))
        with pytest.raises(ValueError, match="groups of 32"):
            pack(bad)
    with pytest.raises(ValueError, match="float32"):
        packed_matmul.matmul(torch.randn(2, 64, dtype=torch.float64), pack(bq))


@pytest.mark.parametrize("bits", LAYOUTS)
def test_exact_top_gives_the_exact_argmax(bits):
    """Outputs within two error bounds of a row's largest are recomputed from the codes in double: the
    argmax, and those values, are the exact product's; the others stay within the bound."""
    bq = codes(bits, 3000, 576, seed=2)
    layer = PackedLinear(bq)
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ bq.dequantize().double().t()
    fast = packed_matmul.matmul(x, layer.packed)
    y = layer.exact_top(x)
    assert torch.equal(y.argmax(-1), exact.argmax(-1))
    # Each row's best is the exact product's (rounded once to float32); "it changed" would be no test of
    # that, since the kernel's value can already equal it (a random input once made that fail).
    best, rows = exact.argmax(-1), torch.arange(6)
    assert torch.equal(y[rows, best], exact[rows, best].float())
    changed = y != fast
    assert torch.equal(y[changed], exact[changed].float())
    assert ((y.double() - exact).abs() <= layer.error_bound(x)).all()


@pytest.mark.parametrize("bits", LAYOUTS)
def test_block_abs_sum_is_the_largest_row_sum_of_each_block(bits):
    """The weight statistic behind exact_top's bound, from the codes in C++: per block of inputs, the
    largest sum of |w| over the output rows (here against the dequantized rows summed in double)."""
    pw = pack(codes(bits, 300, 576, seed=4))
    w = packed_weight.dequantize(pw).abs().double()
    want = w.view(300, -1, pw.group).sum(-1).amax(0).float()
    assert torch.allclose(packed_matmul.block_abs_sum(pw), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shared_input", [True, False])
def test_many_one_row_matmuls_in_one_call_are_each_a_matmul(shared_input):
    """matmul_many (a decode token's experts): each row bitwise the single matmul's, with one input for
    every weight or one each; 4-, 6- and 8-bit weights mixed."""
    weights = [pack(codes(bits, 272, 256, seed=i)) for i, bits in enumerate([4, 8, 6, 4, 8])]
    x = torch.randn(1 if shared_input else len(weights), 256)
    many = packed_matmul.matmul_many(x, weights)
    assert many is not None
    for i, pw in enumerate(weights):
        assert torch.equal(many[i], packed_matmul.matmul(x[0 if shared_input else i][None], pw)[0])
    assert packed_matmul.matmul_many(torch.randn(2, 256), weights) is None  # neither one row nor one each


@pytest.mark.parametrize("input_bits", [16, 8])
def test_grouped_matmuls_give_each_weight_its_own_rows(input_bits):
    """matmul_many with rows per weight (a MoE step's experts, each on the rows that chose it): each row
    bitwise the single matmul's, an expert with no rows skipped, on one thread and on the team."""
    weights = [pack(codes(bits, 272, 256, seed=i)) for i, bits in enumerate([4, 8, 6, 4])]
    rows = [3, 0, 17, 1]
    x = torch.randn(sum(rows), 256)
    threads = torch.get_num_threads()
    for team in (1, 2):
        torch.set_num_threads(team)
        try:
            many = packed_matmul.matmul_many(x, weights, input_bits, rows=rows)
        finally:
            torch.set_num_threads(threads)
        assert many is not None
        start = 0
        for pw, m in zip(weights, rows):
            if m:
                want = packed_matmul.matmul(x[start : start + m], pw, input_bits=input_bits)
                assert torch.equal(many[start : start + m], want)
            start += m
    assert packed_matmul.matmul_many(x[:-1], weights, rows=rows) is None  # fewer rows than the counts say


def test_the_codebooks_are_the_kernels_own():
    """packed_weight.CODEBOOKS (what pack and the Python dequantizer use) are the tables the C++ kernels look
    the indices up in; a codebook they do not know is refused."""
    from kvflow.kernels import abi

    for book, codes in packed_weight.CODEBOOKS.items():
        table = torch.zeros(16, dtype=torch.uint8)
        assert abi.native().kvflow_packed_codebook(book=book, out=table.data_ptr()) == 0
        assert torch.equal(table, codes)
    assert abi.native().kvflow_packed_codebook(book=3, out=torch.zeros(16, dtype=torch.uint8).data_ptr()) == -1
