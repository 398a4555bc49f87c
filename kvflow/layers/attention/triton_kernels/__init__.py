"""Triton kernels for the CUDA attention backend. Importing this package imports triton."""

from kvflow.layers.attention.triton_kernels.decode_attention import choose_num_splits, decode_attention
from kvflow.layers.attention.triton_kernels.prefill_attention import prefill_attention
from kvflow.layers.attention.triton_kernels.store_kv import store_kv

__all__ = ["choose_num_splits", "decode_attention", "prefill_attention", "store_kv"]
