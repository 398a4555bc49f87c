"""GGUF files for tests, written with the `gguf` package: a minimal one-tensor file, and a copy of a real
file with its 2-D weights re-quantized to other types.

`requantize` is the test stand-in for llama.cpp's quantizer (a peer, never a dependency): the metadata and
tokenizer are copied as they are; each weight is dequantized and quantized again to the type `pick(name)` returns (None:
copy the tensor unchanged). Only types the `gguf` package can quantize (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, F16...).
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
        target = pick(t.name) if len(t.shape) == 2 else None
        if target is None or target == t.tensor_type.name:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[target]
        writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
