// Where the kernels' row-count crossovers live: defaults here, the executor's table once it is set
// (kvflow/executors/thresholds.py says how each was measured).
#include "tuning.h"

namespace {
KvflowTuning g_tuning{16, 8, 16};
}  // namespace

namespace kvflow {
const KvflowTuning& tuning() { return g_tuning; }
}  // namespace kvflow

extern "C" void kvflow_set_tuning(const KvflowTuning* t) {
  if (t->packed_amx_min_rows > 0) g_tuning.packed_amx_min_rows = t->packed_amx_min_rows;
  if (t->packed_amx_min_rows_wide > 0) g_tuning.packed_amx_min_rows_wide = t->packed_amx_min_rows_wide;
  if (t->parallel_min_rows > 0) g_tuning.parallel_min_rows = t->parallel_min_rows;
}
