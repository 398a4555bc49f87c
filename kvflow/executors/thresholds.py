"""Every row-count crossover of a CPU step, in one table: where one way of computing starts to beat another.

The executors read this table and hand the numbers down (to the layers they configure, to the native
decoder per step, to the C++ kernels through kvflow_set_tuning); no other module keeps a crossover of its
own. Each entry says what it switches and how it was measured; the figures are in benchmarks/RESULTS.md
("Figures behind the code").
Re-measure them when a kernel changes, on each CPU tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.kernels import abi, cpu_features


@dataclass(frozen=True)
class RowThresholds:
    # Native decoder (executors/cpu_fast.py): steps of fewer rows multiply on the packed-integer kernel,
    # steps of this many or more on dense bfloat16 copies through oneDNN, where bfloat16 is native (AMX).
    # How: decode batches of 24 to 64 rows timed through the whole step both ways, on the AMX Xeon.
    native_dense_min_rows: int = 64
    # Native decoder on AMX, packed path (fewer rows than native_dense_min_rows): a step's prompt chunks
    # attend on AMX tiles (bfloat16 products, csrc/prefill_attention_amx.cpp) once one reaches this many
    # positions of context; shallower ones keep the float32 row-by-row attention (a few ms either way) and
    # its closeness to the exact mode. How: benchmarks/ab_attention_source.py, 16 rows of the default
    # model's 30 layers: at depth 512 3.8 ms row by row, 2.3 on tiles; at 2,048 18.5 and 8.2; at 9,000 87
    # and 43 (AMX Xeon, 2 threads).
    prompt_tiles_min_context: int = 1024
    # PyTorch layers (executors/layers.py), where bfloat16 is native: a float Linear's matmul and a packed
    # layer's matmul run on the bfloat16 copy from this many rows. How: benchmarks/bench_quant_linear.py,
    # each layer shape of the default model at 1 to 512 rows, the integer kernels against oneDNN bf16.
    layers_dense_min_rows: int = 32
    # Packed matmul (csrc/packed_amx.h): AMX int8 tiles from this many rows, VNNI below; for a wide,
    # shallow matrix (an output head, n >= 16 k) from packed_amx_min_rows_wide. How: the kernel alone
    # both ways on the default model's 960x576 to 576x1536 layers and its 49152x576 head, 1 to 32 rows.
    packed_amx_min_rows: int = 16
    packed_amx_min_rows_wide: int = 8
    # Native decoder: its per-row passes (norms, rotary, SiLU) run on the thread team from this many rows;
    # waking the team costs more than a decode step's passes take. How: a step's time at 1 to 64 rows with
    # the passes on one thread and on the team. The result is the same either way.
    parallel_min_rows: int = 8
    # Native decoder, fast mode only: decode steps of this many sequences or more quantize the packed
    # matmuls' inputs to 8 bits per block of 32 (as llama.cpp's q8 activations) instead of 16, per tier;
    # 0 never does. Halves the integer work where a step is compute-bound; a token's logits then depend on
    # its step's batch, which the exact mode never allows. AMX keeps 16 bits (its tiles are fast enough).
    # How: a whole native step both ways at 1 to 512 rows on each tier, and greedy text against the exact
    # mode (benchmarks/RESULTS.md, "8-bit inputs"). The generic kernel (csrc/packed_generic.h; also NEON's
    # without dotprod) multiplies whole 16-bit inputs, as fast as 8-bit ones: it never takes them
    # (RESULTS.md, "Session 29").
    eight_bit_min_rows_by_tier: tuple[tuple[str, int], ...] = (
        ("generic", 0), ("avx2", 2), ("neon", 2), ("avx512", 8), ("amx", 0))
    # The same for steps that hold prompt rows, on the tiers above that take 8-bit inputs at all: long
    # prompts, where prefill time is felt (TTFT, waves of arrivals), not a short chat turn's, which takes
    # milliseconds either way and keeps 16-bit inputs (8-bit ones flip the default model's answer to "What
    # is the capital of France?" from Paris to llama.cpp's own "L'Étoile").
    eight_bit_prompt_min_rows: int = 128

    def eight_bit_min_rows(self, tier: str) -> int:
        if tier == "neon" and not cpu_features.has_dotprod():
            tier = "generic"  # ARMv8.0: the generic kernel on NEON vectors
        return dict(self.eight_bit_min_rows_by_tier).get(tier, 0)

    def kernel_tuning(self) -> abi.KvflowTuning:
        return abi.KvflowTuning(packed_amx_min_rows=self.packed_amx_min_rows,
                                packed_amx_min_rows_wide=self.packed_amx_min_rows_wide,
                                parallel_min_rows=self.parallel_min_rows)


ROW_THRESHOLDS = RowThresholds()
