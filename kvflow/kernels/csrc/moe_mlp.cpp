// Routing and experts of a MoE layer, in the order kvflow/models/moe.py gives them, so that the native
// decoder and the PyTorch layers pick the same experts and sum them the same way:
//  - the router's logits as doubles (a float router's products summed in double; a packed router's
//    float32 outputs, always from 16-bit inputs: a choice of experts should not move with the step's
//    input precision), softmax and top-k in double, the chosen weights renormalized and rounded to float;
//  - a row's output summed over its experts in ascending expert order, from zero, each term the expert's
//    float32 output times its weight, rounded, then added.
// A row's choice and sum depend on its own input only, and the packed kernel's rows are independent of
// their batch: a row's result does not depend on which other rows share its step.
#include "moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "row_ops.h"
#include "row_team.h"
#include "simd.h"

namespace kvflow {
namespace {

// sum_j x[j] * w[j] in double, in 16 interleaved partial sums (vectorizable without reassociation).
double dot_double(const float* x, const float* w, int n) {
  constexpr int L = 16;
  double acc[L] = {};
  int j = 0;
  for (; j + L <= n; j += L)
    for (int t = 0; t < L; ++t) acc[t] += static_cast<double>(x[j + t]) * static_cast<double>(w[j + t]);
  double total = 0;
  for (int t = 0; t < L; ++t) total += acc[t];
  for (; j < n; ++j) total += static_cast<double>(x[j]) * static_cast<double>(w[j]);
  return total;
}

// One row's top_k experts (ascending) and their float32 weights, from its num_experts logits.
void route_row(const KvflowMoE& moe, const double* logits, int* experts, float* weights) {
  const int e_count = moe.num_experts, k = moe.top_k;
  thread_local std::vector<double> prob;
  thread_local std::vector<int> order;
  prob.resize(e_count);
  order.resize(e_count);
  const double top = *std::max_element(logits, logits + e_count);
  double total = 0;
  for (int e = 0; e < e_count; ++e) total += prob[e] = std::exp(logits[e] - top);
  for (int e = 0; e < e_count; ++e) {
    prob[e] /= total;
    order[e] = e;
  }
  // Largest first; ties to the lower expert.
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); });
  double chosen = 0;
  for (int i = 0; i < k; ++i) chosen += prob[order[i]];
  std::sort(order.begin(), order.begin() + k);
  for (int i = 0; i < k; ++i) {
    experts[i] = order[i];
    weights[i] = static_cast<float>(moe.normalize ? prob[order[i]] / chosen : prob[order[i]]);
  }
}

struct MoeBuffers {
  std::vector<float> logits_f, gathered, gate_up, act, down, pair_weight;
  std::vector<double> logits;
  std::vector<int> chosen, pair_row, pair_expert, count, first;
  std::vector<float> chosen_weight;
  std::vector<KvflowPackedWeight> gate_up_w, down_w;
  std::vector<int32_t> rows_of;
};

}  // namespace

int moe_mlp(const KvflowMoE& moe, const Activation& act, const float* x, int hidden, int rows, float* out,
            int input_bits, int threads) {
  const int e_count = moe.num_experts, k = moe.top_k, inter = moe.intermediate;
  if (e_count <= 0 || k <= 0 || k > e_count || inter <= 0 || !moe.gate_up || !moe.down) return -1;
  thread_local MoeBuffers own;
  MoeBuffers& b = own;  // a reference, so the team's lambdas capture this thread's buffers, not their own
  const size_t n_logits = static_cast<size_t>(rows) * e_count;
  b.logits.resize(n_logits);
  if (moe.router) {
    each_row(rows, threads, [&](int r) {
      for (int e = 0; e < e_count; ++e)
        b.logits[static_cast<size_t>(r) * e_count + e] =
            dot_double(x + static_cast<int64_t>(r) * hidden, moe.router + static_cast<int64_t>(e) * hidden, hidden) +
            (moe.router_bias ? static_cast<double>(moe.router_bias[e]) : 0.0);
    });
  } else {
    b.logits_f.resize(n_logits);
    if (moe.router_packed.n != e_count ||
        kvflow_packed_matmul(&moe.router_packed, x, hidden, rows, b.logits_f.data(), e_count, 16, threads))
      return -1;
    for (size_t i = 0; i < n_logits; ++i)  // a bias added in float32, as PackedLinear adds it
      b.logits[i] = moe.router_bias ? b.logits_f[i] + moe.router_bias[i % e_count] : b.logits_f[i];
  }
  const size_t n_pairs = static_cast<size_t>(rows) * k;
  b.chosen.resize(n_pairs);
  b.chosen_weight.resize(n_pairs);
  for (int r = 0; r < rows; ++r)
    route_row(moe, b.logits.data() + static_cast<size_t>(r) * e_count, b.chosen.data() + static_cast<size_t>(r) * k,
              b.chosen_weight.data() + static_cast<size_t>(r) * k);
  // Pairs (expert, row) sorted by expert, then row: each chosen expert's rows side by side.
  b.count.assign(e_count, 0);
  for (int e : b.chosen) ++b.count[e];
  b.first.assign(e_count + 1, 0);
  for (int e = 0; e < e_count; ++e) b.first[e + 1] = b.first[e] + b.count[e];
  b.pair_row.resize(n_pairs);
  b.pair_expert.resize(n_pairs);
  b.pair_weight.resize(n_pairs);
  std::vector<int>& next = b.count;  // reused as each expert's next free pair
  for (int e = 0; e < e_count; ++e) next[e] = b.first[e];
  for (size_t i = 0; i < n_pairs; ++i) {
    const int p = next[b.chosen[i]]++;
    b.pair_row[p] = static_cast<int>(i / k);
    b.pair_expert[p] = b.chosen[i];
    b.pair_weight[p] = b.chosen_weight[i];
  }
  b.gate_up_w.clear();
  b.down_w.clear();
  b.rows_of.clear();
  for (int e = 0; e < e_count; ++e) {
    const int m = b.first[e + 1] - b.first[e];
    if (m == 0) continue;
    const KvflowPackedWeight &gu = moe.gate_up[e], &dn = moe.down[e];
    if (gu.k != hidden || gu.n != 2 * inter || dn.k != inter || dn.n != hidden) return -1;
    b.gate_up_w.push_back(gu);
    b.down_w.push_back(dn);
    b.rows_of.push_back(m);
  }
  const int used = static_cast<int>(b.rows_of.size());
  b.gate_up.resize(n_pairs * 2 * inter);
  b.act.resize(n_pairs * inter);
  b.down.resize(n_pairs * hidden);
  int rc;
  if (rows == 1) {  // one token: every expert reads the same input row, quantized once
    rc = kvflow_packed_matmul_many(b.gate_up_w.data(), used, nullptr, x, 0, b.gate_up.data(), 2 * inter, input_bits,
                                   threads);
  } else {
    b.gathered.resize(n_pairs * hidden);
    each_row(static_cast<int>(n_pairs), threads, [&](int p) {
      std::copy_n(x + static_cast<int64_t>(b.pair_row[p]) * hidden, hidden, b.gathered.data() + static_cast<int64_t>(p) * hidden);
    });
    rc = kvflow_packed_matmul_many(b.gate_up_w.data(), used, b.rows_of.data(), b.gathered.data(), hidden,
                                   b.gate_up.data(), 2 * inter, input_bits, threads);
  }
  if (rc) return -1;
  each_row(static_cast<int>(n_pairs), threads, [&](int p) {
    float* gu = b.gate_up.data() + static_cast<int64_t>(p) * 2 * inter;
    if (moe.gate_up_bias) add_bias(gu, moe.gate_up_bias + static_cast<int64_t>(b.pair_expert[p]) * 2 * inter, 2 * inter);
    gated_activation(act, gu, gu + inter, b.act.data() + static_cast<int64_t>(p) * inter, inter);
  });
  if (kvflow_packed_matmul_many(b.down_w.data(), used, rows == 1 ? nullptr : b.rows_of.data(), b.act.data(), inter,
                                b.down.data(), hidden, input_bits, threads))
    return -1;
  std::fill_n(out, static_cast<size_t>(rows) * hidden, 0.f);
  namespace v = simd;
  for (size_t p = 0; p < n_pairs; ++p) {  // ascending expert, so each row sums its experts in that order
    float* o = out + static_cast<int64_t>(b.pair_row[p]) * hidden;
    float* d = b.down.data() + static_cast<int64_t>(p) * hidden;
    if (moe.down_bias) add_bias(d, moe.down_bias + static_cast<int64_t>(b.pair_expert[p]) * hidden, hidden);
    const float w = b.pair_weight[p];
    int j = 0;
    for (; j + v::kLanes <= hidden; j += v::kLanes)
      v::store(o + j, v::add(v::load(o + j), v::mul(v::load(d + j), v::set1(w))));
    for (; j < hidden; ++j) o[j] += d[j] * w;
  }
  return 0;
}

}  // namespace kvflow
