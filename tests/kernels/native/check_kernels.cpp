// A self-contained check of kvflow's CPU kernels, for builds the Python tests cannot load: other
// architectures (aarch64 under qemu-user) and other threading (the std::thread pool of csrc/threads.h).
// Linked with the kernel sources and built with one tier's flags; tests/kernels/test_native_builds.py
// compiles and runs it. Prints one line per check and exits non-zero on the first failure.
//
//   packed matmul   bitwise equal to a reference of its arithmetic written here (input digits, exact
//                   integer block sums, the float epilogue), 4-, 6- and 8-bit codes and 4-bit codebook
//                   indices, 16- and 8-bit inputs, 1 to 9 rows, 1 and 2 threads
//   paged attention every row against a double-precision softmax, float32 and float16 caches, blocks
//                   token-major and head-major
//   row ops         rms_scale and silu_mul against plain loops
//   vector helpers  int_vectors.h's multiply-add bitwise against std::fma (or against a product and a
//                   sum, each rounded, where the tier has no FMA); its and simd.h's float16 loads against
//                   the compiler's conversion, all 65,536 halves
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "int_vectors.h"
#include "kvflow_cpu.h"
#include "row_ops.h"
#include "simd.h"

namespace {

std::mt19937 rng(1234);

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

void fail(const char* what) {
  std::printf("FAIL %s\n", what);
  std::exit(1);
}

uint16_t half_bits(float x) {
  const kvflow::float16 h = static_cast<kvflow::float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

float half_value(uint16_t bits) {
  kvflow::float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// The layout of kvflow_cpu.h, from codes q [n, k] and float16 scales and offsets [n, k / block].
std::vector<uint8_t> pack(const std::vector<uint8_t>& q, const std::vector<uint16_t>& scale,
                          const std::vector<uint16_t>& offset, int n, int k, int bits, bool has_offset, int block) {
  const int groups = (n + 15) / 16, blocks = k / block, code = 2 * block * bits;
  const int chunk = code + (has_offset ? 64 : 32);
  std::vector<uint8_t> out(static_cast<size_t>(groups) * blocks * chunk, 0);
  for (int g = 0; g < groups; ++g)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* at = out.data() + (static_cast<size_t>(g) * blocks + b) * chunk;
      for (int j = 0; j < 16; ++j) {
        const int col = g * 16 + j;
        if (col >= n) continue;
        for (int i = 0; i < block; ++i) {
          const uint8_t c = q[static_cast<size_t>(col) * k + b * block + i];
          if (bits != 8) {  // the low nibble; a 6-bit code's top two bits in the rows after the nibbles
            uint8_t& byte = at[64 * (i / 8) + 4 * j + i % 4];
            byte |= (i % 8) < 4 ? (c & 15) : static_cast<uint8_t>((c & 15) << 4);
            if (bits == 6)
              at[8 * block + 64 * (i / 16) + 4 * j + i % 4] |= static_cast<uint8_t>((c >> 4) << (2 * ((i % 16) / 4)));
          } else {
            at[64 * (i / 4) + 4 * j + i % 4] = c;
          }
        }
        std::memcpy(at + code + 2 * j, &scale[static_cast<size_t>(col) * blocks + b], 2);
        if (has_offset) std::memcpy(at + code + 32 + 2 * j, &offset[static_cast<size_t>(col) * blocks + b], 2);
      }
    }
  return out;
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// The epilogue's a * b + c as this build's kernel rounds it: once (a fused multiply-add), or twice where the
// generic x86 tier has no FMA (int_vectors.h).
#if defined(KVFLOW_IVEC_ROUNDS_TWICE)
constexpr bool kFused = false;
float epilogue_step(float a, float b, float c) {
  volatile float product = a * b;  // volatile: never contracted into a fused one
  return product + c;
}
#else
constexpr bool kFused = true;
float epilogue_step(float a, float b, float c) { return std::fma(a, b, c); }
#endif

// What the packed matmul computes, written out plainly: digits per block of `block` inputs, exact integer
// sums, then acc = epilogue_step(dot, scale * input scale, acc), and the offset times the input sum, per block.
float reference_output(const float* x, const std::vector<uint8_t>& q, const std::vector<float>& scale,
                       const std::vector<float>& offset, int col, int k, bool has_offset, bool bits8, int block,
                       int centre) {
  const int32_t kMaxInt = bits8 ? 127 : 32639;
  float acc = 0.f;
  for (int b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.f;
    for (int i = 0; i < block; ++i) amax = std::fabs(xb[i]) > amax ? std::fabs(xb[i]) : amax;
    const float s = amax / kMaxInt, inv = amax > 0.f ? kMaxInt / amax : 0.f;
    int64_t dot = 0, total = 0;
    for (int i = 0; i < block; ++i) {
      int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      v = v > kMaxInt ? kMaxInt : (v < -kMaxInt ? -kMaxInt : v);
      dot += static_cast<int64_t>(q[static_cast<size_t>(col) * k + b * block + i]) * v;
      total += v;
    }
    const size_t at = static_cast<size_t>(col) * (k / block) + b;
    acc = epilogue_step(static_cast<float>(static_cast<int32_t>(dot)), scale[at] * s, acc);
    if (has_offset) acc = epilogue_step(offset[at], s * static_cast<float>(total), acc);
    if (centre) acc = epilogue_step(scale[at] * -static_cast<float>(centre), s * static_cast<float>(total), acc);
  }
  return acc;
}

// One packed weight against reference_output for every row count, thread count and input width.
void check_weight(const KvflowPackedWeight& w, const std::vector<uint8_t>& q, const std::vector<float>& scale,
                  const std::vector<float>& offset) {
  const int n = static_cast<int>(w.n), k = static_cast<int>(w.k);
  for (int m : {1, 2, 3, 5, 9})
    for (int threads : {1, 2})
      for (bool bits8 : {false, true}) {
        std::vector<float> x(static_cast<size_t>(m) * k), y(static_cast<size_t>(m) * n, NAN);
        for (auto& v : x) v = uniform(-4.f, 4.f);
        if (kvflow_packed_matmul(&w, x.data(), k, m, y.data(), n, bits8 ? 8 : 16, threads) != 0)
          fail("packed matmul refused");
        for (int r = 0; r < m; ++r)
          for (int c = 0; c < n; ++c) {
            const float want = reference_output(x.data() + r * k, q, scale, offset, c, k, w.has_offset != 0, bits8,
                                                w.block, w.centre);
            const float got = y[static_cast<size_t>(r) * n + c];
            if (std::memcmp(&want, &got, 4) != 0) {
              std::printf("block %d bits %d offset %d centre %d n %d m %d threads %d 8-bit inputs %d row %d col %d: "
                          "%.9g != %.9g\n", w.block, w.bits, w.has_offset, w.centre, n, m, threads, bits8, r, c, got,
                          want);
              fail("packed matmul differs from its reference");
            }
          }
      }
}

// The K-quants' own scales (kvflow_cpu.h, super_scales): per block of 32 a byte sc and m per column, per 256
// inputs a float16 d and dmin; scale = d * sc, offset = -(dmin * m).
void check_super_scales(const std::vector<uint8_t>& q, int n, int bits) {
  const int k = 512, blocks = k / 32, groups = (n + 15) / 16, code = 2 * 32 * bits, chunk = code + 32;
  std::vector<uint8_t> codes_q(static_cast<size_t>(n) * k);
  for (size_t i = 0; i < codes_q.size(); ++i) codes_q[i] = q[i % q.size()];
  const std::vector<uint16_t> unused(static_cast<size_t>(n) * blocks, 0);
  const std::vector<uint8_t> plain = pack(codes_q, unused, unused, n, k, bits, false, 32);  // codes, zero scales
  std::vector<uint8_t> data(static_cast<size_t>(groups) * blocks * chunk, 0), supers(static_cast<size_t>(groups) * 2 * 64);
  std::vector<float> scale(static_cast<size_t>(n) * blocks), offset(scale.size());
  for (int g = 0; g < groups; ++g)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* at = data.data() + (static_cast<size_t>(g) * blocks + b) * chunk;
      std::memcpy(at, plain.data() + (static_cast<size_t>(g) * blocks + b) * (code + 32), code);
      uint8_t* d = supers.data() + (static_cast<size_t>(g) * 2 + b / 8) * 64;
      for (int j = 0; j < 16; ++j) {
        const int col = g * 16 + j;
        if (b % 8 == 0) {
          const uint16_t dh = half_bits(uniform(0.0005f, 0.002f)), mh = half_bits(uniform(0.0005f, 0.002f));
          std::memcpy(d + 2 * j, &dh, 2), std::memcpy(d + 32 + 2 * j, &mh, 2);
        }
        at[code + j] = static_cast<uint8_t>(rng() % 64), at[code + 16 + j] = static_cast<uint8_t>(rng() % 64);
        if (col >= n) continue;
        uint16_t dh, mh;
        std::memcpy(&dh, d + 2 * j, 2), std::memcpy(&mh, d + 32 + 2 * j, 2);
        scale[static_cast<size_t>(col) * blocks + b] = half_value(dh) * static_cast<float>(at[code + j]);
        offset[static_cast<size_t>(col) * blocks + b] = -(half_value(mh) * static_cast<float>(at[code + 16 + j]));
      }
    }
  KvflowPackedWeight w{data.data(), n, k, bits, 1, 32, 0};
  w.super_scales = supers.data();
  check_weight(w, codes_q, scale, offset);
}

// The codebooks of kvflow_cpu.h, written out here: IQ4_NL's values and MXFP4's doubled E2M1 values, + 128.
const uint8_t kBooks[2][16] = {{1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241},
                               {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116}};

// The same 4-bit data as indices into each codebook: the codes the sums use are its entries, centred on 128.
void check_codebooks(const std::vector<uint8_t>& data, const std::vector<uint8_t>& q, const std::vector<float>& scale,
                     const std::vector<float>& offset, int n, int k, int block) {
  for (int book : {1, 2}) {
    uint8_t table[16];
    if (kvflow_packed_codebook(book, table) != 0 || std::memcmp(table, kBooks[book - 1], 16) != 0)
      fail("codebook differs from the one written here");
    std::vector<uint8_t> codes(q.size());
    for (size_t i = 0; i < q.size(); ++i) codes[i] = kBooks[book - 1][q[i]];
    KvflowPackedWeight w{data.data(), n, k, 4, 0, block, 128, nullptr, book};
    check_weight(w, codes, scale, offset);
  }
}

void check_packed_matmul() {
  KvflowTuning tuning{16, 8, 8};
  kvflow_set_tuning(&tuning);
  for (int block : {32, 16})
    for (int bits : {4, 6, 8})
      for (bool has_offset : {true, false})
        for (int n : {16, 40, 200}) {
          const int k = 96;
          std::vector<uint8_t> q(static_cast<size_t>(n) * k);
          for (auto& c : q) c = static_cast<uint8_t>(rng() % (1u << bits));
          std::vector<uint16_t> scale(static_cast<size_t>(n) * k / block), offset(scale.size());
          for (size_t i = 0; i < scale.size(); ++i) {
            scale[i] = half_bits(uniform(0.001f, 0.05f));
            offset[i] = half_bits(uniform(-0.3f, 0.3f));
          }
          const std::vector<uint8_t> data = pack(q, scale, offset, n, k, bits, has_offset, block);
          std::vector<float> scale_f(scale.size()), offset_f(scale.size());
          for (size_t i = 0; i < scale.size(); ++i) scale_f[i] = half_value(scale[i]), offset_f[i] = half_value(offset[i]);
          check_weight({data.data(), n, k, bits, has_offset ? 1 : 0, block, 0}, q, scale_f, offset_f);
          if (!has_offset)  // the same codes as symmetric ones: offsets -centre * scale, derived, not stored
            check_weight({data.data(), n, k, bits, 0, block, 1 << (bits - 1)}, q, scale_f, offset_f);
          if (has_offset && block == 32 && bits != 8) check_super_scales(q, n, bits);
          if (!has_offset && bits == 4) check_codebooks(data, q, scale_f, offset_f, n, k, block);
        }
  std::printf("ok packed matmul (path %d), 4-, 6- and 8-bit codes and codebooks, blocks of 32 and 16, stored, derived and K-quant "
              "scales and offsets: "
              "bitwise equal to the reference\n", kvflow_packed_matmul_path());
}

// A cache in either block layout (kvflow_cpu.h): token-major [block, position, kv head, d] or head-major
// [block, kv head, position, d]. The reference reads its own token-major copy.
template <typename T>
void check_attention(int cache_dtype, const char* name, bool head_major) {
  const int hkv = 2, group = 3, hq = hkv * group, d = 64, block = 16;
  const int seqs = 3, context[seqs] = {37, 300, 5}, qlen[seqs] = {1, 7, 5};  // decode, chunk after context, prompt
  int total_blocks = 0;
  std::vector<int32_t> tables;
  const int width = 20;
  for (int b = 0; b < seqs; ++b)
    for (int i = 0; i < width; ++i) tables.push_back(i < (context[b] + block - 1) / block ? total_blocks++ : 0);
  std::vector<T> k_cache(static_cast<size_t>(total_blocks) * block * hkv * d), v_cache(k_cache.size());
  std::vector<float> k_ref(k_cache.size()), v_ref(k_cache.size());
  auto cache_at = [&](int64_t slot, int kv) {  // where (slot, kv head)'s row starts in the kernel's cache
    return head_major ? ((slot / block * hkv + kv) * block + slot % block) * d : (slot * hkv + kv) * d;
  };
  for (int64_t slot = 0; slot < static_cast<int64_t>(total_blocks) * block; ++slot)
    for (int kv = 0; kv < hkv; ++kv)
      for (int i = 0; i < d; ++i) {
        T& kc = k_cache[cache_at(slot, kv) + i];
        T& vc = v_cache[cache_at(slot, kv) + i];
        kvflow::narrow(uniform(-1.f, 1.f), &kc);
        kvflow::narrow(uniform(-1.f, 1.f), &vc);
        k_ref[(slot * hkv + kv) * d + i] = kvflow::widen(kc);
        v_ref[(slot * hkv + kv) * d + i] = kvflow::widen(vc);
      }
  std::vector<int32_t> query_start{0}, seq_lens;
  std::vector<int64_t> slots;
  for (int b = 0; b < seqs; ++b) {
    query_start.push_back(query_start.back() + qlen[b]);
    seq_lens.push_back(context[b]);
    for (int p = context[b] - qlen[b]; p < context[b]; ++p)
      slots.push_back(static_cast<int64_t>(tables[b * width + p / block]) * block + p % block);
  }
  const int rows = query_start.back();
  std::vector<float> q(static_cast<size_t>(rows) * hq * d), k_new(static_cast<size_t>(rows) * hkv * d), v_new(k_new.size());
  for (auto& v : q) v = uniform(-1.f, 1.f);
  for (size_t i = 0; i < k_new.size(); ++i) k_new[i] = uniform(-1.f, 1.f), v_new[i] = uniform(-1.f, 1.f);
  for (int t = 0; t < rows; ++t)  // the reference sees the new rows as the cache will store them
    for (int i = 0; i < hkv * d; ++i) {
      T kt, vt;
      kvflow::narrow(k_new[t * hkv * d + i], &kt);
      kvflow::narrow(v_new[t * hkv * d + i], &vt);
      k_ref[slots[t] * hkv * d + i] = kvflow::widen(kt);
      v_ref[slots[t] * hkv * d + i] = kvflow::widen(vt);
    }
  const float scale = 0.125f;
  KvflowAttention layer{k_cache.data(), v_cache.data(), cache_dtype, block, hq, hkv, d, scale};
  layer.head_major = head_major ? 1 : 0;
  KvflowStep step{slots.data(), query_start.data(), seq_lens.data(), tables.data(), width, seqs, rows};
  KvflowRows in{q.data(), hq * d, k_new.data(), hkv * d, v_new.data(), hkv * d};
  std::vector<float> out(static_cast<size_t>(rows) * hq * d, NAN);
  for (int threads : {1, 2}) {
    if (kvflow_paged_attention(&layer, &step, &in, out.data(), hq * d, 1, threads) != 0) fail("attention refused");
    for (int b = 0; b < seqs; ++b)
      for (int r = 0; r < qlen[b]; ++r) {
        const int row = query_start[b] + r, seen = context[b] - qlen[b] + r + 1;
        for (int h = 0; h < hq; ++h) {
          std::vector<double> w(seen);
          double m = -1e300, total = 0;
          for (int p = 0; p < seen; ++p) {
            const int64_t slot = static_cast<int64_t>(tables[b * width + p / block]) * block + p % block;
            double s = 0;
            for (int i = 0; i < d; ++i) s += q[(row * hq + h) * d + i] * k_ref[(slot * hkv + h / group) * d + i];
            w[p] = s * scale;
            m = w[p] > m ? w[p] : m;
          }
          for (int p = 0; p < seen; ++p) total += (w[p] = std::exp(w[p] - m));
          for (int i = 0; i < d; ++i) {
            double want = 0;
            for (int p = 0; p < seen; ++p) {
              const int64_t slot = static_cast<int64_t>(tables[b * width + p / block]) * block + p % block;
              want += w[p] / total * v_ref[(slot * hkv + h / group) * d + i];
            }
            const double got = out[(static_cast<size_t>(row) * hq + h) * d + i];
            if (!(std::fabs(got - want) <= 2e-5 + 2e-5 * std::fabs(want))) {
              std::printf("%s (%s-major) row %d head %d dim %d: %.7g != %.7g\n", name, head_major ? "head" : "token", row,
                          h, i, got, want);
              fail("paged attention differs from the reference");
            }
          }
        }
      }
  }
  std::printf("ok paged attention, %s cache, %s-major blocks: every row within 2e-5 of a double softmax\n", name,
              head_major ? "head" : "token");
}

void check_row_ops() {
  std::vector<float> x(77), gate(77), up(77), got(77);
  for (size_t i = 0; i < x.size(); ++i) x[i] = uniform(-3.f, 3.f), gate[i] = uniform(-9.f, 9.f), up[i] = uniform(-2.f, 2.f);
  double ss = 0;
  for (float v : x) ss += static_cast<double>(v) * v;
  const double want = 1.0 / std::sqrt(ss / x.size() + 1e-5);
  if (std::fabs(kvflow::rms_scale(x.data(), 77, 1e-5f) - want) > 1e-5 * want) fail("rms_scale");
  kvflow::silu_mul(gate.data(), up.data(), got.data(), 77);
  for (size_t i = 0; i < got.size(); ++i) {
    const double s = gate[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))) * up[i];
    if (std::fabs(got[i] - s) > 1e-5 + 2e-6 * std::fabs(s)) fail("silu_mul");
  }
  std::printf("ok row ops: rms_scale and silu_mul\n");
}


// int_vectors.h's multiply-add lane by lane against epilogue_step (fused, or rounded twice where the tier
// has no FMA), on random triples of every magnitude, then the float16 loads.
void check_vector_helpers() {
  std::vector<float> a, b, c;
  for (int i = 0; i < 40000; ++i) {
    a.push_back(std::ldexp(uniform(-1.f, 1.f), static_cast<int>(uniform(-70.f, 60.f))));
    b.push_back(std::ldexp(uniform(-1.f, 1.f), static_cast<int>(uniform(-70.f, 60.f))));
    c.push_back(std::ldexp(uniform(-1.f, 1.f), static_cast<int>(uniform(-140.f, 120.f))));
  }
  for (size_t i = 0; i < a.size(); i += 4) {
    float got[4];
    kvflow::ivec::store(got, kvflow::ivec::multiply_add(kvflow::ivec::loadf(&a[i]), kvflow::ivec::loadf(&b[i]),
                                                        kvflow::ivec::loadf(&c[i])));
    for (int j = 0; j < 4; ++j)
      if (bits_of(got[j]) != bits_of(epilogue_step(a[i + j], b[i + j], c[i + j]))) fail("multiply_add");
  }
  for (uint32_t h = 0; h < 65536; h += 16) {  // 16: the widest tier's lanes
    uint8_t bytes[32];
    float got[16], loaded[16];
    kvflow::float16 halves[16];
    for (int j = 0; j < 16; ++j) {
      const uint16_t v = static_cast<uint16_t>(h + j);
      std::memcpy(bytes + 2 * j, &v, 2);
      std::memcpy(&halves[j], &v, 2);
    }
    for (int j = 0; j < 16; j += 4) kvflow::ivec::store(got + j, kvflow::ivec::halves(bytes + 2 * j));
    for (int j = 0; j < 16; j += kvflow::simd::kLanes) kvflow::simd::store(loaded + j, kvflow::simd::load(halves + j));
    for (int j = 0; j < 16; ++j) {
      const float want = static_cast<float>(halves[j]);  // NaNs: any NaN (quieted or not)
      auto same = [want](float x) { return std::isnan(want) ? std::isnan(x) : bits_of(x) == bits_of(want); };
      if (!same(got[j]) || !same(loaded[j]) || !same(kvflow::widen(halves[j]))) fail("float16 loads");
    }
  }
  std::printf("ok vector helpers: %zu multiply-adds (%s), 65536 halves\n", a.size(), kFused ? "fused" : "rounded twice");
}

}  // namespace

int main() {
  std::printf("packed matmul path %d\n", kvflow_packed_matmul_path());  // which kernel the build took
  check_vector_helpers();
  check_packed_matmul();
  for (bool head_major : {false, true}) {
    check_attention<float>(0, "float32", head_major);
    check_attention<kvflow::float16>(2, "float16", head_major);
  }
  check_row_ops();
  std::printf("all kernels ok\n");
  return 0;
}
