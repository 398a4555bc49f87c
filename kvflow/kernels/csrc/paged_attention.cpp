// Attention over the paged KV cache, for CPU: one call per layer and step.
//
// Stores the step's new K/V rows into their cache slots, then, for every sequence whose query this
// step is a single token (or for every query row, when asked), attends over its context through its
// block table. For a one-token query each K/V byte is read once per step and, with head sizes 64 and
// 128, widened once: the query heads that share a KV head (grouped-query attention) are scored together.
// A prefill chunk's rows go 16 at a time over each chunk of positions, sharing what is cached. Work is
// split into fixed chunks of positions, so a long context keeps every thread busy, and the chunks'
// partial softmax results are merged in a fixed order: a row's result depends on nothing but its own
// inputs (not on the batch, the rows beside it, nor the thread count).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_rows.h"
#include "kvflow_cpu.h"
#include "simd.h"
#include "threads.h"

namespace {

using namespace kvflow::attention;

// One row's output for query head h: its chunks' partial results [c0, c1) rescaled to their common max
// and summed in chunk order, then normalised; a sink's exp joins the denominator (-inf: no sink).
// weights is scratch.
void merge_chunks(const float* part_max, const float* part_sum, const float* part_acc, int c0, int c1, int hq, int h,
                  int d, float sink, std::vector<float>& weights, float* out) {
  namespace v = kvflow::simd;
  const int n = c1 - c0;
  weights.resize((n + v::kLanes - 1) / v::kLanes * v::kLanes);
  float m = -INFINITY;
  for (int c = 0; c < n; ++c) {
    weights[c] = part_max[(c0 + c) * hq + h];
    m = weights[c] > m ? weights[c] : m;
  }
  m = sink > m ? sink : m;
  // exp per chunk, a vector at a time (a scalar exp a chunk made the merge a visible share of the attention).
  for (size_t c = n; c < weights.size(); ++c) weights[c] = -INFINITY;  // exp gives 0
  const v::vf mv = v::set1(m);
  for (size_t c = 0; c < weights.size(); c += v::kLanes)
    v::store(&weights[c], v::exp(v::sub(v::load(&weights[c]), mv)));
  float total = sink == -INFINITY ? 0.f : std::exp(sink - m);
  std::memset(out, 0, sizeof(float) * d);
  for (int c = 0; c < n; ++c) {
    const float w = weights[c];
    total += w * part_sum[(c0 + c) * hq + h];
    const float* acc = part_acc + (static_cast<size_t>(c0 + c) * hq + h) * d;
    for (int j = 0; j < d; ++j) out[j] += w * acc[j];
  }
  const float inv = 1.f / total;
  for (int j = 0; j < d; ++j) out[j] *= inv;
}

template <typename T>
void run(const KvflowRows& in, T* k_cache, T* v_cache, const KvflowStep& step, float* out, int64_t out_stride,
         const Shape& s, int all_rows, int num_threads) {
  const float *q = in.q, *k_new = in.k, *v_new = in.v;
  const int64_t q_stride = in.q_stride, k_stride = in.k_stride, v_stride = in.v_stride;
  const int64_t* slots = step.slots;
  const int32_t *query_start = step.query_start, *seq_lens = step.seq_lens, *tables = step.block_tables;
  const int num_tokens = step.num_tokens, num_seqs = step.num_seqs;
  const int d = s.head_dim, hkv = s.num_kv_heads, hq = hkv * s.group;
  for (int t = 0; t < num_tokens; ++t) {  // new K/V into their slots, before anyone reads them
    for (int h = 0; h < hkv; ++h) {
      store_row(k_new + t * k_stride + h * d, k_cache + slot_offset<T>(s, slots[t], h), d);
      store_row(v_new + t * v_stride + h * d, v_cache + slot_offset<T>(s, slots[t], h), d);
    }
  }
  // Query rows to attend: every one-token query, and with all_rows every row of every sequence (row r
  // of a sequence whose step brings qlen tokens sits at position seq_len - qlen + r and sees the
  // context up to and including itself). Row i's chunk c is work item first_chunk[i] + c.
  // A row of a sliding-window layer sees positions [start, context) only: its chunks are those of the
  // fixed grid that hold any of them (the first one partly masked), so the split still depends on the
  // row alone.
  struct Row {
    int out_row, seq, context, start;
    int first_chunk_index(int len) const { return start / len; }
    int chunk_count(int len) const { return (context + len - 1) / len - start / len; }
  };
  thread_local std::vector<Row> rows;
  rows.clear();
  for (int b = 0; b < num_seqs; ++b) {
    const int qlen = query_start[b + 1] - query_start[b];
    if (qlen == 0 || (qlen != 1 && !all_rows)) continue;
    for (int r = 0; r < qlen; ++r) {
      const int context = seq_lens[b] - qlen + r + 1;
      rows.push_back({query_start[b] + r, b, context, s.window > 0 && context > s.window ? context - s.window : 0});
    }
  }
  const int num_rows = static_cast<int>(rows.size());
  thread_local std::vector<int> first_chunk;
  first_chunk.assign(num_rows + 1, 0);
  for (int i = 0; i < num_rows; ++i) first_chunk[i + 1] = first_chunk[i] + rows[i].chunk_count(chunk_length(rows[i].context));
  const int total_chunks = first_chunk[num_rows];
  // Work items: a chunk of positions for a run of up to kRowBlock consecutive rows of one sequence with
  // the same chunk length (a one-token query is a run of one). Row i's result for its chunk c lands at
  // first_chunk[i] + c.
  struct Item { int first_row, count, chunk, len, kv_lo, kv_hi; };
  thread_local std::vector<Item> items;
  items.clear();
  for (int i = 0; i < num_rows;) {
    int end = i + 1;
    const int len = chunk_length(rows[i].context);
    while (end < num_rows && end - i < kRowBlock && rows[end].seq == rows[i].seq &&
           chunk_length(rows[end].context) == len)
      ++end;
    // From the run's first row's first chunk (its window starts earliest) to its last row's last one.
    const int chunks = (rows[end - 1].context + len - 1) / len;
    for (int c = rows[i].first_chunk_index(len); c < chunks; ++c) items.push_back({i, end - i, c, len, 0, hkv});
    i = end;
  }
  // Too few items to share (one sequence's decode over a short context): its items go one KV head each,
  // so that both threads work. Each head's arithmetic is the same either way.
  if (static_cast<int>(items.size()) < 2 * num_threads && hkv > 1 && heads_split_ok(s)) {
    const size_t whole = items.size();
    for (size_t it = 0; it < whole; ++it) {
      const Item item = items[it];  // a copy: push_back may move the vector
      if (item.count != 1) continue;
      items[it].kv_hi = 1;
      for (int kv = 1; kv < hkv; ++kv) items.push_back({item.first_row, 1, item.chunk, item.len, kv, kv + 1});
    }
  }
  const int num_items = static_cast<int>(items.size());
  // Partial results per (row's chunk, query head): max, sum, acc[d].
  // Every entry a row's merge reads is written by its chunk's work item first: no zeroing needed.
  thread_local std::vector<float> part_max, part_sum, part_acc;
  part_max.resize(static_cast<size_t>(total_chunks) * hq);
  part_sum.resize(static_cast<size_t>(total_chunks) * hq);
  part_acc.resize(static_cast<size_t>(total_chunks) * hq * d);
  // Waking a thread team costs microseconds: short contexts run on the calling thread. The split into
  // chunks, and so the result, is the same either way.
  const int team = num_items >= 4 ? num_threads : 1;
  // The team reads the calling thread's buffers: thread_local names would resolve to each thread's own.
  const Row* const rows_at = rows.data();
  const Item* const items_at = items.data();
  const int* const first_chunk_at = first_chunk.data();
  float* const max_at = part_max.data();
  float* const sum_at = part_sum.data();
  float* const acc_at = part_acc.data();
  kvflow::parallel(team, [&](kvflow::Team& workers) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> offsets;
    scores.resize(static_cast<size_t>(kMaxChunk) * hq);
    offsets.resize(kMaxChunk);
    const float* q_rows[kRowBlock];
    int contexts[kRowBlock], starts[kRowBlock];
    size_t part_at[kRowBlock];
    workers.for_dynamic(num_items, [&](int it) {
      const Item& item = items_at[it];
      for (int r = 0; r < item.count; ++r) {
        const Row& row = rows_at[item.first_row + r];
        q_rows[r] = q + row.out_row * q_stride;
        contexts[r] = row.context;
        starts[r] = row.start;
        // (Unused where the chunk lies before the row's window: the kernels skip the row there.)
        const int index = item.chunk - row.first_chunk_index(item.len);
        part_at[r] = static_cast<size_t>(first_chunk_at[item.first_row + r] + (index > 0 ? index : 0)) * hq;
      }
      const Row& first = rows_at[item.first_row];
      attend_rows(q_rows, contexts, starts, part_at, item.count, k_cache, v_cache, tables + first.seq * s.table_stride,
                  item.chunk * item.len, item.len, s, item.kv_lo, item.kv_hi, scores.data(), offsets.data(), max_at,
                  sum_at, acc_at);
    });
    // (The loop above ends in a barrier: every chunk's partial results are written.) Each (row, head)
    // merges its chunks in chunk order, whichever thread takes it.
    thread_local std::vector<float> weights;
    workers.for_static(num_rows * hq, [&](int unit) {
      const int i = unit / hq, h = unit % hq;
      merge_chunks(max_at, sum_at, acc_at, first_chunk_at[i], first_chunk_at[i + 1], hq, h, d,
                   s.sinks ? s.sinks[h] : -INFINITY, weights, out + rows_at[i].out_row * out_stride + h * d);
    });
  });
}

}  // namespace


extern "C" int32_t kvflow_paged_attention(const KvflowAttention* layer, const KvflowStep* step, const KvflowRows* rows,
                                          float* out, int64_t out_stride, int32_t all_rows, int32_t num_threads) {
  const KvflowAttention& a = *layer;
  if (a.num_kv_heads < 1 || a.num_heads % a.num_kv_heads) return -1;
  const Shape s{a.num_kv_heads, a.head_dim, a.block_size, a.num_heads / a.num_kv_heads, step->table_stride,
                a.scale, a.window, a.softcap, a.head_major != 0, a.sinks};
  if (a.cache_dtype == 0)
    run(*rows, static_cast<float*>(a.k_cache), static_cast<float*>(a.v_cache), *step, out, out_stride, s, all_rows,
        num_threads);
  else if (a.cache_dtype == 1)
    run(*rows, static_cast<uint16_t*>(a.k_cache), static_cast<uint16_t*>(a.v_cache), *step, out, out_stride, s,
        all_rows, num_threads);
  else if (a.cache_dtype == 2)
    run(*rows, static_cast<kvflow::float16*>(a.k_cache), static_cast<kvflow::float16*>(a.v_cache), *step, out, out_stride, s,
        all_rows, num_threads);
  else if (a.cache_dtype == 3)  // 8-bit values with a float32 scale per token and KV head (attention_rows.h)
    run(*rows, static_cast<int8_t*>(a.k_cache), static_cast<int8_t*>(a.v_cache), *step, out, out_stride, s, all_rows,
        num_threads);
  else
    return -1;
  return 0;
}
