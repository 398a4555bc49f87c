"""GGUF files for tests, written with the `gguf` package: a minimal one-tensor file, and a copy of a real
file with its 2-D weights re-quantized to other types.

`requantize` is the test stand-in for llama.cpp's quantizer (a peer, never a dependency): the metadata and
tokenizer are copied as they are; each weight is dequantized and quantized again to the type `pick(name)` returns (None:
copy the tensor unchanged). Types the `gguf` package can quantize (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, F16...), and
Q6_K through `quantize_q6_k` (a plain round-to-nearest encoder: the gguf package has no K-quant quantizer).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np


def write_gguf(path: Path, arch: str, tensor_type: str, random_bytes: bool = False) -> Path:
    """A minimal GGUF: llama-style metadata and one tensor of the given type (zero bytes, or random ones)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_context_length(128)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((32, 256 // block * type_size), dtype=np.uint8)
    if random_bytes:
        raw = np.random.default_rng(0).integers(0, 256, raw.shape, dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def requantize(src: Path, dst: Path, pick: Callable[[str], str | None]) -> Path:
    def tensor(t) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        target = pick(t.name) if len(t.shape) in (2, 3) else None  # 3-D: stacked MoE experts
        if target is None or target == t.tensor_type.name:
            return np.asarray(t.data), t.tensor_type
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[target]
        encoders = {"Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs}
        return (encoders[target](w) if target in encoders else gguf.quants.quantize(w, qtype)), qtype

    return rewrite(src, dst, tensor)


def rewrite(src: Path, dst: Path, tensor: Callable) -> Path:
    """A copy of a GGUF file, metadata as it is, each tensor as tensor(reader_tensor) gives it: (data, type)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data, qtype = tensor(t)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q6_K bytes [rows, k / 256 * 210]: per 16 inputs an int8
    scale of the super-block's float16 d, codes round(w / (d * sc)) + 32 in 0..63, laid out as ggml's
    block_q6_K (128 bytes of low nibbles, 64 of high bit pairs, 16 scales, d)."""
    rows, k = w.shape
    x = w.reshape(rows, k // 256, 16, 16).astype(np.float64)
    sub = np.abs(x).max(-1) / 31  # [rows, supers, 16]
    d = (sub.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(np.divide(sub, d, out=np.zeros_like(sub), where=d > 0)), -128, 127).astype(np.int8)
    step = d.astype(np.float64) * sc
    q = np.round(np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 2, 2, 32)  # [.., half, nib, w, l]
    ql = (q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)  # [.., half, w, l]
    high = q >> 4
    qh = high[:, :, :, 0, 0] | (high[:, :, :, 0, 1] << 2) | (high[:, :, :, 1, 0] << 4) | (high[:, :, :, 1, 1] << 6)
    parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8), d.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64)


def _iq4_indices(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """x [..., 32] and its block's step [...] -> the nearest IQ4 value's index per input, packed as ggml's
    16 bytes a block: index i in the low nibble of byte i, index 16 + i in the high one."""
    idx = np.abs(x[..., None] - step[..., None, None] * IQ4_VALUES).argmin(-1).astype(np.uint8)
    return idx[..., :16] | (idx[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> IQ4_NL bytes [rows, k / 32 * 18]: per 32 inputs a float16 d (largest |w| / 127)
    and each input's nearest d * value of the 16-entry table (gguf has no IQ4 quantizer; this is the
    simple one, not llama.cpp's search)."""
    rows, k = w.shape
    x = w.reshape(rows, k // 32, 32).astype(np.float64)
    d = (np.abs(x).max(-1) / 127).astype(np.float16)
    qs = _iq4_indices(x, d.astype(np.float64))
    return np.concatenate([d[..., None].view(np.uint8), qs], axis=-1).reshape(rows, -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> IQ4_XS bytes [rows, k / 256 * 136]: per 256 inputs a
    float16 d, per 32 a 6-bit scale ls (step d * (ls - 32)), laid out as ggml's block_iq4_xs (d, the scales'
    top bit pairs, their low nibbles, then IQ4_NL's index bytes per 32)."""
    rows, k = w.shape
    x = w.reshape(rows, k // 256, 8, 32).astype(np.float64)
    sub = np.abs(x).max(-1) / 127  # each sub-block's own step
    d = (sub.max(-1, keepdims=True) / 31).astype(np.float16)
    ls = np.clip(np.round(np.divide(sub, d, out=np.zeros_like(sub), where=d > 0)) + 32, 0, 63).astype(np.uint16)
    qs = _iq4_indices(x, d.astype(np.float64) * (ls.astype(np.float64) - 32))
    high = np.zeros(ls.shape[:-1], dtype=np.uint16)
    for j in range(8):
        high |= (ls[..., j] >> 4) << (2 * j)
    low = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
    parts = [d.view(np.uint8), high[..., None].view(np.uint8), low.astype(np.uint8), qs.reshape(rows, k // 256, 128)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)
