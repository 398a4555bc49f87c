"""Every row-count crossover of a CPU step, in one table: where one way of computing starts to beat another.

The executors read this table and hand the numbers down (to the layers they configure, to the native
decoder per step, to the C++ kernels through kvflow_set_tuning); no other module keeps a crossover of its
own. Each entry says what it switches and how it was measured; the figures are in benchmarks/RESULTS.md.
Re-measure them when a kernel changes, on each CPU tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.kernels import abi


@dataclass(frozen=True)
class RowThresholds:
    # Native decoder (executors/cpu_fast.py): steps of fewer rows multiply on the packed-integer kernel,
    # steps of this many or more on dense bfloat16 copies through oneDNN, where bfloat16 is native (AMX).
    # Measured with the decoder on both sides (Xeon, AMX): decode batches of 24 to 48 rows were 1.1 to 1.4x
    # faster on the packed kernel, 64 rows 1.15x slower (RESULTS.md, session 4, "fused step" rows).
    native_dense_min_rows: int = 64
    # PyTorch layers (executors/layers.py), where bfloat16 is native: a float Linear's matmul and a packed
    # layer's matmul run on the bfloat16 copy from this many rows. benchmarks/bench_quant_linear.py: the
    # integer kernels against dequantize + AMX crossed at 32 to 64 rows (RESULTS.md, session 3).
    layers_dense_min_rows: int = 32
    # Packed matmul (csrc/packed_amx.h): AMX int8 tiles from this many rows, VNNI below (960x576 to
    # 576x1536 matrices, RESULTS.md session 5); for a wide, shallow matrix (an output head, n >= 16 k)
    # from packed_amx_min_rows_wide (an 8-row step's head 3.5 ms against 5.0 on VNNI, session 6).
    packed_amx_min_rows: int = 16
    packed_amx_min_rows_wide: int = 8
    # Native decoder: its per-row passes (norms, rotary, SiLU) run on the thread team from this many rows;
    # waking the team costs a few microseconds, more than a decode step's passes take. The result is the
    # same either way.
    parallel_min_rows: int = 16

    def kernel_tuning(self) -> abi.KvflowTuning:
        return abi.KvflowTuning(packed_amx_min_rows=self.packed_amx_min_rows,
                                packed_amx_min_rows_wide=self.packed_amx_min_rows_wide,
                                parallel_min_rows=self.parallel_min_rows)


ROW_THRESHOLDS = RowThresholds()
