"""The fast CPU executor: every step the native decoder can take runs as one C++ call (token ids in,
logits out); the rest goes through the PyTorch layers (executors/layers.py).

Per step it decides how the native decoder multiplies, from the thresholds table: on the packed-integer
kernel, or, for steps of many rows where the plan made bfloat16 copies, on those copies through oneDNN
(the C++ forward calls back for each matmul, the only Python it runs in the step); and whether the packed
kernel's inputs are 16-bit (short prompts, decode at batch 1) or 8-bit (decode steps of many sequences
and long prompts, where the integer work bounds the step).
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.executors.layers import LayersExecutor
from kvflow.executors.native_model import NativeModel
from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import abi
from kvflow.layers.activation import soft_cap


class CpuFastExecutor(LayersExecutor):
    def __init__(self, loaded, kv_caches, attention_backend: str = "auto") -> None:
        super().__init__(loaded, kv_caches, attention_backend)
        self.native: NativeModel | None = loaded.native
        self.forward_native = abi.native().kvflow_decoder_forward if self.native is not None else None
        self.dense_min_rows = ROW_THRESHOLDS.native_dense_min_rows
        self.eight_bit_min_rows = ROW_THRESHOLDS.eight_bit_min_rows(loaded.plan.cpu_tier)
        self.eight_bit_prompt_min_rows = ROW_THRESHOLDS.eight_bit_prompt_min_rows
        self.tiles_min_context = ROW_THRESHOLDS.prompt_tiles_min_context
        # Prompt chunks' attention on AMX tiles (csrc/prefill_attention_amx.cpp takes head sizes 64 and 128).
        head_dim = loaded.arch.head_dim
        plain = all(a.plain_softmax for a in self.model.attention_layers)  # windows, caps, sinks: not on tiles
        self.prompt_tiles = (loaded.plan.cpu_tier == "amx" and head_dim in (64, 128) and plain
                             and kv_caches[0][0].dtype != torch.int8  # the tiles read 16- and 32-bit caches
                             and abi.native() is not None and abi.native().kvflow_packed_matmul_path() == 5)
        self._matmul = abi.KvflowDenseMatmul(self._dense_matmul)  # kept alive: C holds its address
        self._dense_io: list | None = None  # this step's (inputs, outputs) per projection, for the callback
        self._callback_error: BaseException | None = None

    def execute(self, inputs) -> torch.Tensor:
        native, meta = self.native, inputs.meta
        rows = inputs.input_ids.shape[0]
        if native is None or rows == 0 or meta.slot_mapping is None:
            return super().execute(inputs)
        if native.bound is not self.kv_caches:
            native.bind(self.kv_caches)
        # One step struct per KV group (sliding-window layers beside global ones keep their own blocks).
        groups = [meta] + (meta.group_metas or [])
        steps = (abi.KvflowStep * len(groups))(*[
            abi.KvflowStep(slots=g.slot_mapping.data_ptr(), query_start=g.query_start_loc.data_ptr(),
                           seq_lens=g.seq_lens.data_ptr(), block_tables=g.block_tables.data_ptr(),
                           table_stride=g.block_tables.stride(0), num_seqs=len(meta.seq_lens_cpu), num_tokens=rows)
            for g in groups])
        # How to multiply is chosen by the rows without drafts: a verified token is then computed exactly as
        # the plain decode step it replaces (the kernels compute each row on its own).
        plain_rows = rows - inputs.num_draft_rows
        dense = (self._dense_buffers(rows) if plain_rows >= self.dense_min_rows and native.dense_t is not None
                 else None)
        # 8-bit inputs for a long prompt's chunk, or where the decoding sequences alone take them: a few
        # prompt rows beside them (a long prompt bounded by the step budget) neither slow the step down to
        # 16-bit inputs nor change how the decodes are computed.
        has_prompt_rows = plain_rows > len(meta.seq_lens_cpu)
        eight_bit = 0 < self.eight_bit_min_rows and (inputs.num_decode_rows >= self.eight_bit_min_rows or plain_rows >= (
            self.eight_bit_prompt_min_rows if has_prompt_rows else self.eight_bit_min_rows))
        # A prompt chunk under the dense rows deep in a context (an agent's next turn: its new tokens over a
        # long cached one) attends on AMX tiles too, not row by row; speculation's checks stay computed as
        # the plain decode steps they replace.
        tiles = self.prompt_tiles and dense is None and has_prompt_rows and inputs.num_draft_rows == 0 and any(
            q > 1 and k >= self.tiles_min_context for q, k in zip(meta.query_lens_cpu, meta.seq_lens_cpu))
        hidden = torch.empty(rows, self.model.arch.hidden_size)
        picked = inputs.logits_indices
        logits = torch.empty(picked.shape[0], self.vocab_size) if native.head_packed else hidden
        rc = self.forward_native(
            model=ctypes.byref(native.struct), step=steps, ids=inputs.input_ids.data_ptr(),
            positions=inputs.positions.data_ptr(), rows=rows, dense=None if dense is None else ctypes.byref(dense),
            input_bits=8 if eight_bit else 16, prompt_tiles=int(tiles),
            logit_rows=picked.data_ptr(), num_logits=picked.shape[0] if native.head_packed else 0,
            logits=logits.data_ptr(), hidden=hidden.data_ptr(), num_threads=torch.get_num_threads())
        self._dense_io = None
        if rc != 0:
            raise self._failure(rc, native)
        if native.head_packed:
            if native.final_softcap:  # as the model's compute_logits caps them (Gemma 2)
                logits = soft_cap(logits, native.final_softcap)
            return logits
        return self.model.compute_logits(hidden[picked]).float()

    def _dense_buffers(self, rows: int) -> abi.KvflowDense:
        """This step's bfloat16 activations for the dense matmuls, and the struct that hands them to C++."""
        arch = self.model.arch
        q_size = arch.num_heads * arch.head_dim
        qkv_size = q_size + 2 * arch.num_kv_heads * arch.head_dim
        sizes = {"normed": arch.hidden_size, "attn": q_size, "act": arch.intermediate_size, "qkv": qkv_size,
                 "gate_up": 2 * arch.intermediate_size, "proj": arch.hidden_size}
        buf = {name: torch.empty(rows, width, dtype=torch.bfloat16) for name, width in sizes.items()}
        # (input, output) of projections 0 q/k/v, 1 o, 2 gate/up, 3 down
        self._dense_io = [(buf["normed"], buf["qkv"]), (buf["attn"], buf["proj"]), (buf["normed"], buf["gate_up"]),
                          (buf["act"], buf["proj"])]
        return abi.KvflowDense(matmul=self._matmul, context=None, prompt_attention_bf16=int(self.prompt_tiles),
                               **{name: t.data_ptr() for name, t in buf.items()})

    def _dense_matmul(self, context, layer: int, projection: int, rows: int) -> int:
        """Called from C++ for each many-row matmul: out = in @ W^T on the bfloat16 copy (oneDNN), or on AMX
        tiles straight from the packed weights."""
        try:
            x, y = self._dense_io[projection]
            w = self.native.dense_t[layer][projection]
            if isinstance(w, torch.Tensor):
                torch.mm(x, w, out=y)
            elif not w.dense_bf16_into(x, y):
                raise RuntimeError("the packed weights' bfloat16 tile kernel refused the matmul")
            return 0
        except BaseException as exc:  # noqa: BLE001 - C cannot carry it: kept, re-raised after the call
            self._callback_error = exc
            return -1

    def _failure(self, rc: int, native: NativeModel) -> Exception:
        if rc == -2:
            return ValueError(f"a position is past the model's context ({native.struct.max_positions} positions)")
        if rc == -4:
            return ValueError(f"a token id is outside the vocabulary of {native.struct.vocab_size}")
        if rc == -3 and self._callback_error is not None:
            error, self._callback_error = self._callback_error, None
            return RuntimeError(f"the native decoder's dense matmul failed: {error}")
        return RuntimeError(f"the native decoder refused the step ({rc})")
