// Per-row passes of the native decoder, on the thread team once there are enough rows to share.
#pragma once

#include "threads.h"
#include "tuning.h"

namespace kvflow {

// f(r) for every row r; which thread runs a row never changes its result.
template <typename F>
void each_row(int rows, int num_threads, F&& f) {
  if (num_threads <= 1 || rows < tuning().parallel_min_rows) {
    for (int r = 0; r < rows; ++r) f(r);
    return;
  }
  parallel(num_threads, [&](Team& team) { team.for_static(rows, f); });
}

}  // namespace kvflow
