// Where the kernels' row-count crossovers live while the library runs. They come from the executor's table
// (kvflow/executors/thresholds.py, which says how each was measured); until it is set, the kernels take
// the plain choices: no AMX tiles (VNNI gives the same result, bit for bit) and the thread team always.
#include "tuning.h"

#include <cstdint>

namespace {
KvflowTuning g_tuning{INT32_MAX, INT32_MAX, 1};
}  // namespace

namespace kvflow {
const KvflowTuning& tuning() { return g_tuning; }
}  // namespace kvflow

extern "C" void kvflow_set_tuning(const KvflowTuning* t) {
  if (t->packed_amx_min_rows > 0) g_tuning.packed_amx_min_rows = t->packed_amx_min_rows;
  if (t->packed_amx_min_rows_wide > 0) g_tuning.packed_amx_min_rows_wide = t->packed_amx_min_rows_wide;
  if (t->parallel_min_rows > 0) g_tuning.parallel_min_rows = t->parallel_min_rows;
}
