// The kernels' row-count crossovers, as the executor last set them (kvflow_set_tuning).
#pragma once

#include "kvflow_cpu.h"

namespace kvflow {
const KvflowTuning& tuning();
}  // namespace kvflow
