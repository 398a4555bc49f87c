"""Python side of the packed-weight matmul (csrc/packed_matmul.cpp): the calls, on weights laid out by
packed_weight.py. `matmul()` multiplies float32 rows by one weight; `matmul_many()` several weights in one
thread team; `matmul_bf16()` on AMX bfloat16 tiles; `rows()` reads output rows (embedding lookups).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels import abi, cpu_features, packed_weight
from kvflow.kernels.packed_weight import GROUP, PackedWeight, pack

PATHS = {1: "generic 16-bit multiplies", 2: "AVX2", 3: "NEON dotprod", 4: "AVX512-VNNI",
         5: "AVX512-VNNI and AMX int8 tiles", 6: "AVX2 and AVX-VNNI", 7: "NEON dotprod and i8mm"}


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: the kernel library builds (a C++ compiler), on any CPU tier."""
    return abi.native() is not None


def random_weight(n: int, k: int, bits: int = 4, seed: int = 0) -> PackedWeight:
    """A packed [n, k] weight of random codes and float16-exact scales (4-bit: zero offsets; 6- and 8-bit:
    codes centred as Q6_K's and Q8_0's), for timing the kernel."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    centre = 0 if bits == 4 else 1 << (bits - 1)
    return pack(q, scale, -centre * scale, 32, bits, centre)


def path() -> str | None:
    """Which implementation runs on this CPU tier (PATHS), or None without the kernels."""
    native = abi.native()
    return None if native is None else PATHS[native.kvflow_packed_matmul_path()]


def refine_top(x: torch.Tensor, pw: PackedWeight, y: torch.Tensor, block_abs_sum: torch.Tensor,
               input_bits: int = 16) -> int:
    """In place, y = matmul(x, pw, input_bits=...): every y[r, j] within two error bounds of row r's largest
    becomes the exact x[r] . w[j] (double sums over the stored codes), so each row's argmax is the exact
    product's. block_abs_sum: float32 [k // group], per block the largest sum of |w| over a row. Returns how
    many changed."""
    if not (x.dtype == y.dtype == block_abs_sum.dtype == torch.float32) or y.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("refine_top takes float32 rows")
    sums = block_abs_sum.contiguous()
    return abi.native().kvflow_packed_refine_top(
        w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=x.stride(0), m=x.shape[0], y=y.data_ptr(),
        y_stride=y.stride(0), block_abs_sum=sums.data_ptr(), input_bits=input_bits)


def block_abs_sum(pw: PackedWeight) -> torch.Tensor:
    """float32 [k // group]: per block of inputs, the largest sum of |w| over an output row (refine_top's
    bound), in one threaded pass over the codes (no dequantized copy: an 8B model's head is 2 GB of floats)."""
    signature = ["block_abs_sum", pw.n, pw.k, pw.bits, pw.group, pw.codebook]  # of the weight packed just before
    cached = None if packed_weight.PACK_CACHE is None else packed_weight.PACK_CACHE.take(signature)
    if cached is not None:
        return cached.data.view(torch.float32)
    out = torch.empty(pw.k // pw.group)
    abi.native().kvflow_packed_block_abs_sum(w=ctypes.byref(pw.struct), out=out.data_ptr(),
                                             num_threads=torch.get_num_threads())
    if packed_weight.PACK_CACHE is not None:
        packed_weight.PACK_CACHE.add(signature, True, out.view(torch.uint8), None)
    return out


def rows(pw: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [*ids.shape, k]: output rows `ids` of the weight, dequantized exactly (embedding lookups)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= pw.n):
        raise IndexError(f"row index out of range for a weight of {pw.n} rows")
    out = torch.empty(flat.numel(), pw.k)
    abi.native().kvflow_packed_rows(w=ctypes.byref(pw.struct), ids=flat.data_ptr(), count=flat.numel(),
                                    out=out.data_ptr())
    return out.view(*ids.shape, pw.k)


def matmul_many(x: torch.Tensor, weights: list[PackedWeight], input_bits: int = 16,
                rows: list[int] | None = None) -> torch.Tensor | None:
    """Several weights of one n and k, each times its own rows of x, in one thread team (the experts a MoE
    step's tokens chose): float32 [len(x), n], weight i's rows after weight i - 1's. rows None: one row
    each, where x has one row per weight or a single row that every weight reads. Each row is bitwise what
    `matmul` gives it. None where the kernel does not take them."""
    count, n = len(weights), weights[0].n
    want = sum(rows) if rows is not None else count
    shared = rows is None and x.shape[0] == 1
    if (x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != weights[0].k
            or (x.shape[0] != want and not shared) or (rows is not None and len(rows) != count)):
        return None
    structs = (abi.KvflowPackedWeight * count)(*[pw.struct for pw in weights])
    counts = None if rows is None else (ctypes.c_int32 * count)(*rows)
    y = torch.empty(want, n)
    rc = abi.native().kvflow_packed_matmul_many(w=structs, count=count, rows=counts, x=x.data_ptr(),
                                                x_stride=0 if shared else x.stride(0), y=y.data_ptr(),
                                                y_stride=n, input_bits=input_bits, num_threads=torch.get_num_threads())
    return y if rc == 0 else None


def matmul(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, input_bits: int = 16) -> torch.Tensor:
    """x float32 [M, k] (rows may be strided) -> float32 [M, n]; the inputs are quantized per block to
    input_bits-bit integers (16: an error of 2^-16 of the block's largest input; 8: 2^-8, half the work)."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or x.dim() != 2 or x.shape[1] != pw.k:
        raise ValueError(f"packed matmul takes float32 [M, {pw.k}] rows, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(x.shape[0], pw.n) if out is None else out
    if x.shape[0] == 0:
        return y
    rc = abi.native().kvflow_packed_matmul(w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=x.stride(0),
                                           m=x.shape[0], y=y.data_ptr(), y_stride=y.stride(0),
                                           input_bits=input_bits, num_threads=torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the packed matmul kernel refused its input (blocks of 32 or 16 inputs, 4-, 6- or "
                           "8-bit codes, 8- or 16-bit inputs)")
    return y


def takes_bf16_tiles(pw: PackedWeight) -> bool:
    """Whether matmul_bf16 multiplies this weight here: the AMX tier's library, blocks of 32 inputs."""
    return available() and cpu_features.isa_tier() == "amx" and pw.group == GROUP


def matmul_bf16(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor) -> bool:
    """out (bfloat16 [M, n], rows may be strided) = x (bfloat16 [M, k]) @ W^T on AMX bfloat16 tiles, the
    weights dequantized on the fly to the values a bfloat16 copy holds (no copy kept). False where the
    kernel does not take them (a tier without AMX, blocks of 16 inputs): the caller multiplies otherwise."""
    if (x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or x.stride(-1) != 1 or out.stride(-1) != 1
            or x.shape[1] != pw.k or out.shape != (x.shape[0], pw.n)):
        raise ValueError(f"matmul_bf16 takes bfloat16 [M, {pw.k}] -> [M, {pw.n}], got {tuple(x.shape)}, {tuple(out.shape)}")
    if x.shape[0] == 0:
        return True
    return abi.native().kvflow_packed_matmul_bf16(w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=x.stride(0),
                                                  m=x.shape[0], y=out.data_ptr(), y_stride=out.stride(0),
                                                  num_threads=torch.get_num_threads()) == 0
