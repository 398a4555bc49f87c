// Where a layer's paged cache keeps each row: the one definition of the two block layouts of
// KvflowAttention (kvflow_cpu.h), for every kernel that reads or writes the cache.
#pragma once

#include <cstdint>

namespace kvflow {

// The row (counted in heads' rows) holding KV head `kv` of position `within` of block `block`: blocks are
// [num_kv_heads, block_size] rows when head_major (each head's rows of a block one contiguous run), else
// [block_size, num_kv_heads].
inline int64_t cache_row_index(int64_t block, int within, int kv, int num_kv_heads, int block_size, bool head_major) {
  return head_major ? (block * num_kv_heads + kv) * block_size + within
                    : (block * block_size + within) * num_kv_heads + kv;
}

}  // namespace kvflow
