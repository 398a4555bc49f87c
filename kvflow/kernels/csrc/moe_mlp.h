// A mixture-of-experts layer's MLP inside the native decoder (KvflowMoE in kvflow_cpu.h).
#pragma once

#include "kvflow_cpu.h"
#include "row_ops.h"

namespace kvflow {

// out [rows, hidden] = the MoE MLP of x [rows, hidden] (rows contiguous). The chosen experts run as two
// kvflow_packed_matmul_many calls (every gate/up, then every down), each expert once on the rows that
// chose it. Returns 0, or -1 for a weight a kernel refused or an invalid expert table.
int moe_mlp(const KvflowMoE& moe, const Activation& act, const float* x, int hidden, int rows, float* out,
            int input_bits, int threads);

}  // namespace kvflow
