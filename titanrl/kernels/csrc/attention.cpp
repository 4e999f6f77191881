// Batch-invariant causal grouped-query attention forward for CPU (see cpu_attention.py).
//
// The bits of one query's output are fixed by this file's arithmetic alone:
//   score_j = dot(q, k_j) * scale      dot: 8 (float) / 4 (double) lane partial sums over
//                                      head_dim in index order, then a fixed halving tree
//   m = max_j score_j                  keys j = 0, 1, ..., n-1 in order
//   p_j = exp(score_j - m)             float: `exp_nonpositive` below (basic operations
//                                      only, so it vectorizes and needs no libm); double: libm
//   l = sum_j p_j                      sequential in j
//   out[d] = (sum_j p_j * v_j[d]) / l  sequential in j, per d
// where n = the number of keys the query may see. Nothing depends on which other queries,
// heads or sequences share the call, on where keys are stored (the caller passes an address
// scheme, so a dense [B, T, H, D] tensor and vLLM's paged cache are read alike, in place), or
// on how the work is split across threads. Build with -ffp-contract=off so the compiler
// cannot fuse a multiply and an add into an FMA in one build and not another.
//
// The float path for head_dim a multiple of 8 is written with explicit 8-lane vectors and
// works on 4 keys (scores) or up to 64 value columns (weighted sum) at a time; every element
// still goes through exactly the operations above, in the same order, so it has the bits of
// the plain loops (tests/test_kernels.py checks the two against each other).

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
constexpr int kLanes = 32 / sizeof(T);  // partial sums

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  constexpr int L = kLanes<T>;
  T acc[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    for (int l = 0; l < L; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int width = L / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

// exp(x) for x <= 0 in float: Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// Taylor polynomial for exp(r), and 2^n from the exponent bits (relative error <= 2.4e-7 over
// [-80, 0], about 2 ulp, against double exp).
// Inputs below -87 are taken as -87 (exp = 1.6e-38, nothing next to the largest key's 1), which
// keeps 2^n a normal float. Plain arithmetic, so the loop that calls it vectorizes with the same
// bits as scalar code.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float exp_nonpositive_or_libm(float x) { return exp_nonpositive(x); }
inline double exp_nonpositive_or_libm(double x) { return std::exp(x); }

typedef float Lanes8 __attribute__((vector_size(32)));

inline Lanes8 load8(const float* p) {
  Lanes8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

// The end of `dot<float>` for an 8-lane accumulator: the same halving tree.
inline float reduce8(Lanes8 acc) {
  float r[8];
  __builtin_memcpy(r, &acc, sizeof(r));
  for (int width = 4; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) r[l] += r[l + width];
  }
  return r[0];
}

// Scores of one query row against keys `key[0..n)` (offsets into k), head_dim % 8 == 0:
// `dot<float>(q, k_j, dim) * scale` for each j, four keys per pass.
void scores_f32(const float* q, const float* k, const int64_t* key, int64_t n, int64_t dim, float scale,
                float* out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = k + key[j], *k1 = k + key[j + 1], *k2 = k + key[j + 2], *k3 = k + key[j + 3];
    Lanes8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t i = 0; i < dim; i += 8) {
      const Lanes8 x = load8(q + i);
      a0 += x * load8(k0 + i);
      a1 += x * load8(k1 + i);
      a2 += x * load8(k2 + i);
      a3 += x * load8(k3 + i);
    }
    out[j] = reduce8(a0) * scale;
    out[j + 1] = reduce8(a1) * scale;
    out[j + 2] = reduce8(a2) * scale;
    out[j + 3] = reduce8(a3) * scale;
  }
  for (; j < n; ++j) out[j] = dot(q, k + key[j], dim) * scale;
}

// sum_j p[j] * v_j[c0 .. c0 + 8C) over keys 0..n-1 in order, kept in C vector registers.
template <int C>
void weighted_columns_f32(const float* p, const float* v, const int64_t* key, int64_t n, int64_t c0,
                          float* acc) {
  Lanes8 a[C] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + key[j] + c0;
    const float pj = p[j];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) a[c] += pj * load8(vj + 8 * c);
  }
  __builtin_memcpy(acc + c0, a, sizeof(a));
}

// acc[d] = sum_j p[j] * v_j[d] for d < dim (head_dim % 8 == 0), sequential in j per d.
void weighted_values_f32(const float* p, const float* v, const int64_t* key, int64_t n, int64_t dim, float* acc) {
  for (int64_t c0 = 0; c0 < dim; c0 += 64) {
    switch ((dim - c0) >= 64 ? 8 : (dim - c0) / 8) {
      case 8: weighted_columns_f32<8>(p, v, key, n, c0, acc); break;
      case 7: weighted_columns_f32<7>(p, v, key, n, c0, acc); break;
      case 6: weighted_columns_f32<6>(p, v, key, n, c0, acc); break;
      case 5: weighted_columns_f32<5>(p, v, key, n, c0, acc); break;
      case 4: weighted_columns_f32<4>(p, v, key, n, c0, acc); break;
      case 3: weighted_columns_f32<3>(p, v, key, n, c0, acc); break;
      case 2: weighted_columns_f32<2>(p, v, key, n, c0, acc); break;
      default: weighted_columns_f32<1>(p, v, key, n, c0, acc); break;
    }
  }
}

// Scores and weighted values: the vector paths for float with head_dim % 8 == 0, else plain
// loops. Both give the same bits (see the top of the file).
template <typename T>
void query_scores(const T* q, const T* k, const int64_t* key, int64_t n, int64_t dim, T scale, T* out,
                  bool vector_path) {
  if constexpr (std::is_same_v<T, float>) {
    if (vector_path) return scores_f32(q, k, key, n, dim, scale, out);
  }
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, k + key[j], dim) * scale;
}

template <typename T>
void weighted_values(const T* p, const T* v, const int64_t* key, int64_t n, int64_t dim, T* acc, bool vector_path) {
  if constexpr (std::is_same_v<T, float>) {
    if (vector_path) return weighted_values_f32(p, v, key, n, dim, acc);
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] = T(0);
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + key[j];
    const T pj = p[j];
    for (int64_t d = 0; d < dim; ++d) acc[d] += pj * vj[d];
  }
}

// Where the keys of one request live: key j of kv head h is at
//   base + table[j / block_size] * block_stride + h * head_stride + (j % block_size) * token_stride.
struct KeySource {
  const int64_t* table;
  int64_t block_size, block_stride, head_stride, token_stride;
  // Offsets of keys 0..n-1 of kv head h, walking block by block (no division per key).
  void offsets(int64_t h, int64_t n, int64_t* out) const {
    for (int64_t b = 0, j = 0; j < n; ++b) {
      const int64_t base = table[b] * block_stride + h * head_stride;
      for (int64_t i = 0; i < block_size && j < n; ++i, ++j) out[j] = base + i * token_stride;
    }
  }
};

// Queries of token t (all `groups` query heads of kv head h) over their n visible keys.
template <typename T>
void attend(const T* q, int64_t q_head_stride, const T* k, const T* v, const KeySource& src, int64_t h,
            int64_t n, int64_t groups, int64_t dim, T scale, T* out, int64_t out_head_stride, T* lse,
            std::vector<T>& scores, std::vector<T>& acc, std::vector<int64_t>& offsets, bool vector_path) {
  if (n <= 0) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t d = 0; d < dim; ++d) out[g * out_head_stride + d] = T(0);
      if (lse) lse[g] = INFINITY;  // no key: every probability is exp(-inf) = 0 in the backward
    }
    return;
  }
  scores.resize(static_cast<size_t>(groups * n));
  acc.resize(static_cast<size_t>(groups * dim));
  offsets.resize(static_cast<size_t>(n));
  src.offsets(h, n, offsets.data());
  for (int64_t g = 0; g < groups; ++g) {
    query_scores(q + g * q_head_stride, k, offsets.data(), n, dim, scale, scores.data() + g * n, vector_path);
  }
  std::vector<T> sums(groups);  // small: groups <= a few dozen
  for (int64_t g = 0; g < groups; ++g) {
    T* s = scores.data() + g * n;
    T m = s[0];
    for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
    for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive_or_libm(s[j] - m);
    T l = T(0);
    for (int64_t j = 0; j < n; ++j) l += s[j];
    sums[g] = l;
    if (lse) lse[g] = m + std::log(l);
  }
  for (int64_t g = 0; g < groups; ++g) {
    weighted_values(scores.data() + g * n, v, offsets.data(), n, dim, acc.data() + g * dim, vector_path);
  }
  for (int64_t g = 0; g < groups; ++g) {
    T* o = out + g * out_head_stride;
    for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] / sums[g];
  }
}

// q: [N, Hq, D] rows (token stride q_token_stride, head stride q_head_stride, D contiguous);
// out likewise; lse: [N, Hq] contiguous or null. Request r owns tokens
// query_start[r] .. query_start[r+1]-1, the first at position first_pos[r]; a token at
// position p sees keys 0 .. min(p + 1, kv_len[r]) - 1. table: [R, table_stride] block ids.
template <typename T>
void forward(const T* q, int64_t q_token_stride, int64_t q_head_stride, const T* k, const T* v,
             const int64_t* table, int64_t table_stride, int64_t block_size, int64_t block_stride,
             int64_t head_stride, int64_t token_stride, const int64_t* query_start, const int64_t* first_pos,
             const int64_t* kv_len, int64_t num_requests, int64_t num_q_heads, int64_t num_kv_heads,
             int64_t dim, T scale, T* out, int64_t out_token_stride, int64_t out_head_stride, T* lse,
             int num_threads, bool plain_loops) {
  const bool vector_path = !plain_loops && dim % 8 == 0;
  const int64_t groups = num_q_heads / num_kv_heads;
  const int64_t tokens = query_start[num_requests];
  // One task per (token, kv head); the owning request of a token is found by bisection.
  const int64_t tasks = tokens * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<T> scores, acc;
    std::vector<int64_t> offsets;
#pragma omp for schedule(dynamic, 8)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t t = task / num_kv_heads, h = task % num_kv_heads;
      int64_t lo = 0, hi = num_requests - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
      }
      const int64_t r = lo;
      const int64_t pos = first_pos[r] + (t - query_start[r]);
      const int64_t n = pos + 1 < kv_len[r] ? pos + 1 : kv_len[r];
      const KeySource src{table + r * table_stride, block_size, block_stride, head_stride, token_stride};
      const int64_t head0 = h * groups;
      attend<T>(q + t * q_token_stride + head0 * q_head_stride, q_head_stride, k, v, src, h, n, groups, dim,
                scale, out + t * out_token_stride + head0 * out_head_stride, out_head_stride,
                lse ? lse + t * num_q_heads + head0 : nullptr, scores, acc, offsets, vector_path);
    }
  }
}

}  // namespace

extern "C" {

#define TITANRL_ATTENTION_ENTRY(NAME, T)                                                                   \
  void NAME(const T* q, int64_t q_token_stride, int64_t q_head_stride, const T* k, const T* v,             \
            const int64_t* table, int64_t table_stride, int64_t block_size, int64_t block_stride,          \
            int64_t head_stride, int64_t token_stride, const int64_t* query_start, const int64_t* first_pos, \
            const int64_t* kv_len, int64_t num_requests, int64_t num_q_heads, int64_t num_kv_heads,        \
            int64_t dim, double scale, T* out, int64_t out_token_stride, int64_t out_head_stride, T* lse,  \
            int num_threads, int plain_loops) {                                                            \
    forward<T>(q, q_token_stride, q_head_stride, k, v, table, table_stride, block_size, block_stride,      \
               head_stride, token_stride, query_start, first_pos, kv_len, num_requests, num_q_heads,       \
               num_kv_heads, dim, static_cast<T>(scale), out, out_token_stride, out_head_stride, lse,      \
               num_threads, plain_loops != 0);                                                             \
  }

TITANRL_ATTENTION_ENTRY(titanrl_attention_forward_f32, float)
TITANRL_ATTENTION_ENTRY(titanrl_attention_forward_f64, double)

}  // extern "C"
