// Paged attention for CPUs, read straight from the pages through the block table (no gathered
// copy): packed query rows of several requests (decode rows, prefill chunks, or both), each
// causal over its request's cached tokens, GQA by reading each KV head once for its group of
// query heads, optional sliding window and soft-capping. Also the store of a step's new K/V rows
// into their pages (`store_kv`).
//
// One routine computes every query row, whatever the batch around it: the row's visible positions
// in segments of 512 (SEGMENT), each one's scores in order, their maximum, exp and sum in order,
// then its probability-weighted sum of V rows in order, all in float (double for double tensors);
// a row of one segment is divided by its sum, a longer row's segments combine in order, rescaled
// to their largest maximum, with one division. A row's result therefore depends only on its own
// query, its position and its request's K/V: not on the other rows of the call, on chunk
// boundaries, on decode vs prefill, or on the thread split (batch invariance).
//
// Paths by instruction set, chosen at run time (`isa`): "generic" (plain C++, any dtype),
// "avx2" and "avx512" (float32 and bfloat16 K/V, bfloat16 widened to float32), "avx512_bf16"
// (bfloat16: q.k through `vdpbf16ps`, float32 accumulation). Each path is compiled with its own
// target attribute (its entry is `flatten`ed so the vector helpers inline into it).
//
// Work split: tasks are (query row, KV head group) pairs; a task reads whole token rows (every
// KV head) so K/V stream sequentially, and with fewer rows than ~4 per thread tasks split by KV
// head instead, and a row longer than a segment by segment (one stream over 4,000 positions, the
// default model's shape on 2 cores: 5.4 -> 2.9 ms a step). Tasks go to threads in turn (strided),
// which balances causal prefill rows; a few rows' pieces of unequal length are taken as they come.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CB_X86 1
#define CB_AVX2 __attribute__((target("avx2,fma")))
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define CB_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#else
#define CB_X86 0
#endif

#include "exp_vector.h"

namespace {

struct Args {
  const void* q;  // [T, H, D]
  const void* k;  // [blocks, page, kvH, D]
  const void* v;
  void* out;  // [T, H, D]
  const int64_t* tables;  // [B, width]
  const int64_t* lens;  // [B]
  const int64_t* row_request;  // [T]: the request of each query row
  const int64_t* row_position;  // [T]: its position
  int64_t heads, dim, page_size, kv_heads, width, window;
  double scale, softcap;
};

// Calls f(j, slot) for the positions [first, last] of a request, j counting from 0, walking the
// block table a page at a time (one division per page, not per token).
template <typename F>
inline void for_each_slot(const int64_t* table, int64_t page_size, int64_t first, int64_t last, F&& f) {
  for (int64_t pos = first; pos <= last;) {
    const int64_t off = pos % page_size;
    const int64_t count = std::min(page_size - off, last + 1 - pos);
    const int64_t base = table[pos / page_size] * page_size + off;
    for (int64_t t = 0; t < count; ++t) f(pos - first + t, base + t);
    pos += count;
  }
}

// A request's visible positions [first, last] and where they live.
struct Slots {
  const int64_t* table;
  int64_t page_size, first, last;
};

// for (j, slot) over a Slots (j counting from 0), a page at a time, without a lambda: vector code
// must stay inside its own target function.
#define CB_FOR_SLOTS(S, J, SLOT)                                                                        \
  for (int64_t pos_ = (S).first; pos_ <= (S).last; pos_ = (pos_ / (S).page_size + 1) * (S).page_size)   \
    for (int64_t J = pos_ - (S).first,                                                                  \
                 SLOT = (S).table[pos_ / (S).page_size] * (S).page_size + pos_ % (S).page_size,         \
                 end_ = std::min((pos_ / (S).page_size + 1) * (S).page_size, (S).last + 1) - (S).first; \
         J < end_; ++J, ++SLOT)

// --------------------------------------------------------------------------- vector helpers
//
// Ops<T> provides, for query rows held as Q and K/V stored as T, accumulating in Acc:
//   load_q(Q* dst, const T* src, d); dot(const Q* q, const T* k, d) -> Acc;
//   exp_sum(Acc* s, n, top) -> sum of s[j] = exp(s[j] - top), in place;
//   axpy(Acc* acc, Acc p, const T* v, d): acc += p * v.

template <typename T>
struct Generic {
  using Acc = at::opmath_type<T>;
  using Q = Acc;
  static constexpr int kQK = 0, kPV = 0;  // no fixed-size head routines
  static constexpr bool kGroupValues = false;  // no group_values
  template <int DV>
  static void row_scores(const Q*, const T*, const T*, int64_t, const Slots&, int64_t, int64_t, Acc, Acc*, int64_t, Acc*) {}
  template <int DV, typename O> static void head_values(const Acc*, const T*, int64_t, const Slots&, Acc, O*) {}
  static void load_q(Q* dst, const T* src, int64_t d) {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Acc>(src[i]);
  }
  // Eight independent partial sums so that the compiler vectorizes without reassociating.
  static Acc dot(const Q* q, const T* k, int64_t n) {
    Acc s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) s[j] += q[i + j] * static_cast<Acc>(k[i + j]);
    }
    Acc r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; ++i) r += q[i] * static_cast<Acc>(k[i]);
    return r;
  }
  static Acc exp_sum(Acc* s, int64_t n, Acc top) {
    Acc sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - top);
      sum += s[j];
    }
    return sum;
  }
  static void axpy(Acc* acc, Acc p, const T* v, int64_t d) {
    for (int64_t i = 0; i < d; ++i) acc[i] += p * static_cast<Acc>(v[i]);
  }
};

#if CB_X86
using cbserve_exp::exp_avx2;
using cbserve_exp::exp_avx512;

CB_AVX2 inline __m256 load8_avx2(const float* p) { return _mm256_loadu_ps(p); }
CB_AVX2 inline __m256 load8_avx2(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
CB_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
struct Avx2 {
  using Acc = float;
  using Q = float;
  CB_AVX2 static void load_q(Q* dst, const T* src, int64_t d) {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  }
  CB_AVX2 static float dot(const float* q, const T* k, int64_t d) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_avx2(k + i), s);
    float r = hsum_avx2(s);
    for (; i < d; ++i) r += q[i] * static_cast<float>(k[i]);
    return r;
  }
  CB_AVX2 static float exp_sum(float* s, int64_t n, float top) {
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {  // the tail through a buffer padded with -inf (exp: 0)
      alignas(32) float buf[8];
      for (int64_t i = 0; i < 8; ++i) buf[i] = j + i < n ? s[j + i] : -std::numeric_limits<float>::infinity();
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_load_ps(buf), t));
      _mm256_store_ps(buf, e);
      sum = _mm256_add_ps(sum, e);
      for (int64_t i = 0; j + i < n; ++i) s[j + i] = buf[i];
    }
    return hsum_avx2(sum);
  }
  CB_AVX2 static void axpy(float* acc, float p, const T* v, int64_t d) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8_avx2(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < d; ++i) acc[i] += p * static_cast<float>(v[i]);
  }
  // Every query head of the task in one pass over the token rows (K read in order; V's rows are
  // fetched meanwhile for the value pass): scores[h * n + j] = scale * q_h.k_j, top[h] their max.
  static constexpr int kQK = 8, kPV = 8;
  static constexpr bool kGroupValues = false;
  template <int DV>
  CB_AVX2 static void row_scores(const float* q, const T* k, const T* v, int64_t kv_row, const Slots& sl, int64_t nq,
                                 int64_t group, float scale, float* scores, int64_t n, float* top) {
    constexpr int64_t dim = 8 * DV;
    const int64_t kv_heads = nq / group, v_bytes = kv_heads * dim * static_cast<int64_t>(sizeof(T));
    CB_FOR_SLOTS(sl, j, slot) {
      const T* kr = k + slot * kv_row;
      const char* vr = reinterpret_cast<const char*>(v + slot * kv_row);
      for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(vr + b);
      for (int64_t g = 0, h = 0; g < kv_heads; ++g) {
        const T* kh = kr + g * dim;  // the KV head of query heads [g * group, + group)
        for (int64_t e = 0; e < group; ++e, ++h) {
          const float* qh = q + h * dim;
          __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qh), load8_avx2(kh)), s1 = _mm256_setzero_ps();
#pragma GCC unroll 16
          for (int i = 1; i < DV; ++i) {
            if (i % 2) s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load8_avx2(kh + 8 * i), s1);
            else s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load8_avx2(kh + 8 * i), s0);
          }
          const float sc = hsum_avx2(_mm256_add_ps(s0, s1)) * scale;
          scores[h * n + j] = sc;
          top[h] = std::max(top[h], sc);
        }
      }
    }
  }
  // out = inv * sum_j p[j] v_j for one query head of dimension 8 * DV, accumulated in registers.
  template <int DV, typename O>
  CB_AVX2 static void head_values(const float* p, const T* v, int64_t kv_row, const Slots& sl, float inv, O* out) {
    __m256 acc[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) acc[i] = _mm256_setzero_ps();
    CB_FOR_SLOTS(sl, j, slot) {
      const T* vr = v + slot * kv_row;
      const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) acc[i] = _mm256_fmadd_ps(pj, load8_avx2(vr + 8 * i), acc[i]);
    }
    alignas(32) float buf[8 * DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm256_store_ps(buf + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
    for (int d = 0; d < 8 * DV; ++d) out[d] = static_cast<O>(buf[d]);
  }
};

CB_AVX512 inline __mmask16 tail16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
CB_AVX512 inline __m512 load16_avx512(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
CB_AVX512 inline __m512 load16_avx512(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bfloat16 values as float32 without a lane-crossing widening: one load of 32 gives the even
// ones (shifted up) and the odd ones (masked).
CB_AVX512 inline __m512 even_bf16(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
CB_AVX512 inline __m512 odd_bf16(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <typename T>
struct Avx512 {
  using Acc = float;
  using Q = float;
  CB_AVX512 static void load_q(Q* dst, const T* src, int64_t d) {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  }
  CB_AVX512 static float dot(const float* q, const T* k, int64_t d) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = tail16(d - i);
      s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), load16_avx512(k + i, m), s);
    }
    return _mm512_reduce_add_ps(s);
  }
  CB_AVX512 static float exp_sum(float* s, int64_t n, float top) {
    const __m512 t = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail16(n - j);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), t)));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
  CB_AVX512 static void axpy(float* acc, float p, const T* v, int64_t d) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = tail16(d - i);
      _mm512_mask_storeu_ps(acc + i, m, _mm512_fmadd_ps(pv, load16_avx512(v + i, m), _mm512_maskz_loadu_ps(m, acc + i)));
    }
  }
  static constexpr int kQK = 16, kPV = 16;
  static constexpr bool kGroupValues = true;
  template <int DV>
  CB_AVX512 static void row_scores(const float* q, const T* k, const T* v, int64_t kv_row, const Slots& sl,
                                   int64_t nq, int64_t group, float scale, float* scores, int64_t n, float* top) {
    constexpr int64_t dim = 16 * DV;
    const int64_t kv_heads = nq / group, v_bytes = kv_heads * dim * static_cast<int64_t>(sizeof(T));
    CB_FOR_SLOTS(sl, j, slot) {
      const T* kr = k + slot * kv_row;
      const char* vr = reinterpret_cast<const char*>(v + slot * kv_row);
      for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(vr + b);
      for (int64_t g = 0, h = 0; g < kv_heads; ++g) {
        const T* kh = kr + g * dim;  // the KV head of query heads [g * group, + group)
        for (int64_t e = 0; e < group; ++e, ++h) {
          const float* qh = q + h * dim;
          __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(qh), load16_avx512(kh, 0xFFFF)), s1 = _mm512_setzero_ps();
#pragma GCC unroll 16
          for (int i = 1; i < DV; ++i) {
            if (i % 2) s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), load16_avx512(kh + 16 * i, 0xFFFF), s1);
            else s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), load16_avx512(kh + 16 * i, 0xFFFF), s0);
          }
          const float sc = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * scale;
          scores[h * n + j] = sc;
          top[h] = std::max(top[h], sc);
        }
      }
    }
  }
  template <int DV, typename O>
  CB_AVX512 static void head_values(const float* p, const T* v, int64_t kv_row, const Slots& sl, float inv, O* out) {
    __m512 acc[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) acc[i] = _mm512_setzero_ps();
    CB_FOR_SLOTS(sl, j, slot) {
      const T* vr = v + slot * kv_row;
      const __m512 pj = _mm512_set1_ps(p[j]);
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) acc[i] = _mm512_fmadd_ps(pj, load16_avx512(vr + 16 * i, 0xFFFF), acc[i]);
    }
    alignas(64) float buf[16 * DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm512_store_ps(buf + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
    for (int d = 0; d < 16 * DV; ++d) out[d] = static_cast<O>(buf[d]);
  }
  // head_values for G query heads of one KV head at once (their probabilities n apart, their
  // outputs 16 * DV apart): each V row is read once for all G, and each head's sums run in
  // head_values' order, so the results are the same bits.
  template <int DV, int G, typename O>
  CB_AVX512 static void group_values(const float* p, int64_t n, const T* v, int64_t kv_row, const Slots& sl,
                                     const float* inv, O* out) {
    __m512 acc[G][DV];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) acc[g][i] = _mm512_setzero_ps();
    // bfloat16 rows of 32k values: vj[2c] holds values 32c + 2m (lane m), vj[2c + 1] values
    // 32c + 2m + 1, put back in order at the end (no lane-crossing widening per 16 values).
    constexpr bool halves = std::is_same_v<T, c10::BFloat16> && DV % 2 == 0;
    CB_FOR_SLOTS(sl, j, slot) {
      const T* vr = v + slot * kv_row;
      __m512 vj[DV];
      if constexpr (halves) {
#pragma GCC unroll 8
        for (int c = 0; c < DV / 2; ++c) {
          const __m512i x = _mm512_loadu_si512(vr + 32 * c);
          vj[2 * c] = even_bf16(x);
          vj[2 * c + 1] = odd_bf16(x);
        }
      } else {
#pragma GCC unroll 16
        for (int i = 0; i < DV; ++i) vj[i] = load16_avx512(vr + 16 * i, 0xFFFF);
      }
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * n + j]);
#pragma GCC unroll 16
        for (int i = 0; i < DV; ++i) acc[g][i] = _mm512_fmadd_ps(pj, vj[i], acc[g][i]);
      }
    }
    alignas(64) float buf[16 * DV];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) _mm512_store_ps(buf + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv[g])));
      O* o = out + g * 16 * DV;
      if constexpr (halves) {
        for (int c = 0; c < DV / 2; ++c)
          for (int m = 0; m < 16; ++m) {
            o[32 * c + 2 * m] = static_cast<O>(buf[32 * c + m]);
            o[32 * c + 2 * m + 1] = static_cast<O>(buf[32 * c + 16 + m]);
          }
      } else {
        for (int d = 0; d < 16 * DV; ++d) o[d] = static_cast<O>(buf[d]);
      }
    }
  }
};

// bfloat16 K/V with the query kept in bfloat16: q.k by `vdpbf16ps` (pairs of products, float32
// accumulation), the rest as Avx512.
struct Avx512Bf16 : Avx512<c10::BFloat16> {
  using Q = c10::BFloat16;
  CB_AVX512BF16 static void load_q(Q* dst, const c10::BFloat16* src, int64_t d) { std::copy(src, src + d, dst); }
  CB_AVX512BF16 static float dot(const c10::BFloat16* q, const c10::BFloat16* k, int64_t d) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
      const __mmask32 m = d - i >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (d - i)) - 1);
      s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_maskz_loadu_epi16(m, q + i), (__m512bh)_mm512_maskz_loadu_epi16(m, k + i));
    }
    return _mm512_reduce_add_ps(s);
  }
  static constexpr int kQK = 32;  // kPV: Avx512's
  template <int DV>
  CB_AVX512BF16 static void row_scores(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                                       int64_t kv_row, const Slots& sl, int64_t nq, int64_t group, float scale,
                                       float* scores, int64_t n, float* top) {
    constexpr int64_t dim = 32 * DV;
    const int64_t kv_heads = nq / group, v_bytes = kv_heads * dim * 2;
    CB_FOR_SLOTS(sl, j, slot) {
      const c10::BFloat16* kr = k + slot * kv_row;
      const char* vr = reinterpret_cast<const char*>(v + slot * kv_row);
      for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(vr + b);
      for (int64_t g = 0, h = 0; g < kv_heads; ++g) {
        const c10::BFloat16* kh = kr + g * dim;  // the KV head of query heads [g * group, + group)
        for (int64_t e = 0; e < group; ++e, ++h) {
          const c10::BFloat16* qh = q + h * dim;
          __m512 s0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qh),
                                       (__m512bh)_mm512_loadu_si512(kh));
          __m512 s1 = _mm512_setzero_ps();
#pragma GCC unroll 16
          for (int i = 1; i < DV; ++i) {
            const __m512bh qi = (__m512bh)_mm512_loadu_si512(qh + 32 * i), ki = (__m512bh)_mm512_loadu_si512(kh + 32 * i);
            if (i % 2) s1 = _mm512_dpbf16_ps(s1, qi, ki);
            else s0 = _mm512_dpbf16_ps(s0, qi, ki);
          }
          const float sc = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * scale;
          scores[h * n + j] = sc;
          top[h] = std::max(top[h], sc);
        }
      }
    }
  }
};
#endif  // CB_X86

// ------------------------------------------------------------------------------ the routine

template <class Ops>
struct Buffers {
  std::vector<typename Ops::Q> q;
  std::vector<typename Ops::Acc> scores, acc, top, inv, part, w;
};

// Ops::group_values for `count` (<= G) heads: the instantiation of that many.
template <class Ops, int DV, int G, typename T, typename A, typename O>
inline void group_values_of(int64_t count, const A* p, int64_t n, const T* v, int64_t kv_row, const Slots& sl,
                            const A* inv, O* out) {
  if constexpr (G > 0) {
    if (count == G) return Ops::template group_values<DV, G, O>(p, n, v, kv_row, sl, inv, out);
    group_values_of<Ops, DV, G - 1>(count, p, n, v, kv_row, sl, inv, out);
  }
}

// The fixed-size head routines of Ops for this head dimension, or the loops over `dot` / `axpy`.
template <class Ops, typename T>
struct Head {
  using A = typename Ops::Acc;
  int dv_qk = 0, dv_pv = 0;
  explicit Head(int64_t dim) {
    if constexpr (Ops::kQK > 0) {
      for (int dv : {1, 2, 4, 8}) {
        if (dim == Ops::kQK * dv) dv_qk = dv;
        if (dim == Ops::kPV * dv) dv_pv = dv;
      }
    }
  }
  // scores[h * n + j] for the task's nq query heads (q: nq x dim), top[h] their maxima.
  void scores(const typename Ops::Q* q, const T* k, const T* v, int64_t kv_row, const Slots& sl, int64_t nq,
              int64_t group, A scale, A* out, int64_t n, A* top, int64_t dim) const {
    switch (dv_qk) {
      case 1: return Ops::template row_scores<1>(q, k, v, kv_row, sl, nq, group, scale, out, n, top);
      case 2: return Ops::template row_scores<2>(q, k, v, kv_row, sl, nq, group, scale, out, n, top);
      case 4: return Ops::template row_scores<4>(q, k, v, kv_row, sl, nq, group, scale, out, n, top);
      case 8: return Ops::template row_scores<8>(q, k, v, kv_row, sl, nq, group, scale, out, n, top);
      default: break;
    }
    for (int64_t h = 0; h < nq; ++h) {
      const T* kh = k + h / group * dim;
      for_each_slot(sl.table, sl.page_size, sl.first, sl.last, [&](int64_t j, int64_t slot) {
        out[h * n + j] = Ops::dot(q + h * dim, kh + slot * kv_row, dim) * scale;
        top[h] = std::max(top[h], out[h * n + j]);
      });
    }
  }
  // values() for `heads` query heads of one KV head (probabilities n apart, outputs dim apart),
  // several at once where Ops has group_values (at most 16 accumulator registers).
  template <typename O>
  void group_values(const A* p, int64_t n, int64_t heads, const T* v, int64_t kv_row, const Slots& sl, const A* inv,
                    O* out, int64_t dim, std::vector<A>& acc) const {
    if constexpr (Ops::kGroupValues) {
      switch (dv_pv) {
        case 1: return group_chunks<1, O>(p, n, heads, v, kv_row, sl, inv, out);
        case 2: return group_chunks<2, O>(p, n, heads, v, kv_row, sl, inv, out);
        case 4: return group_chunks<4, O>(p, n, heads, v, kv_row, sl, inv, out);
        case 8: return group_chunks<8, O>(p, n, heads, v, kv_row, sl, inv, out);
        default: break;
      }
    }
    for (int64_t h = 0; h < heads; ++h) values(p + h * n, v, kv_row, sl, inv[h], out + h * dim, dim, acc);
  }
  template <int DV, typename O>
  void group_chunks(const A* p, int64_t n, int64_t heads, const T* v, int64_t kv_row, const Slots& sl, const A* inv,
                    O* out) const {
    constexpr int G = 16 / DV < 8 ? 16 / DV : 8;
    constexpr int64_t dim = Ops::kPV * DV;
    for (int64_t h = 0; h < heads; h += G) {
      const int64_t count = std::min<int64_t>(G, heads - h);
      group_values_of<Ops, DV, G>(count, p + h * n, n, v, kv_row, sl, inv + h, out + h * dim);
    }
  }
  template <typename O>
  void values(const A* p, const T* v, int64_t kv_row, const Slots& sl, A inv, O* out, int64_t dim,
              std::vector<A>& acc) const {
    switch (dv_pv) {
      case 1: return Ops::template head_values<1, O>(p, v, kv_row, sl, inv, out);
      case 2: return Ops::template head_values<2, O>(p, v, kv_row, sl, inv, out);
      case 4: return Ops::template head_values<4, O>(p, v, kv_row, sl, inv, out);
      case 8: return Ops::template head_values<8, O>(p, v, kv_row, sl, inv, out);
      default: break;
    }
    acc.assign(dim, A(0));
    for_each_slot(sl.table, sl.page_size, sl.first, sl.last,
                  [&](int64_t j, int64_t slot) { Ops::axpy(acc.data(), p[j], v + slot * kv_row, dim); });
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<O>(acc[d] * inv);
  }
};

// Softmax segments: a row's visible positions go SEGMENT at a time, in order from its first one;
// a segment's scores, their max, exp and sum and its (unnormalized) weighted sum of V rows are
// computed on their own, then the segments combine in order (`combine`). A row of one segment is
// computed directly (one division, no partials). The split depends only on the row's own
// positions, so a row's result still does not depend on the batch or the threads; it lets a long
// row's work spread over every thread (one stream decoding over a long context: its few KV heads
// alone are too few tasks for the threads).
constexpr int64_t SEGMENT = 512;

// A row's visible positions [first, last] and their number of segments.
inline void visible(const Args& a, int64_t row, int64_t& first, int64_t& last) {
  last = a.row_position[row];
  first = a.window > 0 ? std::max<int64_t>(0, last - a.window + 1) : 0;
}
inline int64_t segments(int64_t first, int64_t last) { return (last - first) / SEGMENT + 1; }

// A segment's partial for nq query heads, at `slot` ([nq * dim] sums, [nq] maxima, [nq] exp sums).
inline int64_t slot_size(int64_t nq, int64_t dim) { return nq * (dim + 2); }

// Query heads [g0 * group, + nq) of query row `row` (KV heads [g0, + nq / group)) over its
// positions [lo, hi], one head at a time: scaled scores (soft-capped), their max, exp and sum, the
// weighted sum of V rows. Divided by the sum into `out` (the task's heads of the row) when `slot`
// is null; else unnormalized into the partial `slot`.
template <class Ops, typename T>
inline void attend_span(const Args& a, int64_t row, int64_t g0, int64_t nq, int64_t lo, int64_t hi,
                        const Head<Ops, T>& head, Buffers<Ops>& buf, T* out, typename Ops::Acc* slot) {
  using A = typename Ops::Acc;
  const int64_t dim = a.dim, group = a.heads / a.kv_heads, kv_row = a.kv_heads * dim;
  const Slots sl{a.tables + a.row_request[row] * a.width, a.page_size, lo, hi};
  const int64_t n = hi + 1 - lo;
  const T* qrow = static_cast<const T*>(a.q) + (row * a.heads + g0 * group) * dim;
  const A scale = static_cast<A>(a.scale), cap = static_cast<A>(a.softcap);
  const T* k = static_cast<const T*>(a.k) + g0 * dim;
  const T* v = static_cast<const T*>(a.v) + g0 * dim;
  buf.q.resize(nq * dim);
  for (int64_t h = 0; h < nq; ++h) Ops::load_q(buf.q.data() + h * dim, qrow + h * dim, dim);
  buf.scores.resize(nq * n);
  buf.top.assign(nq, -std::numeric_limits<A>::infinity());
  A* scores = buf.scores.data();
  head.scores(buf.q.data(), k, v, kv_row, sl, nq, group, scale, scores, n, buf.top.data(), dim);
  buf.inv.resize(nq);
  for (int64_t h = 0; h < nq; ++h) {
    A* p = scores + h * n;
    A top = buf.top[h];
    if (cap > 0) {
      top = -std::numeric_limits<A>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        p[j] = cap * std::tanh(p[j] / cap);
        top = std::max(top, p[j]);
      }
    }
    const A sum = Ops::exp_sum(p, n, top);
    buf.inv[h] = slot ? A(1) : A(1) / sum;
    if (slot) {
      slot[nq * dim + h] = top;
      slot[nq * dim + nq + h] = sum;
    }
  }
  for (int64_t h = 0; h < nq; h += group) {
    if (slot) {
      head.group_values(scores + h * n, n, group, v + h / group * dim, kv_row, sl, buf.inv.data() + h, slot + h * dim,
                        dim, buf.acc);
    } else {
      head.group_values(scores + h * n, n, group, v + h / group * dim, kv_row, sl, buf.inv.data() + h, out + h * dim,
                        dim, buf.acc);
    }
  }
}

// A row's `segs` partials (consecutive slots) into its output: each head's sums rescaled by
// exp(segment max - overall max), added in segment order, times one over the rescaled exp sums'
// total. Never inlined, so it is the same code wherever a row's segments ran.
template <typename A, typename T>
__attribute__((noinline)) void combine(int64_t segs, int64_t nq, int64_t dim, const A* slots, T* out,
                                       std::vector<A>& w, std::vector<A>& o) {
  const int64_t size = slot_size(nq, dim);
  w.resize(segs);
  for (int64_t h = 0; h < nq; ++h) {
    A top = -std::numeric_limits<A>::infinity();
    for (int64_t s = 0; s < segs; ++s) top = std::max(top, slots[s * size + nq * dim + h]);
    A total = 0;
    for (int64_t s = 0; s < segs; ++s) {
      w[s] = std::exp(slots[s * size + nq * dim + h] - top);
      total += slots[s * size + nq * dim + nq + h] * w[s];
    }
    const A inv = A(1) / total;
    o.assign(dim, A(0));
    for (int64_t s = 0; s < segs; ++s)
      for (int64_t d = 0; d < dim; ++d) o[d] += slots[s * size + h * dim + d] * w[s];
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<T>(o[d] * inv);
  }
}

// Query heads [g0 * group, + nq) of query row `row`: its segments in turn, combined here.
template <class Ops, typename T>
inline void attend(const Args& a, int64_t row, int64_t g0, int64_t nq, const Head<Ops, T>& head, Buffers<Ops>& buf) {
  int64_t first, last;
  visible(a, row, first, last);
  T* out = static_cast<T*>(a.out) + (row * a.heads + g0 * (a.heads / a.kv_heads)) * a.dim;
  const int64_t segs = segments(first, last), size = slot_size(nq, a.dim);
  if (segs == 1) return attend_span<Ops, T>(a, row, g0, nq, first, last, head, buf, out, nullptr);
  buf.part.resize(segs * size);
  for (int64_t s = 0; s < segs; ++s) {
    const int64_t lo = first + s * SEGMENT;
    attend_span<Ops, T>(a, row, g0, nq, lo, std::min(lo + SEGMENT - 1, last), head, buf, out, buf.part.data() + s * size);
  }
  combine(segs, nq, a.dim, buf.part.data(), out, buf.w, buf.acc);
}

// A task of a step with few rows: segment `seg` of query row `row`, KV heads [g0, + kv_heads), into
// the partial at element `slot` of the step's partials (-1: the row's only segment, attended and
// written out directly). A row of one segment is split by KV head, a longer one by segment.
struct Piece {
  int64_t row, g0, kv_heads, seg, slot;
};

// The tasks of one thread: [first, count) in steps of `stride`. Without pieces, task t is query
// row t / splits, KV heads from (t % splits) * (kv_heads / splits). With pieces, the threads take
// pieces[t] in turn from `next` (partials into `parts`): pieces differ in length (a row's last
// segment, a short row's KV head), so a fixed split would leave one thread the long ones. With
// `combine` set, the thread combines the partials of each row of several segments instead.
struct Tasks {
  int64_t first, stride, count, splits;
  const Piece* pieces = nullptr;
  void* parts = nullptr;
  std::atomic<int64_t>* next = nullptr;
  bool combine = false;
};

// Asks for a task's K and V rows [lo, hi] ahead of time: a decode row's pages are cold (the
// layer's weights went through the caches since), and the next request's rows are elsewhere in memory.
template <typename T>
inline void prefetch_task(const Args& a, int64_t row, int64_t g0, int64_t kv_heads, int64_t lo, int64_t hi) {
  const Slots sl{a.tables + a.row_request[row] * a.width, a.page_size, lo, hi};
  const int64_t kv_row = a.kv_heads * a.dim, bytes = kv_heads * a.dim * static_cast<int64_t>(sizeof(T));
  const char* k = reinterpret_cast<const char*>(static_cast<const T*>(a.k) + g0 * a.dim);
  const char* v = reinterpret_cast<const char*>(static_cast<const T*>(a.v) + g0 * a.dim);
  CB_FOR_SLOTS(sl, j, slot) {
    const int64_t offset = slot * kv_row * static_cast<int64_t>(sizeof(T));
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(k + offset + b);
      __builtin_prefetch(v + offset + b);
    }
  }
}

constexpr int64_t PREFETCH_TASKS = 8;  // how many tasks ahead K/V rows are asked for

template <class Ops, typename T>
inline void run_tasks(const Args& a, const Tasks& t) {
  using A = typename Ops::Acc;
  Buffers<Ops> buf;
  const Head<Ops, T> head(a.dim);
  const int64_t per_task = a.kv_heads / t.splits, group = a.heads / a.kv_heads;
  A* parts = static_cast<A*>(t.parts);
  // Task `task`'s row, KV heads [g0, + heads) and positions [lo, hi].
  const auto span = [&](int64_t task, int64_t& row, int64_t& g0, int64_t& heads, int64_t& lo, int64_t& hi) {
    int64_t first, last;
    if (t.pieces) {
      const Piece& p = t.pieces[task];
      row = p.row, g0 = p.g0, heads = p.kv_heads;
      visible(a, row, first, last);
      lo = first + p.seg * SEGMENT, hi = std::min(lo + SEGMENT - 1, last);
    } else {
      row = task / t.splits, g0 = (task % t.splits) * per_task, heads = per_task;
      visible(a, row, first, last);
      lo = first, hi = last;
    }
  };
  if (t.next) {  // pieces, as the threads come for them (each asks for its own piece's K/V rows)
    for (int64_t task = (*t.next)++; task < t.count; task = (*t.next)++) {
      int64_t row, g0, heads, lo, hi;
      span(task, row, g0, heads, lo, hi);
      prefetch_task<T>(a, row, g0, heads, lo, hi);
      const int64_t slot = t.pieces[task].slot;
      T* out = static_cast<T*>(a.out) + (row * a.heads + g0 * group) * a.dim;
      attend_span<Ops, T>(a, row, g0, heads * group, lo, hi, head, buf, out, slot < 0 ? nullptr : parts + slot);
    }
    return;
  }
  for (int64_t task = t.first; task < t.count; task += t.stride) {
    int64_t row, g0, heads, lo, hi;
    if (t.combine) {
      const Piece& p = t.pieces[task];
      if (p.seg != 0 || p.slot < 0) continue;
      visible(a, p.row, lo, hi);
      T* out = static_cast<T*>(a.out) + (p.row * a.heads + p.g0 * group) * a.dim;
      combine(segments(lo, hi), p.kv_heads * group, a.dim, parts + p.slot, out, buf.w, buf.acc);
      continue;
    }
    for (int64_t ahead = task == t.first ? 0 : PREFETCH_TASKS; ahead <= PREFETCH_TASKS; ++ahead) {
      const int64_t next = task + ahead * t.stride;
      if (next >= t.count) break;
      span(next, row, g0, heads, lo, hi);
      prefetch_task<T>(a, row, g0, heads, lo, hi);
    }
    attend<Ops, T>(a, task / t.splits, (task % t.splits) * per_task, per_task * group, head, buf);
  }
}

using RunFn = void (*)(const Args&, const Tasks&);

template <typename T>
void run_generic(const Args& a, const Tasks& t) { run_tasks<Generic<T>, T>(a, t); }

#if CB_X86
template <typename T>
CB_AVX2 __attribute__((flatten)) void run_avx2(const Args& a, const Tasks& t) { run_tasks<Avx2<T>, T>(a, t); }
template <typename T>
CB_AVX512 __attribute__((flatten)) void run_avx512(const Args& a, const Tasks& t) { run_tasks<Avx512<T>, T>(a, t); }
CB_AVX512BF16 __attribute__((flatten)) void run_avx512_bf16(const Args& a, const Tasks& t) {
  run_tasks<Avx512Bf16, c10::BFloat16>(a, t);
}
#endif

bool cpu_has(const std::string& isa) {
  if (isa == "generic") return true;
#if CB_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx512;
  if (isa == "avx512_bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
  TORCH_CHECK(isa == "avx2" || isa == "avx512" || isa == "avx512_bf16",
              "cbserve_cpu attention: unknown isa '", isa, "' (generic, avx2, avx512, avx512_bf16)");
  return false;
}

bool attention_isa_available(const std::string& isa) { return cpu_has(isa); }

// The path for this dtype and isa: float32 / bfloat16 get the isa's vector path, other dtypes
// (and bfloat16's q.k below avx512_bf16: widened) the generic or widened ones.
RunFn pick(at::ScalarType dtype, const std::string& isa) {
#if CB_X86
  if (dtype == at::kFloat) {
    if (isa == "avx512" || isa == "avx512_bf16") return run_avx512<float>;
    if (isa == "avx2") return run_avx2<float>;
  }
  if (dtype == at::kBFloat16) {
    if (isa == "avx512_bf16") return run_avx512_bf16;
    if (isa == "avx512") return run_avx512<c10::BFloat16>;
    if (isa == "avx2") return run_avx2<c10::BFloat16>;
  }
#endif
  switch (dtype) {
    case at::kFloat: return run_generic<float>;
    case at::kDouble: return run_generic<double>;
    case at::kBFloat16: return run_generic<c10::BFloat16>;
    case at::kHalf: return run_generic<c10::Half>;
    default: TORCH_CHECK(false, "cbserve_cpu attention: unsupported dtype ", dtype);
  }
}

// Multiply-adds of q.k (rows x context x heads x head_dim) below which one thread does the step.
constexpr int64_t SMALL_WORK = 1 << 19;

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                           const std::string& isa) {
  TORCH_CHECK(cpu_has(isa), "cbserve_cpu attention: this CPU lacks the instruction set of path '", isa, "'");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [T, H, D] and caches [blocks, page, kvH, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(3), "shape mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  for (const at::Tensor* t : {&block_tables, &context_lens, &cu_seqlens_q}) {
    TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kLong || t->scalar_type() == at::kInt),
                "block tables, context lengths and cu_seqlens_q must be int32 or int64 CPU tensors");
  }
  const int64_t batch = block_tables.size(0), rows = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.numel() == batch && cu_seqlens_q.numel() == batch + 1,
              "one block table row, context length and cu_seqlens_q entry per request");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous(), cu = cu_seqlens_q.to(at::kLong).contiguous();
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(cup[0] == 0 && cup[batch] <= rows, "cu_seqlens_q must start at 0 and end within q's rows");
  std::vector<int64_t> row_request(rows, 0), row_position(rows, 0);
  const int64_t page_size = k_cache.size(1), width = block_tables.size(1);
  int64_t used = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = cup[b], hi = cup[b + 1];
    TORCH_CHECK(lo <= hi && hi - lo <= lp[b] && lp[b] <= width * page_size,
                "request ", b, ": its query rows must fit its context, and its context its block table");
    for (int64_t r = lo; r < hi; ++r) {
      row_request[r] = b;
      row_position[r] = lp[b] - (hi - r);
    }
    used = hi;
  }
  auto out = at::empty_like(q);
  if (used < rows) out.narrow(0, used, rows - used).zero_();  // rows of no request
  if (used == 0) return out;
  Args a{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr<int64_t>(), lp,
         row_request.data(), row_position.data(), q.size(1), q.size(2), page_size, k_cache.size(2), width,
         window, scale, softcap};
  const RunFn run = pick(q.scalar_type(), isa);
  // A step of little attention work (one decode row over a short context) runs on this thread: a
  // parallel region costs more than it saves there, far more when the other cores are busy (a
  // descheduled worker holds the whole region). The tasks are the same either way.
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += (cup[b + 1] - cup[b]) * lp[b];
  const bool small = work * q.size(1) * q.size(2) < SMALL_WORK;
  const int64_t threads = small ? 1 : at::get_num_threads();
  const int64_t splits = used >= 4 * threads ? 1 : a.kv_heads;
  if (small) {
    run(a, Tasks{0, 1, used * splits, splits});
    return out;
  }
  // Few rows: a long row's segments are tasks of their own, their partials combined after.
  std::vector<Piece> pieces;
  int64_t slots = 0;  // elements of the partials
  if (splits > 1) {
    const int64_t size = slot_size(a.heads, a.dim);
    for (int64_t r = 0; r < used; ++r) {
      int64_t first, last;
      visible(a, r, first, last);
      const int64_t segs = segments(first, last);
      if (segs == 1) {
        for (int64_t g = 0; g < a.kv_heads; ++g) pieces.push_back(Piece{r, g, 1, 0, -1});
      } else {
        for (int64_t s = 0; s < segs; ++s, slots += size) pieces.push_back(Piece{r, 0, a.kv_heads, s, slots});
      }
    }
  }
  if (slots == 0) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) run(a, Tasks{t, threads, used * splits, splits});
    });
    return out;
  }
  // The most work first (token rows x KV heads), so the short pieces even out the threads' ends.
  const auto size_of = [&](const Piece& p) {
    int64_t first, last;
    visible(a, p.row, first, last);
    return std::min(SEGMENT, last + 1 - first - p.seg * SEGMENT) * p.kv_heads;
  };
  std::stable_sort(pieces.begin(), pieces.end(), [&](const Piece& x, const Piece& y) { return size_of(x) > size_of(y); });
  const int64_t count = static_cast<int64_t>(pieces.size());
  const at::Tensor parts = at::empty({slots}, q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run(a, Tasks{t, threads, count, splits, pieces.data(), parts.data_ptr(), &next});
  });
  run(a, Tasks{0, 1, count, splits, pieces.data(), parts.data_ptr(), nullptr, true});
  return out;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t window, double softcap, const std::string& isa) {
  TORCH_CHECK(q.dim() == 3 && q.size(0) == block_tables.size(0), "one query row per request");
  const at::Tensor cu = at::arange(q.size(0) + 1, at::TensorOptions().dtype(at::kLong));
  return paged_attention(q, k_cache, v_cache, cu, block_tables, context_lens, scale, window, softcap, isa);
}

// A step's new K/V rows into their cache slots: key / value [T, kvH, D] (any token stride: views
// into the fused QKV rows), caches [blocks, page, kvH, D] contiguous, slot_mapping [T] (int32 /
// int64; -1 skips a padding row). One memcpy per token and cache: ATen's index_copy_ walks the
// values one at a time.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(),
              "store_kv: key/value [T, kvH, D] and caches [blocks, page, kvH, D]");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              "store_kv: key/value heads or head_dim differ from the cache's");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "store_kv: dtypes differ");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              "store_kv: CPU tensors only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv: contiguous caches");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == key.size(0) &&
                  (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "store_kv: slot_mapping [T] int32 or int64");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t tokens = key.size(0), capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < capacity, "store_kv: slot ", sp[t], " of token ", t,
                " is outside the cache's [0, ", capacity, ") (-1: padding, skipped)");
  }
  // Each token's kvH x D values in one run (a head-major [kvH, T, D] view, as transformers' own
  // attention hands them, is copied into that layout first).
  const auto token_rows = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const at::Tensor k = token_rows(key), v = token_rows(value);
  const int64_t bytes = k.size(1) * k.size(2) * static_cast<int64_t>(k.element_size());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // Prefill-sized steps split over the threads; a decode step's few rows stay on this one.
  at::parallel_for(0, tokens, std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(2 * bytes, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       if (sp[t] < 0) continue;  // a padding row
                       std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
                       std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
                     }
                   });
}

}  // namespace

// For decoder_layers_cpu.cpp's layer loop.
namespace cbserve_layer {
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, const std::string& isa) {
  return ::paged_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale, 0, 0.0, isa);
}
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  ::store_kv(key, value, k_cache, v_cache, slot_mapping);
}
}  // namespace cbserve_layer

TORCH_LIBRARY(cbserve_cpu, m) {
  m.def("attention_isa_available(str isa) -> bool", &attention_isa_available);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, float softcap, str isa) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window, float softcap, str isa) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
