// The elementwise parts of a Llama-family decoder layer, fused, for the lean forward
// (kernels/llama_forward.py): each is one pass over its rows instead of transformers' 5-10 ATen ops
// (and their temporaries) per call.
//
// - add_rms_norm_: residual += x (in place; x may be absent), returns RMSNorm(residual) * weight;
// - rope_: rotary embedding in place on the first `heads` heads of each row of a fused QKV output;
// - silu_mul: silu(gate) * up from a fused [T, 2I] gate/up output;
// - greedy: each logits row's argmax and its log-probability (the sampler's greedy rows), one
//   pass for the maximum and one for the sum of exponentials (torch's argmax and log_softmax are
//   not vectorized over rows of a vocabulary on CPU: 5.7 ms for 32 x 49,152 on one thread).
//
// Every op rounds where transformers' modules round (the residual sum, the normed value before the
// weight, each product and sum of the rotary, silu before the product), so bfloat16 results follow
// the same steps; sums of squares are in float32 like transformers' RMSNorm (8 partial sums, so
// the last bits may differ from ATen's own reduction). float32 and bfloat16 only.
//
// Paths (the `isa` argument, cpu_isa.py): "generic" (plain C++), "avx2" (compiled for AVX2 + FMA)
// and "avx512" (AVX-512 F/BW/VL/DQ; "avx512_bf16" runs it too): rope vectorized by the compiler
// for AVX2 (both paths), RMSNorm and silu written 8 (avx2) or 16 (avx512) values at a time in GCC vector types (the
// compiler left them scalar: 5x slower on 2,048-row prefill steps), the avx512 silu in intrinsics
// (it also runs in the gate/up projection's epilogue, linear_cpu.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>
#include <string>
#include <tuple>

#include "task_queue.h"
#include "vector_paths.h"

#if CB_X86
#include <immintrin.h>
#endif

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cbserve_cpu layer ops: ", what); }

using cbserve_vector_paths::Path;

Path path_of(const std::string& isa) { return cbserve_vector_paths::path_of(isa, "cbserve_cpu layer ops"); }

inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }
// Rounds to T (bfloat16: to nearest even), the way an ATen op's result is stored.
template <typename T>
inline float rnd(float x) { return f32(static_cast<T>(x)); }

// exp(x) for silu: Cephes' single-precision polynomial (within 2 ulp). `x` clamped to
// [-87.34, 88.38], `fx` = floor(x * log2(e) + 0.5); returns exp(x) / 2^fx. V: float, or 8 lanes.
template <typename V>
inline V exp_poly_reduced(V x, V fx) {
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const V z = x * x;
  V y = x * 1.9875691500E-4f + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  return y * z + x + 1.0f;
}

inline float exp_poly(float x) {
  x = std::fmin(std::fmax(x, -87.3365f), 88.3762626647949f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return exp_poly_reduced(x, fx) * scale;
}

// One row of add_rms_norm_. The sum of squares in 8 partial sums (vectorizable), added in order.
#define CB_RMS_ROW                                                                    \
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                           \
  for (int64_t i = 0; i < n; ++i) {                                                   \
    const float v = x ? rnd<T>(f32(res[i]) + f32(x[i])) : f32(res[i]);               \
    if (x) res[i] = static_cast<T>(v);                                                \
    part[i % 8] += v * v;                                                             \
  }                                                                                   \
  float ss = 0;                                                                       \
  for (int j = 0; j < 8; ++j) ss += part[j];                                          \
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);                \
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(f32(w[i]) * rnd<T>(f32(res[i]) * r));

template <typename T>
void rms_row(const T* x, T* res, const T* w, T* out, int64_t n, float eps) { CB_RMS_ROW }
#undef CB_RMS_ROW

// One row of rope_: `heads` heads of `d` values, the cos/sin row of `d` values.
#define CB_ROPE_ROW                                                       \
  const int64_t half = d / 2;                                             \
  for (int64_t h = 0; h < heads; ++h) {                                   \
    T* v = row + h * d;                                                   \
    for (int64_t i = 0; i < half; ++i) {                                  \
      const float x1 = f32(v[i]), x2 = f32(v[i + half]);                  \
      const float a = rnd<T>(x1 * f32(cos[i])), b = rnd<T>(-x2 * f32(sin[i]));                 \
      const float c = rnd<T>(x2 * f32(cos[i + half])), e = rnd<T>(x1 * f32(sin[i + half]));    \
      v[i] = static_cast<T>(a + b);                                       \
      v[i + half] = static_cast<T>(c + e);                                \
    }                                                                     \
  }

template <typename T>
void rope_row(T* row, const T* cos, const T* sin, int64_t heads, int64_t d) { CB_ROPE_ROW }
template <typename T>
CB_AVX2 void rope_row_avx2(T* row, const T* cos, const T* sin, int64_t heads, int64_t d) { CB_ROPE_ROW }
#undef CB_ROPE_ROW

#define CB_SILU_ROW                                                          \
  for (int64_t i = 0; i < n; ++i) {                                          \
    const float g = f32(gu[i]);                                              \
    out[i] = static_cast<T>(rnd<T>(g / (1.0f + exp_poly(-g))) * f32(gu[n + i])); \
  }

template <typename T>
void silu_row(const T* gu, T* out, int64_t n) { CB_SILU_ROW }

// One row of greedy: torch's argmax (the first index of the largest value; a NaN is larger than
// any number) and its log-probability, x[t] - max - log(sum(exp(x - max))) as log_softmax
// computes it.
void greedy_row(const float* x, int64_t n, int64_t* token, float* logprob) {
  int64_t t = 0;
  for (int64_t i = 1; i < n && x[t] == x[t]; ++i)
    if (x[i] > x[t] || x[i] != x[i]) t = i;
  const float m = x[t];
  *token = t;
  if (logprob == nullptr) return;  // the token alone
  if (m != m) {
    *logprob = m;
    return;
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += exp_poly(x[i] - m);
  *token = t;
  *logprob = static_cast<float>(-std::log(total));
}

#if CB_X86
// The vector paths of rms_row and silu_row, N values at a time in GCC vector types (avx2: 8,
// avx512: 16): the compiler does not vectorize the scalar rows itself (it threads exp's clamps
// into branches). Same arithmetic, same roundings: bfloat16 values are widened and rounded to
// nearest even exactly as c10::BFloat16. The bodies are generic over N and inlined into each
// path's entry point, which carries that path's target attributes.
template <int N>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
  typedef uint32_t U __attribute__((vector_size(4 * N)));
  typedef uint16_t H __attribute__((vector_size(2 * N)));
};
#define CB_LANES(N)                   \
  using F = typename Lanes<N>::F;     \
  using I = typename Lanes<N>::I;     \
  using U = typename Lanes<N>::U;     \
  using H = typename Lanes<N>::H;
#define CB_INLINE inline __attribute__((always_inline))

template <int N>
CB_INLINE typename Lanes<N>::F loadv(const float* p) {
  typename Lanes<N>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N>
CB_INLINE typename Lanes<N>::F loadv(const c10::BFloat16* p) {
  CB_LANES(N)
  H h;
  std::memcpy(&h, p, sizeof h);
  return (F)(__builtin_convertvector(h, U) << 16);
}
template <int N>
CB_INLINE typename Lanes<N>::U to_bf16_bits(typename Lanes<N>::F v) {  // nearest even; NaN -> 0x7fc0
  CB_LANES(N)
  const U u = (U)v;
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (U)(v == v ? (I)rounded : (I)(U{} + 0x7fc0u));
}
template <int N>
CB_INLINE void storev(float* p, typename Lanes<N>::F v) { std::memcpy(p, &v, sizeof v); }
template <int N>
CB_INLINE void storev(c10::BFloat16* p, typename Lanes<N>::F v) {
  const typename Lanes<N>::H h = __builtin_convertvector(to_bf16_bits<N>(v), typename Lanes<N>::H);
  std::memcpy(p, &h, sizeof h);
}
template <int N>
CB_INLINE typename Lanes<N>::F rndv(typename Lanes<N>::F v, float) { return v; }
template <int N>
CB_INLINE typename Lanes<N>::F rndv(typename Lanes<N>::F v, c10::BFloat16) {
  return (typename Lanes<N>::F)(to_bf16_bits<N>(v) << 16);
}

template <int N>
CB_INLINE typename Lanes<N>::F exp_polyv(typename Lanes<N>::F x) {  // exp_poly, lane by lane
  CB_LANES(N)
  x = x < -87.3365f ? F{} - 87.3365f : x;
  x = x > 88.3762626647949f ? F{} + 88.3762626647949f : x;
  F fx = x * 1.44269504088896341f + 0.5f;
  const F truncated = __builtin_convertvector(__builtin_convertvector(fx, I), F);
  fx = truncated > fx ? truncated - 1.0f : truncated;  // floor
  return exp_poly_reduced(x, fx) * (F)((__builtin_convertvector(fx, I) + 127) << 23);
}

// rms_row in N lanes. With N = 8, lane j of the partial sums is rms_row's part[j] (the same sum);
// with 16 the sums of squares are split 16 ways, then folded to 8 and added in order.
template <typename T, int N>
CB_INLINE void rms_row_vec(const T* x, T* res, const T* w, T* out, int64_t n, float eps) {
  CB_LANES(N)
  F partv{};
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    F v = loadv<N>(res + i);
    if (x) {
      v = rndv<N>(v + loadv<N>(x + i), T{});
      storev<N>(res + i, v);
    }
    partv += v * v;
  }
  float lanes[N], part[8];
  std::memcpy(lanes, &partv, sizeof lanes);
  for (int j = 0; j < 8; ++j) part[j] = N == 8 ? lanes[j] : lanes[j] + lanes[(j + 8) % N];
  for (; i < n; ++i) {
    const float v = x ? rnd<T>(f32(res[i]) + f32(x[i])) : f32(res[i]);
    if (x) res[i] = static_cast<T>(v);
    part[i % 8] += v * v;
  }
  float ss = 0;
  for (int j = 0; j < 8; ++j) ss += part[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i + N <= n; i += N) storev<N>(out + i, loadv<N>(w + i) * rndv<N>(loadv<N>(res + i) * r, T{}));
  for (; i < n; ++i) out[i] = static_cast<T>(f32(w[i]) * rnd<T>(f32(res[i]) * r));
}

template <typename T, int N>
CB_INLINE void silu_row_vec(const T* gu, T* out, int64_t n) {
  CB_LANES(N)
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const F g = loadv<N>(gu + i);
    storev<N>(out + i, rndv<N>(g / (1.0f + exp_polyv<N>(-g)), T{}) * loadv<N>(gu + n + i));
  }
  for (; i < n; ++i) {
    const float g = f32(gu[i]);
    out[i] = static_cast<T>(rnd<T>(g / (1.0f + exp_poly(-g))) * f32(gu[n + i]));
  }
}

// greedy_row in N lanes: each lane keeps its largest value and the first index holding it,
// then the lanes are folded (the smallest index among equal maxima), so the pick is torch's argmax.
// Rows holding a NaN are left to the scalar row (NaN is the maximum there, as in torch).
template <int N>
CB_INLINE bool greedy_row_vec(const float* x, int64_t n, int64_t* token, float* logprob) {
  CB_LANES(N)
  if (n < N) return false;
  F best = loadv<N>(x), seen_nan = best != best ? F{} + 1.0f : F{};
  I at{};
  for (int j = 0; j < N; ++j) at[j] = j;
  I idx = at;
  int64_t i = N;
  for (; i + N <= n; i += N) {
    const F v = loadv<N>(x + i);
    const I bigger = v > best;
    best = bigger ? v : best;
    idx = bigger ? at + static_cast<int32_t>(i) : idx;
    seen_nan = v != v ? F{} + 1.0f : seen_nan;
  }
  float lane_max[N], any_nan[N];
  int32_t lane_idx[N];
  std::memcpy(lane_max, &best, sizeof lane_max);
  std::memcpy(lane_idx, &idx, sizeof lane_idx);
  std::memcpy(any_nan, &seen_nan, sizeof any_nan);
  float m = lane_max[0];
  int64_t t = lane_idx[0];
  for (int j = 0; j < N; ++j) {
    if (any_nan[j] != 0.0f) return false;
    if (lane_max[j] > m || (lane_max[j] == m && lane_idx[j] < t)) m = lane_max[j], t = lane_idx[j];
  }
  for (; i < n; ++i) {
    if (x[i] != x[i]) return false;
    if (x[i] > m) m = x[i], t = i;
  }
  *token = t;
  if (logprob == nullptr) return true;  // the token alone: no pass of exponentials
  double total = 0;  // lanes' float sums of 64 vectors at a time, added in double
  for (i = 0; i + N <= n;) {
    F sum{};
    for (int k = 0; k < 64 && i + N <= n; ++k, i += N) sum += exp_polyv<N>(loadv<N>(x + i) - m);
    for (int j = 0; j < N; ++j) total += sum[j];
  }
  for (; i < n; ++i) total += exp_poly(x[i] - m);
  *logprob = static_cast<float>(-std::log(total));  // x[t] - m - log(sum exp(x - m)), x[t] == m
  return true;
}

template <typename T>
CB_AVX2 void rms_row_avx2(const T* x, T* res, const T* w, T* out, int64_t n, float eps) {
  rms_row_vec<T, 8>(x, res, w, out, n, eps);
}
template <typename T>
CB_AVX512 void rms_row_avx512(const T* x, T* res, const T* w, T* out, int64_t n, float eps) {
  rms_row_vec<T, 16>(x, res, w, out, n, eps);
}
template <typename T>
CB_AVX2 void silu_row_avx2(const T* gu, T* out, int64_t n) { silu_row_vec<T, 8>(gu, out, n); }
// silu_row_vec<T, 16> in AVX-512 intrinsics: the same clamps, floor, polynomial, division and
// roundings (the same bits), with floor as one roundscale and 2^n as one scalef, where GCC's vector
// types built each from several instructions: 27 -> 20 cycles per 16 values (silu_mul on 2,048 x
// 1,536 bfloat16, 0.88 -> 0.66 ms on two Zen 4 cores).
CB_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CB_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
CB_AVX512 inline __m512i bf16_bits(__m512 v) {  // nearest even in the low 16 bits; NaN -> 0x7fc0
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
CB_AVX512 inline __m512 round16(__m512 v, float) { return v; }
CB_AVX512 inline __m512 round16(__m512 v, c10::BFloat16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
CB_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
CB_AVX512 inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16_bits(v)));
}
CB_AVX512 inline __m512 exp_poly16(__m512 x) {  // exp_poly, 16 lanes
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_fmadd_ps(x, _mm512_set1_ps(1.9875691500E-4f), _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, fx);
}
template <typename T>
CB_AVX512 void silu_row_avx512(const T* gu, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(gu + i);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16(out + i, _mm512_mul_ps(round16(s, T{}), load16(gu + n + i)));
  }
  for (; i < n; ++i) {
    const float g = f32(gu[i]);
    out[i] = static_cast<T>(rnd<T>(g / (1.0f + exp_poly(-g))) * f32(gu[n + i]));
  }
}
CB_AVX2 bool greedy_row_avx2(const float* x, int64_t n, int64_t* token, float* logprob) {
  return greedy_row_vec<8>(x, n, token, logprob);
}
CB_AVX512 bool greedy_row_avx512(const float* x, int64_t n, int64_t* token, float* logprob) {
  return greedy_row_vec<16>(x, n, token, logprob);
}
#undef CB_LANES
#undef CB_INLINE
#else
inline bool greedy_row_avx2(const float*, int64_t, int64_t*, float*) { return false; }
inline bool greedy_row_avx512(const float*, int64_t, int64_t*, float*) { return false; }
template <typename T>
void rms_row_avx2(const T* x, T* res, const T* w, T* out, int64_t n, float eps) { rms_row<T>(x, res, w, out, n, eps); }
template <typename T>
void rms_row_avx512(const T* x, T* res, const T* w, T* out, int64_t n, float eps) { rms_row<T>(x, res, w, out, n, eps); }
template <typename T>
void silu_row_avx2(const T* gu, T* out, int64_t n) { silu_row<T>(gu, out, n); }
template <typename T>
void silu_row_avx512(const T* gu, T* out, int64_t n) { silu_row<T>(gu, out, n); }
#endif
#undef CB_SILU_ROW

// f(tag) with a value of the tensor's element type (float32 or bfloat16).
template <typename F>
void dispatch(at::ScalarType type, F&& f) {
  if (type == at::kFloat) f(float{});
  else f(c10::BFloat16{});
}

// Rows per task: about 64K values, so a decode step's few rows stay on one thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& t, const char* what) {
  check(t.device().is_cpu() && t.dim() >= 1 && t.stride(-1) == 1, what);
  check(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "float32 or bfloat16 tensors only");
}

// residual [.., n] (contiguous rows), x like it or absent, weight [n]; returns the normed rows.
at::Tensor add_rms_norm_(const std::optional<at::Tensor>& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                         const std::string& isa) {
  const Path path = path_of(isa);
  check_rows(residual, "residual: CPU rows with unit stride");
  check(residual.is_contiguous(), "residual must be contiguous");
  const int64_t n = residual.size(-1), rows = residual.numel() / std::max<int64_t>(n, 1);
  check(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == residual.scalar_type(),
        "weight: [hidden] of the residual's dtype");
  at::Tensor xs;
  if (x && x->defined()) {
    xs = x->contiguous();
    check(xs.sizes() == residual.sizes() && xs.scalar_type() == residual.scalar_type(), "x must match residual");
  }
  at::Tensor out = at::empty_like(residual);
  dispatch(residual.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = xs.defined() ? xs.data_ptr<scalar_t>() : nullptr;
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    cbserve_tasks::for_each_row_chunk(rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* xr = xp ? xp + t * n : nullptr;
        const float e = static_cast<float>(eps);
        if (path == Path::kAvx512) rms_row_avx512<scalar_t>(xr, rp + t * n, wp, op + t * n, n, e);
        else if (path == Path::kAvx2) rms_row_avx2<scalar_t>(xr, rp + t * n, wp, op + t * n, n, e);
        else rms_row<scalar_t>(xr, rp + t * n, wp, op + t * n, n, e);
      }
    });
  });
  return out;
}

// qkv [T, W] rows (unit stride, any row stride), cos/sin [T, d] contiguous: the first `heads`
// heads of each row rotated in place.
void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t d,
           const std::string& isa) {
  const Path path = path_of(isa);
  check_rows(qkv, "qkv: CPU rows with unit stride");
  check(qkv.dim() == 2 && qkv.size(1) >= heads * d && d % 2 == 0, "qkv must be [T, >= heads * head_dim], head_dim even");
  const int64_t rows = qkv.size(0), ld = qkv.stride(0);
  check(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d && sin.numel() == rows * d &&
            cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
        "cos/sin: contiguous [T, head_dim] of qkv's dtype");
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* p = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    cbserve_tasks::for_each_row_chunk(rows, grain(heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        // The avx512 path rotates with avx2's code: compiled for AVX-512 it ran 1.2-3x slower.
        if (path != Path::kGeneric) rope_row_avx2<scalar_t>(p + t * ld, c + t * d, s + t * d, heads, d);
        else rope_row<scalar_t>(p + t * ld, c + t * d, s + t * d, heads, d);
      }
    });
  });
}

// gate_up [.., 2I] (gate first): returns silu(gate) * up [.., I].
at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& isa) {
  const Path path = path_of(isa);
  check_rows(gate_up, "gate_up: CPU rows with unit stride");
  const at::Tensor gu = gate_up.contiguous();
  check(gu.size(-1) % 2 == 0, "gate_up's last dimension must be even (gate, then up)");
  const int64_t n = gu.size(-1) / 2, rows = gu.numel() / std::max<int64_t>(2 * n, 1);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, gu.options());
  dispatch(gu.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    cbserve_tasks::for_each_row_chunk(rows, grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (path == Path::kAvx512) silu_row_avx512<scalar_t>(g + t * 2 * n, o + t * n, n);
        else if (path == Path::kAvx2) silu_row_avx2<scalar_t>(g + t * 2 * n, o + t * n, n);
        else silu_row<scalar_t>(g + t * 2 * n, o + t * n, n);
      }
    });
  });
  return out;
}

// logits [R, V] float32 rows: each row's argmax and its log-probability (greedy decoding's pick).
// logprobs false: the tokens alone (the returned log-probabilities are left unset), without the
// pass of exponentials that is most of the op's time.
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits, const std::string& isa, bool logprobs) {
  const Path path = path_of(isa);
  check(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
        "logits: [rows, vocab] float32 on the CPU");
  check(logits.size(1) > 0, "logits: an empty vocabulary");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor logprobs_out = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs_out.data_ptr<float>();
  // A row per task: one row is ~0.2 MB of logits.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      float* l = logprobs ? lp + r : nullptr;
      const bool done = path == Path::kAvx512 ? greedy_row_avx512(row, n, tp + r, l)
                        : path == Path::kAvx2 ? greedy_row_avx2(row, n, tp + r, l)
                                              : false;
      if (!done) greedy_row(row, n, tp + r, l);
    }
  });
  return {tokens, logprobs_out};
}

}  // namespace

// For decoder_layers_cpu.cpp's layer loop.
namespace cbserve_layer {
at::Tensor add_rms_norm(const std::optional<at::Tensor>& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        const std::string& isa) {
  return ::add_rms_norm_(x, residual, weight, eps, isa);
}
void rope(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t d,
          const std::string& isa) {
  ::rope_(qkv, cos, sin, heads, d, isa);
}
at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& isa) { return ::silu_mul(gate_up, isa); }
}  // namespace cbserve_layer

// silu_mul's avx512 rows for other kernels (linear_cpu.cpp's gate/up epilogue): `rows` rows of
// [gate n | up n] at a stride of `ld_in` values, into rows of n at a stride of `ld_out`.
namespace cbserve_silu {
void rows_avx512(bool bf16, const void* gate_up, int64_t ld_in, void* out, int64_t ld_out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16) {
      silu_row_avx512<c10::BFloat16>(static_cast<const c10::BFloat16*>(gate_up) + r * ld_in,
                                     static_cast<c10::BFloat16*>(out) + r * ld_out, n);
    } else {
      silu_row_avx512<float>(static_cast<const float*>(gate_up) + r * ld_in, static_cast<float*>(out) + r * ld_out, n);
    }
  }
}
}  // namespace cbserve_silu

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("add_rms_norm_(Tensor? x, Tensor(a!) residual, Tensor weight, float eps, str isa) -> Tensor", &add_rms_norm_);
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int head_dim, str isa) -> ()", &rope_);
  m.def("silu_mul(Tensor gate_up, str isa) -> Tensor", &silu_mul);
  m.def("greedy(Tensor logits, str isa, bool logprobs=True) -> (Tensor, Tensor)", &greedy);
}
