// Prefill attention for CPUs, tiled (flash-attention style): a block of a request's query rows,
// for one KV head, against its visible K/V tokens 32 at a time, with a running maximum and sum
// per query vector. The per-row routine of paged_attention_cpu.cpp reads a request's K/V once per
// query row and sums every q.k horizontally, which bounds it at ~40-70 GFLOPS on prompts; here a
// block of K/V is read once for up to 192 query vectors (rows x the query heads of one KV head)
// and q.k runs as a small GEMM. Its sums run in another order than the per-row routine's, and a
// row's result depends on how its request's rows were split into blocks: not batch-invariant (the
// engine uses it only when batch_invariant is not True).
//
// Paths:
// - bfloat16 on AVX-512 BF16: q.k by `vdpbf16ps` on K transposed into dimension pairs per block;
//   the softmax in float32 (its exp to ~3e-6: exp_bf16_probability); p.v by `vdpbf16ps` on the
//   probabilities rounded to bfloat16 (as flash attention's second GEMM) and V interleaved by token
//   pairs; the output rounded once.
// - float32 on AVX-512: q.k by fused multiply-adds on K transposed per block (32 tokens per
//   dimension); p.v on the probabilities in float32 and V rows read straight from their pages.
// Requests with fewer than TILE_MIN_ROWS query rows (decode rows riding in a prefill step) go
// through the per-row routine (`cbserve_cpu::paged_attention`).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CB_X86 1
#define CB_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#else
#define CB_X86 0
#endif

#include "exp_vector.h"

namespace {

constexpr int64_t BLOCK_TOKENS = 32;  // K/V tokens per block: two vectors of scores per query vector
// Query vectors (rows x query heads of a KV head) per task, at most: each task loads (and transposes)
// its K/V blocks itself, so fewer, larger tasks load them fewer times. 192 against 64: a 2,000-row
// chunk over 4,000 cached positions (the default model's heads, 2 Zen 4 cores) ~1.2x faster in
// bfloat16 and in float32; 256 no faster than 192.
constexpr int64_t TASK_VECTORS = 192;
constexpr int64_t TILE_MIN_ROWS = 4;  // a request with fewer query rows: the per-row routine
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Shape {
  const void* q;  // [T, H, D]: bfloat16 bits or float32
  const void* k;  // [blocks, page, kvH, D]
  const void* v;
  void* out;
  const int64_t* tables;
  int64_t width, page_size, heads, kv_heads, window;
  float scale, softcap;
};

// Rows [r0, r1) of one request (positions p0, p0 + 1, ...) for KV head g.
struct Task {
  int64_t request, g, r0, r1, p0, cost;
};

// One thread's buffers, reused across its tasks.
struct Scratch {
  std::vector<uint16_t> q;      // [vectors][D]: the task's queries, vector m = row * group + head
  std::vector<uint32_t> kt;     // [D / 2][BLOCK_TOKENS]: the block's K, pairs of dimensions per token
  std::vector<uint32_t> vp;     // [BLOCK_TOKENS / 2][D]: the block's V, pairs of tokens per dimension
  std::vector<float> s;         // [vectors][BLOCK_TOKENS]: scores
  std::vector<uint16_t> p;      // [vectors][BLOCK_TOKENS]: probabilities in bfloat16
  std::vector<float> o;         // [vectors][D]: running weighted sums of V
  std::vector<float> top, sum;  // [vectors]: running maximum and sum of exponentials
  // float32 path: its queries, K transposed [D][BLOCK_TOKENS], probabilities, the block's V rows.
  std::vector<float> qf, ktf, pf;
  const float* vrows[BLOCK_TOKENS];
};

#if CB_X86
using cbserve_exp::exp_avx512;

// s[r][0:32] = q_r . k_j for R query vectors against the block's 32 tokens.
template <int R>
CB_AVX512BF16 inline void qk_tile(const uint16_t* q, int64_t dim, const uint32_t* kt, float* s) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(kt + p * BLOCK_TOKENS);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(kt + p * BLOCK_TOKENS + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * dim + 2 * p, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      a0[r] = _mm512_dpbf16_ps(a0[r], x, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], x, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * BLOCK_TOKENS, a0[r]);
    _mm512_storeu_ps(s + r * BLOCK_TOKENS + 16, a1[r]);
  }
}

// The scores of `vectors` query vectors through TILE<R> (qk_tile, qk_tile_f32): 12 at a time, then
// the rest with one instantiation of their count. Shared by the paths, each compiled for its target.
#define CB_QK_ROWS(TILE)                                                                      \
  int64_t r = 0;                                                                              \
  for (; r + 12 <= vectors; r += 12) TILE<12>(q + r * dim, dim, kt, s + r * BLOCK_TOKENS);   \
  const auto* qr = q + r * dim;                                                               \
  float* sr = s + r * BLOCK_TOKENS;                                                           \
  switch (vectors - r) {                                                                      \
    case 11: return TILE<11>(qr, dim, kt, sr);                                                \
    case 10: return TILE<10>(qr, dim, kt, sr);                                                \
    case 9: return TILE<9>(qr, dim, kt, sr);                                                  \
    case 8: return TILE<8>(qr, dim, kt, sr);                                                  \
    case 7: return TILE<7>(qr, dim, kt, sr);                                                  \
    case 6: return TILE<6>(qr, dim, kt, sr);                                                  \
    case 5: return TILE<5>(qr, dim, kt, sr);                                                  \
    case 4: return TILE<4>(qr, dim, kt, sr);                                                  \
    case 3: return TILE<3>(qr, dim, kt, sr);                                                  \
    case 2: return TILE<2>(qr, dim, kt, sr);                                                  \
    case 1: return TILE<1>(qr, dim, kt, sr);                                                  \
    default: break;                                                                           \
  }

CB_AVX512BF16 inline void qk(const uint16_t* q, int64_t vectors, int64_t dim, const uint32_t* kt, float* s) {
  CB_QK_ROWS(qk_tile)
}

// o[r] += sum_j p[r][j] v_j for R query vectors over the block's token pairs [0, pairs), D = 16 * DV:
// `vdpbf16ps` on the probabilities rounded to bfloat16 (as flash attention's p.v GEMM) and V
// interleaved by token pairs, float32 accumulation.
template <int DV, int R>
CB_AVX512BF16 inline void pv_tile(const uint16_t* p, int64_t pairs, const uint32_t* vp, float* o) {
  constexpr int64_t dim = 16 * DV;
  __m512 acc[R][DV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_loadu_ps(o + r * dim + 16 * i);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh vj[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) vj[i] = (__m512bh)_mm512_loadu_si512(vp + jp * dim + 16 * i);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * BLOCK_TOKENS + 2 * jp, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], x, vj[i]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(o + r * dim + 16 * i, acc[r][i]);
}

template <int DV>
CB_AVX512BF16 inline void pv(const uint16_t* p, int64_t vectors, int64_t pairs, const uint32_t* vp, float* o) {
  constexpr int R = DV <= 2 ? 12 : DV == 4 ? 6 : DV == 8 ? 2 : 1;  // accumulators + V pair: <= 32 registers
  int64_t r = 0;
  for (; r + R <= vectors; r += R) pv_tile<DV, R>(p + r * BLOCK_TOKENS, pairs, vp, o + r * 16 * DV);
  for (; r < vectors; ++r) pv_tile<DV, 1>(p + r * BLOCK_TOKENS, pairs, vp, o + r * 16 * DV);
}

// The block's tokens [t0, t0 + n), zero past n: K as dimension pairs per token, V as token pairs
// per dimension.
template <int DV>
CB_AVX512BF16 inline void load_block(const Shape& a, const int64_t* table, const uint16_t* k, const uint16_t* v,
                                     int64_t t0, int64_t n, Scratch& w) {
  constexpr int64_t dim = 16 * DV, pairs = dim / 2;
  const int64_t kv_row = a.kv_heads * dim;
  // Interleaves two rows x, y of 32 bfloat16 values: (x[i], y[i]) for i in [0, 16), then [16, 32).
  alignas(64) static constexpr uint16_t LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(LO), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < BLOCK_TOKENS; j += 2) {
    const uint16_t* vrows[2] = {nullptr, nullptr};
    for (int64_t e = 0; e < 2; ++e) {
      uint32_t kp[pairs] = {};
      if (j + e < n) {
        const int64_t pos = t0 + j + e, slot = table[pos / a.page_size] * a.page_size + pos % a.page_size;
        std::memcpy(kp, k + slot * kv_row, dim * 2);
        vrows[e] = v + slot * kv_row;
      }
      for (int64_t p = 0; p < pairs; ++p) w.kt[p * BLOCK_TOKENS + j + e] = kp[p];
    }
    uint32_t* vp = w.vp.data() + j / 2 * dim;
#pragma GCC unroll 8
    for (int i = 0; i < DV / 2; ++i) {
      const __m512i x = vrows[0] ? _mm512_loadu_si512(vrows[0] + 32 * i) : _mm512_setzero_si512();
      const __m512i y = vrows[1] ? _mm512_loadu_si512(vrows[1] + 32 * i) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + 32 * i, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vp + 32 * i + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// Lane i of the result: `op` over the 16 lanes of v[i]. A transposing tree (46 shuffles and ops
// for 16 vectors, where a horizontal reduction takes 8 each): lane 4q + k of the last step holds
// vector q + 4k, put back in order by one permute.
template <typename Op>
CB_AVX512 inline __m512 reduce16(const __m512* v, Op op) {
  __m512 b[8], c[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // [v(2i) in 8 lanes | v(2i + 1) in 8 lanes]
    b[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // quarter q: v(4i + q) in 4 lanes
    c[i] = op(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 d0 = op(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
  const __m512 d1 = op(_mm512_shuffle_ps(c[2], c[3], 0x44), _mm512_shuffle_ps(c[2], c[3], 0xEE));
  const __m512 e = op(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), e);
}
struct Max16 {
  CB_AVX512 __m512 operator()(__m512 x, __m512 y) const { return _mm512_max_ps(x, y); }
};
struct Add16 {
  CB_AVX512 __m512 operator()(__m512 x, __m512 y) const { return _mm512_add_ps(x, y); }
};

// Scores of query vectors [m0, m1) against the block (tokens [t0, t0 + n)) become probabilities
// under the running maximum; the running sums and the weighted sums of V are rescaled to it. Sixteen
// vectors at a time, so that their maxima, sums and rescaling factors are vector operations (one
// vector at a time, with two horizontal reductions and a scalar exp each, the softmax took a third
// of a long prompt's attention).
// STORE_P(m, p0, p1) writes vector m's 32 probabilities (zeros for a block outside its window: P0
// and P1 zero vectors): the body is shared by the paths, each compiled for its own target.
#define CB_SOFTMAX_BLOCK(STORE_P, EXP)                                                                         \
  constexpr int64_t dim = 16 * DV;                                                                             \
  const __m512 scale = _mm512_set1_ps(a.scale), neg_inf = _mm512_set1_ps(NEG_INF);                             \
  for (int64_t g0 = m0; g0 < m1; g0 += 16) {                                                                   \
    const int64_t count = std::min<int64_t>(16, m1 - g0);                                                      \
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);                                          \
    __m512 part[16];                                                                                           \
    uint32_t seen = 0, keep[16]; /* the vectors that see some of the block; the tokens each sees */           \
    for (int64_t i = 0, row = g0 / group, head = g0 % group; i < 16; ++i, row += ++head == group, head %= group) { \
      part[i] = neg_inf;                                                                                       \
      if (i >= count) continue;                                                                                \
      const int64_t m = g0 + i, pos = t.p0 + row;                                                              \
      const int64_t hi = std::min(n, pos - t0 + 1), lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1 - t0) : 0; \
      if (lo >= hi) continue; /* the block is outside this row's window */                                     \
      seen |= 1u << i;                                                                                         \
      float* s = w.s.data() + m * BLOCK_TOKENS;                                                                \
      const uint32_t bits = static_cast<uint32_t>(((uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1));    \
      keep[i] = bits;                                                                                          \
      __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(s), scale), x1 = _mm512_mul_ps(_mm512_loadu_ps(s + 16), scale); \
      if (a.softcap > 0) {                                                                                     \
        alignas(64) float buf[BLOCK_TOKENS];                                                                   \
        _mm512_store_ps(buf, x0);                                                                              \
        _mm512_store_ps(buf + 16, x1);                                                                         \
        for (float& x : buf) x = a.softcap * std::tanh(x / a.softcap);                                         \
        x0 = _mm512_load_ps(buf);                                                                              \
        x1 = _mm512_load_ps(buf + 16);                                                                         \
      }                                                                                                        \
      x0 = _mm512_mask_mov_ps(neg_inf, static_cast<__mmask16>(bits), x0);                                      \
      x1 = _mm512_mask_mov_ps(neg_inf, static_cast<__mmask16>(bits >> 16), x1);                                \
      _mm512_storeu_ps(s, x0);                                                                                 \
      _mm512_storeu_ps(s + 16, x1);                                                                            \
      part[i] = _mm512_max_ps(x0, x1);                                                                         \
    }                                                                                                          \
    const __m512 old = _mm512_maskz_loadu_ps(live, w.top.data() + g0);                                         \
    const __m512 top = _mm512_max_ps(old, reduce16(part, Max16{}));                                            \
    /* exp(old - new): 0 at a vector's first block (-inf), 1 while it has seen nothing (-inf - -inf) */        \
    const __m512 alpha = _mm512_mask_mov_ps(exp_avx512(_mm512_sub_ps(old, top)),                               \
                                            _mm512_cmp_ps_mask(top, neg_inf, _CMP_EQ_OQ), _mm512_set1_ps(1.0f)); \
    _mm512_mask_storeu_ps(w.top.data() + g0, live, top);                                                       \
    alignas(64) float tops[16], alphas[16];                                                                    \
    _mm512_store_ps(tops, top);                                                                                \
    _mm512_store_ps(alphas, alpha);                                                                            \
    for (int64_t i = 0; i < 16; ++i) {                                                                         \
      part[i] = _mm512_setzero_ps();                                                                           \
      if (i >= count) continue;                                                                                \
      const int64_t m = g0 + i;                                                                                \
      if (!(seen >> i & 1)) {                                                                                  \
        STORE_P(m, _mm512_setzero_ps(), _mm512_setzero_ps())                                                   \
        continue;                                                                                              \
      }                                                                                                        \
      const float* s = w.s.data() + m * BLOCK_TOKENS;                                                          \
      const __m512 tv = _mm512_set1_ps(tops[i]);                                                               \
      const __m512 p0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[i]), EXP(_mm512_sub_ps(_mm512_loadu_ps(s), tv))); \
      const __m512 p1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[i] >> 16), EXP(_mm512_sub_ps(_mm512_loadu_ps(s + 16), tv))); \
      STORE_P(m, p0, p1)                                                                                       \
      part[i] = _mm512_add_ps(p0, p1);                                                                         \
      if (alphas[i] != 1.0f) {                                                                                 \
        float* o = w.o.data() + m * dim;                                                                       \
        const __m512 av = _mm512_set1_ps(alphas[i]);                                                           \
        _Pragma("GCC unroll 16") for (int k = 0; k < DV; ++k)                                                  \
          _mm512_storeu_ps(o + 16 * k, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * k), av));                        \
      }                                                                                                        \
    }                                                                                                          \
    const __m512 sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, w.sum.data() + g0), alpha, reduce16(part, Add16{})); \
    _mm512_mask_storeu_ps(w.sum.data() + g0, live, sum);                                                       \
  }

// exp(x) for x <= 0 to ~3e-6 relative (2^(x log2 e) as 2^n times a degree-4 polynomial in the rest),
// half exp_avx512's instructions: the bfloat16 path rounds its probabilities to bfloat16 (2^-9
// relative) for p.v anyway. Lanes of -inf come out NaN: the caller masks them.
CB_AVX512 inline __m512 exp_bf16_probability(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009560510516166687f), f, _mm512_set1_ps(0.05591703951358795f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
  return _mm512_scalef_ps(p, n);
}

#define CB_STORE_P_BF16(M, P0, P1) \
  _mm512_storeu_si512(w.p.data() + (M) * BLOCK_TOKENS, (__m512i)_mm512_cvtne2ps_pbh(P1, P0));
template <int DV>
CB_AVX512BF16 inline void softmax_block(const Shape& a, const Task& t, int64_t group, int64_t m0, int64_t m1,
                                        int64_t t0, int64_t n, Scratch& w) {
  CB_SOFTMAX_BLOCK(CB_STORE_P_BF16, exp_bf16_probability)
}

template <int DV>
CB_AVX512BF16 __attribute__((flatten)) void run_task(const Shape& a, const Task& t, Scratch& w) {
  constexpr int64_t dim = 16 * DV;
  const int64_t group = a.heads / a.kv_heads, rows = t.r1 - t.r0, vectors = rows * group;
  w.q.resize(vectors * dim);
  w.kt.resize(dim / 2 * BLOCK_TOKENS);
  w.vp.resize(BLOCK_TOKENS / 2 * dim);
  w.s.resize(vectors * BLOCK_TOKENS);
  w.p.resize(vectors * BLOCK_TOKENS);
  w.o.assign(vectors * dim, 0.0f);
  w.top.assign(vectors, NEG_INF);
  w.sum.assign(vectors, 0.0f);
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(w.q.data() + i * group * dim, static_cast<const uint16_t*>(a.q) + ((t.r0 + i) * a.heads + t.g * group) * dim,
                group * dim * 2);
  }
  const int64_t* table = a.tables + t.request * a.width;
  const uint16_t* k = static_cast<const uint16_t*>(a.k) + t.g * dim;
  const uint16_t* v = static_cast<const uint16_t*>(a.v) + t.g * dim;
  const int64_t last = t.p0 + rows - 1, first = a.window > 0 ? std::max<int64_t>(0, t.p0 - a.window + 1) : 0;
  for (int64_t t0 = first; t0 <= last; t0 += BLOCK_TOKENS) {
    const int64_t n = std::min(BLOCK_TOKENS, last + 1 - t0);
    // Rows before the block see none of it (causal); with a window, rows past it neither.
    const int64_t i0 = std::max<int64_t>(0, t0 - t.p0);
    const int64_t i1 = a.window > 0 ? std::min(rows, t0 + n - 1 + a.window - t.p0) : rows;
    if (i0 >= i1) continue;
    load_block<DV>(a, table, k, v, t0, n, w);
    const int64_t m0 = i0 * group, m1 = i1 * group;
    qk(w.q.data() + m0 * dim, m1 - m0, dim, w.kt.data(), w.s.data() + m0 * BLOCK_TOKENS);
    softmax_block<DV>(a, t, group, m0, m1, t0, n, w);
    pv<DV>(w.p.data() + m0 * BLOCK_TOKENS, m1 - m0, (n + 1) / 2, w.vp.data(), w.o.data() + m0 * dim);
  }
  for (int64_t m = 0; m < vectors; ++m) {
    const __m512 inv = _mm512_set1_ps(1.0f / w.sum[m]);  // > 0: a row always sees its own position
    uint16_t* dst = static_cast<uint16_t*>(a.out) + ((t.r0 + m / group) * a.heads + t.g * group + m % group) * dim;
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + m * dim + 16 * i), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// ------------------------------------------------------------------- float32 on AVX-512

// s[r][0:32] = q_r . k_j for R query vectors against the block's 32 tokens (K: [D][32]).
template <int R>
CB_AVX512 inline void qk_tile_f32(const float* q, int64_t dim, const float* kt, float* s) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 w0 = _mm512_loadu_ps(kt + d * BLOCK_TOKENS), w1 = _mm512_loadu_ps(kt + d * BLOCK_TOKENS + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * dim + d]);
      a0[r] = _mm512_fmadd_ps(x, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(x, w1, a1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * BLOCK_TOKENS, a0[r]);
    _mm512_storeu_ps(s + r * BLOCK_TOKENS + 16, a1[r]);
  }
}

CB_AVX512 inline void qk_f32(const float* q, int64_t vectors, int64_t dim, const float* kt, float* s) {
  CB_QK_ROWS(qk_tile_f32)
}

// o[r] += sum_j p[r][j] v_j for R query vectors over the block's first n tokens, D = 16 * DV.
template <int DV, int R>
CB_AVX512 inline void pv_tile_f32(const float* p, int64_t n, const float* const* vrows, float* o) {
  constexpr int64_t dim = 16 * DV;
  __m512 acc[R][DV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_loadu_ps(o + r * dim + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) vj[i] = _mm512_loadu_ps(vrows[j] + 16 * i);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(p[r * BLOCK_TOKENS + j]);
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_fmadd_ps(x, vj[i], acc[r][i]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(o + r * dim + 16 * i, acc[r][i]);
}

template <int DV>
CB_AVX512 inline void pv_f32(const float* p, int64_t vectors, int64_t n, const float* const* vrows, float* o) {
  constexpr int R = DV <= 2 ? 12 : DV == 4 ? 6 : DV == 8 ? 2 : 1;  // accumulators + V row: <= 32 registers
  int64_t r = 0;
  for (; r + R <= vectors; r += R) pv_tile_f32<DV, R>(p + r * BLOCK_TOKENS, n, vrows, o + r * 16 * DV);
  for (; r < vectors; ++r) pv_tile_f32<DV, 1>(p + r * BLOCK_TOKENS, n, vrows, o + r * 16 * DV);
}

// The block's tokens [t0, t0 + n): K transposed (zero past n), and where each V row lives.
template <int DV>
CB_AVX512 inline void load_block_f32(const Shape& a, const int64_t* table, const float* k, const float* v, int64_t t0,
                                     int64_t n, Scratch& w) {
  constexpr int64_t dim = 16 * DV;
  const int64_t kv_row = a.kv_heads * dim;
  for (int64_t j = 0; j < BLOCK_TOKENS; ++j) {
    if (j < n) {
      const int64_t pos = t0 + j, slot = table[pos / a.page_size] * a.page_size + pos % a.page_size;
      const float* kr = k + slot * kv_row;
      for (int64_t d = 0; d < dim; ++d) w.ktf[d * BLOCK_TOKENS + j] = kr[d];
      w.vrows[j] = v + slot * kv_row;
    } else {
      for (int64_t d = 0; d < dim; ++d) w.ktf[d * BLOCK_TOKENS + j] = 0.0f;
    }
  }
}

#define CB_STORE_P_F32(M, P0, P1)                            \
  _mm512_storeu_ps(w.pf.data() + (M) * BLOCK_TOKENS, P0);   \
  _mm512_storeu_ps(w.pf.data() + (M) * BLOCK_TOKENS + 16, P1);
template <int DV>
CB_AVX512 inline void softmax_block_f32(const Shape& a, const Task& t, int64_t group, int64_t m0, int64_t m1,
                                        int64_t t0, int64_t n, Scratch& w) {
  CB_SOFTMAX_BLOCK(CB_STORE_P_F32, exp_avx512)
}

template <int DV>
CB_AVX512 __attribute__((flatten)) void run_task_f32(const Shape& a, const Task& t, Scratch& w) {
  constexpr int64_t dim = 16 * DV;
  const int64_t group = a.heads / a.kv_heads, rows = t.r1 - t.r0, vectors = rows * group;
  w.qf.resize(vectors * dim);
  w.ktf.resize(dim * BLOCK_TOKENS);
  w.s.resize(vectors * BLOCK_TOKENS);
  w.pf.resize(vectors * BLOCK_TOKENS);
  w.o.assign(vectors * dim, 0.0f);
  w.top.assign(vectors, NEG_INF);
  w.sum.assign(vectors, 0.0f);
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(w.qf.data() + i * group * dim, static_cast<const float*>(a.q) + ((t.r0 + i) * a.heads + t.g * group) * dim,
                group * dim * 4);
  }
  const int64_t* table = a.tables + t.request * a.width;
  const float* k = static_cast<const float*>(a.k) + t.g * dim;
  const float* v = static_cast<const float*>(a.v) + t.g * dim;
  const int64_t last = t.p0 + rows - 1, first = a.window > 0 ? std::max<int64_t>(0, t.p0 - a.window + 1) : 0;
  for (int64_t t0 = first; t0 <= last; t0 += BLOCK_TOKENS) {
    const int64_t n = std::min(BLOCK_TOKENS, last + 1 - t0);
    const int64_t i0 = std::max<int64_t>(0, t0 - t.p0);
    const int64_t i1 = a.window > 0 ? std::min(rows, t0 + n - 1 + a.window - t.p0) : rows;
    if (i0 >= i1) continue;
    load_block_f32<DV>(a, table, k, v, t0, n, w);
    const int64_t m0 = i0 * group, m1 = i1 * group;
    qk_f32(w.qf.data() + m0 * dim, m1 - m0, dim, w.ktf.data(), w.s.data() + m0 * BLOCK_TOKENS);
    softmax_block_f32<DV>(a, t, group, m0, m1, t0, n, w);
    pv_f32<DV>(w.pf.data() + m0 * BLOCK_TOKENS, m1 - m0, n, w.vrows, w.o.data() + m0 * dim);
  }
  for (int64_t m = 0; m < vectors; ++m) {
    const __m512 inv = _mm512_set1_ps(1.0f / w.sum[m]);
    float* dst = static_cast<float*>(a.out) + ((t.r0 + m / group) * a.heads + t.g * group + m % group) * dim;
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(dst + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + m * dim + 16 * i), inv));
  }
}
#undef CB_QK_ROWS
#undef CB_SOFTMAX_BLOCK
#undef CB_STORE_P_BF16
#undef CB_STORE_P_F32
#endif  // CB_X86

using TaskFn = void (*)(const Shape&, const Task&, Scratch&);

// The path's task routine for this dtype and head dimension, or nullptr.
TaskFn task_fn(at::ScalarType dtype, int64_t dim) {
#if CB_X86
  const bool bf16 = dtype == at::kBFloat16;
  if (dtype != at::kBFloat16 && dtype != at::kFloat) return nullptr;
  switch (dim) {
    case 32: return bf16 ? run_task<2> : run_task_f32<2>;
    case 64: return bf16 ? run_task<4> : run_task_f32<4>;
    case 128: return bf16 ? run_task<8> : run_task_f32<8>;
    case 256: return bf16 ? run_task<16> : run_task_f32<16>;
    default: break;
  }
#endif
  (void)dtype;
  (void)dim;
  return nullptr;
}

bool cpu_has_avx512(bool bf16) {
#if CB_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         (!bf16 || __builtin_cpu_supports("avx512bf16"));
#else
  (void)bf16;
  return false;
#endif
}

// The path's instruction set: bfloat16 needs AVX-512 BF16 (isa avx512_bf16), float32 AVX-512
// (isa avx512 or avx512_bf16).
bool path_runs(at::ScalarType dtype, const std::string& isa) {
  if (dtype == at::kBFloat16) return isa == "avx512_bf16" && cpu_has_avx512(true);
  return dtype == at::kFloat && (isa == "avx512" || isa == "avx512_bf16") && cpu_has_avx512(false);
}

at::Tensor per_row(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu,
                   const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window, double softcap,
                   const std::string& isa) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cbserve_cpu::paged_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                               int64_t, double, const std::string&)>();
  return op.call(q, k_cache, v_cache, cu, tables, lens, scale, window, softcap, isa);
}

bool tiled_prefill_available(const std::string& dtype, int64_t head_dim) {
  const at::ScalarType type = dtype == "bfloat16" ? at::kBFloat16 : dtype == "float32" ? at::kFloat : at::kDouble;
  return path_runs(type, type == at::kBFloat16 ? "avx512_bf16" : "avx512") && task_fn(type, head_dim) != nullptr;
}

// Same signature and semantics as paged_attention (packed query rows, cu_seqlens_q, block
// tables); bfloat16 tensors on the avx512_bf16 path or float32 ones on avx512 / avx512_bf16, with a
// head dimension of 32, 64, 128 or 256 (tiled_prefill_available).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                                   const std::string& isa) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3), "q [T, H, D] and caches [blocks, page, kvH, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "cbserve_cpu prefill attention: q and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "cbserve_cpu prefill attention: bfloat16 or float32 tensors only");
  TORCH_CHECK(path_runs(q.scalar_type(), isa), "cbserve_cpu prefill attention: bfloat16 runs on the avx512_bf16 path, "
              "float32 on avx512 or avx512_bf16, on a CPU that has it (got isa '", isa, "')");
  const TaskFn run = task_fn(q.scalar_type(), q.size(2));
  TORCH_CHECK(run != nullptr, "cbserve_cpu prefill attention: head dimension 32, 64, 128 or 256, got ", q.size(2));
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(1) % k_cache.size(2) == 0,
              "caches of one shape; query heads a multiple of KV heads");
  const int64_t batch = block_tables.size(0), rows = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.numel() == batch && cu_seqlens_q.numel() == batch + 1,
              "one block table row, context length and cu_seqlens_q entry per request");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous(), cu = cu_seqlens_q.to(at::kLong).contiguous();
  const int64_t *cup = cu.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(cup[0] == 0 && cup[batch] <= rows, "cu_seqlens_q must start at 0 and end within q's rows");
  const int64_t page_size = k_cache.size(1), width = tables.size(1), kv_heads = k_cache.size(2);
  const int64_t group = q.size(1) / kv_heads, task_rows = std::max<int64_t>(1, TASK_VECTORS / group);
  std::vector<Task> tasks;
  std::vector<int64_t> short_rows, short_requests, short_cu{0};
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = cup[b], hi = cup[b + 1];
    TORCH_CHECK(lo <= hi && hi - lo <= lp[b] && lp[b] <= width * page_size,
                "request ", b, ": its query rows must fit its context, and its context its block table");
    if (hi == lo) continue;
    if (hi - lo < TILE_MIN_ROWS) {
      for (int64_t r = lo; r < hi; ++r) short_rows.push_back(r);
      short_requests.push_back(b);
      short_cu.push_back(short_cu.back() + hi - lo);
      continue;
    }
    for (int64_t r0 = lo; r0 < hi; r0 += task_rows) {
      const int64_t r1 = std::min(hi, r0 + task_rows), p0 = lp[b] - (hi - r0);
      const int64_t seen = window > 0 ? std::min(window, p0 + 1) + (r1 - r0) : p0 + 1 + (r1 - r0) / 2;
      for (int64_t g = 0; g < kv_heads; ++g) tasks.push_back({b, g, r0, r1, p0, (r1 - r0) * seen});
    }
  }
  auto out = at::empty_like(q);
  if (cup[batch] < rows) out.narrow(0, cup[batch], rows - cup[batch]).zero_();  // rows of no request
  if (!short_rows.empty()) {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const at::Tensor idx = at::tensor(short_rows, opts), req = at::tensor(short_requests, opts);
    const at::Tensor o = per_row(q.index_select(0, idx), k_cache, v_cache, at::tensor(short_cu, opts),
                                 tables.index_select(0, req), lens.index_select(0, req), scale, window, softcap, isa);
    out.index_copy_(0, idx, o);
  }
  if (tasks.empty()) return out;
  // The longest first, then whoever is free takes the next: causal rows cost more the later they are.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  const Shape a{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                tables.data_ptr<int64_t>(), width, page_size, q.size(1), kv_heads, window,
                static_cast<float>(scale), static_cast<float>(softcap)};
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t thread = begin; thread < end; ++thread) {
      for (int64_t i = next++; i < count; i = next++) run(a, tasks[i], w);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("tiled_prefill_available(str dtype, int head_dim) -> bool", &tiled_prefill_available);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, float softcap, str isa) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
