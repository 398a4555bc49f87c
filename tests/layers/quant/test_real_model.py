"""The default model's own tensors: a fused, unpermuted Q4_1 q/k/v and the Q8_0 tied embedding."""

import gguf
import numpy as np
import pytest
import torch
from conftest import default_gguf_path

from kvflow.layers.quant import gguf_linear, unpermute_rope_index
from kvflow.loader.gguf_file import unpermute_rope


@pytest.fixture(scope="module")
def tensors():
    reader = gguf.GGUFReader(str(default_gguf_path()))
    return {t.name: t for t in reader.tensors}


def deq(t) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))


def rel_err(y, ref) -> float:
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def test_fused_qkv_from_the_default_gguf(tensors):
    q, k, v = (tensors[f"blk.0.attn_{n}.weight"] for n in "qkv")
    assert {t.tensor_type.name for t in (q, k, v)} == {"Q4_1"}
    layer = gguf_linear(
        [(t.data, t.tensor_type.name) for t in (q, k, v)],
        row_orders=[unpermute_rope_index(576, 9), unpermute_rope_index(192, 3), None],
    )
    ref = torch.cat([unpermute_rope(deq(q), 9), unpermute_rope(deq(k), 3), deq(v)])
    assert (layer.out_features, layer.in_features) == (960, 576)
    x = torch.randn(5, 576)
    for rows in (1, 5):  # the int kernel
        assert rel_err(layer(x[:rows]), x[:rows].double() @ ref.double().t()) < 1e-2
    x = torch.randn(40, 576)  # the dequantize-and-AMX path
    assert rel_err(layer(x), x.double() @ ref.double().t()) < 1e-2


def test_q8_0_tied_embedding_and_output_projection(tensors):
    emb = tensors["token_embd.weight"]
    assert emb.tensor_type.name == "Q8_0"
    layer = gguf_linear([(emb.data, "Q8_0")], exact_rows=True)
    assert (layer.out_features, layer.in_features) == (49152, 576)
    ref = deq(emb)
    ids = torch.tensor([0, 1, 2, 100, 49151])
    assert torch.equal(layer.embedding(ids), ref[ids])
    hidden = ref[torch.tensor([11, 22])] * 3  # hidden-state-like vectors
    logits = layer(hidden)
    expect = hidden.double() @ ref.double().t()
    assert rel_err(logits, expect) < 1e-2
    assert torch.equal(logits.argmax(-1), expect.argmax(-1))
