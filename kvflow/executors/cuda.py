"""The CUDA executor: the PyTorch layers with Triton attention, decode steps replayed from CUDA graphs
(executors/cuda_graphs.py) where the backend allows it."""

from __future__ import annotations

import torch

from kvflow.executors.cuda_graphs import CudaGraphRunner
from kvflow.executors.layers import LayersExecutor


class CudaExecutor(LayersExecutor):
    def __init__(self, loaded, kv_caches, attention_backend: str = "auto", max_num_seqs: int = 64,
                 max_blocks_per_seq: int = 1, cuda_graphs: bool = True) -> None:
        super().__init__(loaded, kv_caches, attention_backend)
        self.graphs = None
        if cuda_graphs and getattr(self.backend, "supports_cuda_graphs", False):
            self.graphs = CudaGraphRunner(self.model, self.backend, max_num_seqs, max_blocks_per_seq, loaded.device)
            self.graphs.capture()  # after the cache exists: graphs keep its addresses

    def execute(self, inputs) -> torch.Tensor:
        if self.graphs is None or not self.graphs.can_run(inputs.meta):
            return super().execute(inputs)
        self.bind()
        hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.logits_indices.numel() == 0:
            return torch.empty(0, self.vocab_size)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()
