// Linear layers on block-quantized weights, read as GGUF stores them (no dequantized copy kept):
// each output row of the weight is K / 32 blocks of 32 values along the input dimension,
//
//   q8_0 (34 bytes): float16 d, int8 q[32]            w[j] = q[j] * d
//   q4_0 (18 bytes): float16 d, uint8 nibbles[16]     w[j] = (nib[j] - 8) * d
//   q4_1 (20 bytes): float16 d, float16 m, nibbles[16] w[j] = nib[j] * d + m
//
// where nib[j] is the low nibble of byte j for j < 16 and the high nibble of byte j - 16 above
// (llama.cpp's layout). A block is dequantized to float32 in registers (the product and the sum
// rounded separately, as gguf-py and transformers dequantize) and multiplied into float32
// accumulators. Paths by instruction set, chosen at run time: "avx512", "avx2", "generic".
//
// Reduction order: every output element sums its blocks in order (per vector lane, then the lanes
// once at the end); nothing depends on the number of rows or the thread split, so a row's result
// is the same in any batch (batch invariance).
//
// Work split: threads take ranges of output features; a range's weight rows stream from memory once
// per call while the call's input rows stay in cache (decode: bound by the weights' bytes, which
// are 4-7x fewer than bfloat16's).
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CB_X86 1
#define CB_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#else
#define CB_X86 0
#endif

namespace {

enum class Fmt { q8_0, q4_0, q4_1 };

Fmt parse_format(const std::string& name) {
  if (name == "q8_0") return Fmt::q8_0;
  if (name == "q4_0") return Fmt::q4_0;
  if (name == "q4_1") return Fmt::q4_1;
  TORCH_CHECK(false, "cbserve_cpu quant_linear: unknown format '", name, "' (q8_0, q4_0, q4_1)");
}

constexpr int64_t block_bytes(Fmt f) { return f == Fmt::q8_0 ? 34 : f == Fmt::q4_0 ? 18 : 20; }

// An opaque copy: keeps the compiler from fusing a product with the sum that follows (the
// reference rounds both).
#if CB_X86
#define CB_OPAQUE(v) asm("" : "+v"(v))
#else
#define CB_OPAQUE(v) (void)(v = *static_cast<volatile decltype(v)*>(&v))
#endif

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// One block's 32 values in float32, as the reference dequantizes them.
inline void dequant_block(Fmt f, const uint8_t* b, float* w) {
  const float d = half_at(b);
  if (f == Fmt::q8_0) {
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
    return;
  }
  const uint8_t* qs = b + (f == Fmt::q4_1 ? 4 : 2);
  const float m = f == Fmt::q4_1 ? half_at(b + 2) : 0.f;
  for (int j = 0; j < 16; ++j) {
    const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
    if (f == Fmt::q4_0) {
      w[j] = static_cast<float>(lo - 8) * d;
      w[j + 16] = static_cast<float>(hi - 8) * d;
    } else {
      float a = static_cast<float>(lo) * d, c = static_cast<float>(hi) * d;
      CB_OPAQUE(a);
      CB_OPAQUE(c);
      w[j] = a + m;
      w[j + 16] = c + m;
    }
  }
}

struct Args {
  const float* x;  // [M, K]
  const uint8_t* w;  // [N, K / 32 * block_bytes]
  const float* bias;  // [N] or null
  float* y;  // [M, N]
  int64_t m, n, k;
};

// ------------------------------------------------------------------------------------- generic

void rows_generic(Fmt f, const Args& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.k / 32, row_bytes = nb * block_bytes(f);
  float w[32];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < a.m; ++r) {
      float lanes[16] = {};
      const float* x = a.x + r * a.k;
      for (int64_t b = 0; b < nb; ++b) {
        dequant_block(f, a.w + n * row_bytes + b * block_bytes(f), w);
        for (int j = 0; j < 16; ++j) lanes[j] += w[j] * x[b * 32 + j];
        for (int j = 0; j < 16; ++j) lanes[j] += w[j + 16] * x[b * 32 + 16 + j];
      }
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += lanes[j];
      a.y[r * a.n + n] = s + (a.bias ? a.bias[n] : 0.f);
    }
  }
}

#if CB_X86
// ------------------------------------------------------------------------------------- AVX-512

template <Fmt F>
CB_AVX512 inline void dequant512(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b)));
  if constexpr (F == Fmt::q8_0) {
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (F == Fmt::q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
    __m512 h = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
    if constexpr (F == Fmt::q4_0) {
      const __m512 eight = _mm512_set1_ps(8.f);
      lo = _mm512_mul_ps(_mm512_sub_ps(l, eight), d);
      hi = _mm512_mul_ps(_mm512_sub_ps(h, eight), d);
    } else {
      const __m512 m = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2)));
      l = _mm512_mul_ps(l, d);
      h = _mm512_mul_ps(h, d);
      CB_OPAQUE(l);
      CB_OPAQUE(h);
      lo = _mm512_add_ps(l, m);
      hi = _mm512_add_ps(h, m);
    }
  }
}

// R input rows against one weight row: y[r * ldy] = x_r . w (+ bias).
template <Fmt F, int R>
CB_AVX512 inline void tile512(const float* x, int64_t k, const uint8_t* w, float* y, int64_t ldy, float bias) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t row_bytes = k / 32 * block_bytes(F);
  for (int64_t b = 0; b < k / 32; ++b) {
    __m512 lo, hi;
    _mm_prefetch(reinterpret_cast<const char*>(w + row_bytes + b * block_bytes(F)), _MM_HINT_T0);  // the next row's
    dequant512<F>(w + b * block_bytes(F), lo, hi);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * k + b * 32), acc[r]);
      acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * k + b * 32 + 16), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[r * ldy] = _mm512_reduce_add_ps(acc[r]) + bias;
}

// One input row against 4 weight rows: 4 independent accumulator chains, where one row's chain
// would wait on each FMA's latency. Each output sums as tile512<F, 1> sums it (bitwise the same).
// The next 4 rows' blocks are prefetched as these are read: the hardware prefetcher alone left a
// decode step's weights arriving late (measured: 8.4 -> 11.8 GB/s over a model's layers).
template <Fmt F>
CB_AVX512 inline void gemv4_512(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, float* y,
                                const float* bias) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 xl = _mm512_loadu_ps(x + b * 32), xh = _mm512_loadu_ps(x + b * 32 + 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512 lo, hi;
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + 4) * row_bytes + b * block_bytes(F)), _MM_HINT_T0);
      dequant512<F>(w + j * row_bytes + b * block_bytes(F), lo, hi);
      acc[j] = _mm512_fmadd_ps(lo, xl, acc[j]);
      acc[j] = _mm512_fmadd_ps(hi, xh, acc[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) y[j] = _mm512_reduce_add_ps(acc[j]) + (bias ? bias[j] : 0.f);
}

template <Fmt F>
CB_AVX512 __attribute__((flatten)) void rows_avx512(const Args& a, int64_t n0, int64_t n1) {
  const int64_t row_bytes = a.k / 32 * block_bytes(F);
  if (a.m == 1) {  // decode of one sequence: 4 weight rows at a time
    for (; n0 + 4 <= n1; n0 += 4) gemv4_512<F>(a.x, a.k, a.w + n0 * row_bytes, row_bytes, a.y + n0, a.bias ? a.bias + n0 : nullptr);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = a.w + n * row_bytes;
    const float bias = a.bias ? a.bias[n] : 0.f;
    int64_t r = 0;
    for (; r + 8 <= a.m; r += 8) tile512<F, 8>(a.x + r * a.k, a.k, w, a.y + r * a.n + n, a.n, bias);
    const float* x = a.x + r * a.k;
    float* y = a.y + r * a.n + n;
    switch (a.m - r) {
      case 7: tile512<F, 7>(x, a.k, w, y, a.n, bias); break;
      case 6: tile512<F, 6>(x, a.k, w, y, a.n, bias); break;
      case 5: tile512<F, 5>(x, a.k, w, y, a.n, bias); break;
      case 4: tile512<F, 4>(x, a.k, w, y, a.n, bias); break;
      case 3: tile512<F, 3>(x, a.k, w, y, a.n, bias); break;
      case 2: tile512<F, 2>(x, a.k, w, y, a.n, bias); break;
      case 1: tile512<F, 1>(x, a.k, w, y, a.n, bias); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------------------------------- AVX2

// Values [8 * part, + 8) of a block.
template <Fmt F>
CB_AVX2 inline __m256 dequant256(const uint8_t* b, int part) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b)));
  if constexpr (F == Fmt::q8_0) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * part)))), d);
  } else {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + (F == Fmt::q4_1 ? 4 : 2) + 8 * (part % 2)));
    const __m128i nib = part < 2 ? _mm_and_si128(q, _mm_set1_epi8(0x0F)) : _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
    if constexpr (F == Fmt::q4_0) return _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(8.f)), d);
    v = _mm256_mul_ps(v, d);
    CB_OPAQUE(v);
    return _mm256_add_ps(v, _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2))));
  }
}

// The sum of 8 lanes (one order for every AVX2 caller).
CB_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <Fmt F, int R>
CB_AVX2 inline void tile256(const float* x, int64_t k, const uint8_t* w, float* y, int64_t ldy, float bias) {
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t row_bytes = k / 32 * block_bytes(F);
  for (int64_t b = 0; b < k / 32; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(w + row_bytes + b * block_bytes(F)), _MM_HINT_T0);  // the next row's
#pragma GCC unroll 4
    for (int part = 0; part < 4; ++part) {
      const __m256 wv = dequant256<F>(w + b * block_bytes(F), part);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * k + b * 32 + 8 * part), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum256(acc[r]) + bias;
}

// As gemv4_512: one input row, 4 weight rows at a time, each output bitwise tile256<F, 1>'s.
template <Fmt F>
CB_AVX2 inline void gemv4_256(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, float* y,
                              const float* bias) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < k / 32; ++b) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const uint8_t* block = w + j * row_bytes + b * block_bytes(F);
      _mm_prefetch(reinterpret_cast<const char*>(block + 4 * row_bytes), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int part = 0; part < 4; ++part) {
        acc[j] = _mm256_fmadd_ps(dequant256<F>(block, part), _mm256_loadu_ps(x + b * 32 + 8 * part), acc[j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) y[j] = hsum256(acc[j]) + (bias ? bias[j] : 0.f);
}

template <Fmt F>
CB_AVX2 __attribute__((flatten)) void rows_avx2(const Args& a, int64_t n0, int64_t n1) {
  const int64_t row_bytes = a.k / 32 * block_bytes(F);
  if (a.m == 1) {  // decode of one sequence: 4 weight rows at a time
    for (; n0 + 4 <= n1; n0 += 4) gemv4_256<F>(a.x, a.k, a.w + n0 * row_bytes, row_bytes, a.y + n0, a.bias ? a.bias + n0 : nullptr);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = a.w + n * row_bytes;
    const float bias = a.bias ? a.bias[n] : 0.f;
    int64_t r = 0;
    for (; r + 4 <= a.m; r += 4) tile256<F, 4>(a.x + r * a.k, a.k, w, a.y + r * a.n + n, a.n, bias);
    const float* x = a.x + r * a.k;
    float* y = a.y + r * a.n + n;
    switch (a.m - r) {
      case 3: tile256<F, 3>(x, a.k, w, y, a.n, bias); break;
      case 2: tile256<F, 2>(x, a.k, w, y, a.n, bias); break;
      case 1: tile256<F, 1>(x, a.k, w, y, a.n, bias); break;
      default: break;
    }
  }
}

template <Fmt F>
CB_AVX2 __attribute__((flatten)) void dequant_rows_avx2(const uint8_t* src, float* dst, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) {
#pragma GCC unroll 4
    for (int part = 0; part < 4; ++part) _mm256_storeu_ps(dst + i * 32 + 8 * part, dequant256<F>(src + i * block_bytes(F), part));
  }
}

template <Fmt F>
CB_AVX512 __attribute__((flatten)) void dequant_rows_avx512(const uint8_t* src, float* dst, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) {
    __m512 lo, hi;
    dequant512<F>(src + i * block_bytes(F), lo, hi);
    _mm512_storeu_ps(dst + i * 32, lo);
    _mm512_storeu_ps(dst + i * 32 + 16, hi);
  }
}
#endif  // CB_X86

bool cpu_has(const std::string& isa) {
  if (isa == "generic") return true;
#if CB_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "avx2") return avx2;
  if (isa == "avx512")
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  TORCH_CHECK(isa == "avx2" || isa == "avx512", "cbserve_cpu quant_linear: unknown isa '", isa,
              "' (generic, avx2, avx512)");
  return false;
}

using RowsFn = void (*)(const Args&, int64_t, int64_t);

RowsFn pick(Fmt f, const std::string& isa) {
#if CB_X86
  if (isa == "avx512") return f == Fmt::q8_0 ? rows_avx512<Fmt::q8_0> : f == Fmt::q4_0 ? rows_avx512<Fmt::q4_0> : rows_avx512<Fmt::q4_1>;
  if (isa == "avx2") return f == Fmt::q8_0 ? rows_avx2<Fmt::q8_0> : f == Fmt::q4_0 ? rows_avx2<Fmt::q4_0> : rows_avx2<Fmt::q4_1>;
#endif
  return nullptr;
}

void check_blocks(const at::Tensor& blocks, Fmt f, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && blocks.device().is_cpu(),
              "cbserve_cpu quant_linear: the weight must be a contiguous uint8 CPU tensor [out_features, blocks bytes]");
  TORCH_CHECK(k % 32 == 0 && blocks.size(1) == k / 32 * block_bytes(f),
              "cbserve_cpu quant_linear: in_features ", k, " must be a multiple of 32 and match the weight's ",
              blocks.size(1), " bytes a row");
}

// y [M, N] = x [M, K] . dequant(blocks)^T + bias, in x's dtype (float32 or bfloat16; a bfloat16 x
// is widened here and y rounded once at the end, as torch's casts around a float32 call would:
// for the decode calls this is built for, two fewer dispatched casts per layer).
at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& blocks, const std::string& format,
                        const std::optional<at::Tensor>& bias, const std::string& isa) {
  const Fmt f = parse_format(format);
  TORCH_CHECK(cpu_has(isa), "cbserve_cpu quant_linear: this CPU lacks the instruction set of path '", isa, "'");
  TORCH_CHECK((input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16) && input.device().is_cpu(),
              "cbserve_cpu quant_linear: float32 or bfloat16 CPU input");
  const at::Tensor x = input.contiguous();
  const int64_t k = x.size(-1), n = blocks.size(0), m = k ? x.numel() / k : 0;
  check_blocks(blocks, f, k);
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "cbserve_cpu quant_linear: float32 bias [out_features]");
    b = bias->contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (y.numel() == 0) return y;
  const bool wide = x.scalar_type() == at::kFloat;
  std::vector<float> x_wide, y_wide;
  if (!wide) {
    const at::BFloat16* src = x.data_ptr<at::BFloat16>();
    x_wide.assign(src, src + m * k);
    y_wide.resize(m * n);
  }
  const Args a{wide ? x.data_ptr<float>() : x_wide.data(), blocks.data_ptr<uint8_t>(), b ? b->data_ptr<float>() : nullptr,
               wide ? y.data_ptr<float>() : y_wide.data(), m, n, k};
  const RowsFn fn = pick(f, isa);
  // At least 16 output features a task: a task's weight rows are one sequential read.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    if (fn) fn(a, n0, n1);
    else rows_generic(f, a, n0, n1);
  });
  if (!wide) std::copy(y_wide.begin(), y_wide.end(), y.data_ptr<at::BFloat16>());  // rounded to nearest even
  return y;
}

// Blocks [b0, b1) of `src` dequantized into dst[i * 32, + 32) (every path gives the same values).
void dequant_range(Fmt f, const std::string& isa, const uint8_t* src, float* dst, int64_t b0, int64_t b1) {
#if CB_X86
  if (isa == "avx512") {
    if (f == Fmt::q8_0) return dequant_rows_avx512<Fmt::q8_0>(src, dst, b0, b1);
    if (f == Fmt::q4_0) return dequant_rows_avx512<Fmt::q4_0>(src, dst, b0, b1);
    return dequant_rows_avx512<Fmt::q4_1>(src, dst, b0, b1);
  }
  if (isa == "avx2") {
    if (f == Fmt::q8_0) return dequant_rows_avx2<Fmt::q8_0>(src, dst, b0, b1);
    if (f == Fmt::q4_0) return dequant_rows_avx2<Fmt::q4_0>(src, dst, b0, b1);
    return dequant_rows_avx2<Fmt::q4_1>(src, dst, b0, b1);
  }
#endif
  for (int64_t i = b0; i < b1; ++i) dequant_block(f, src + i * block_bytes(f), dst + i * 32);
}

// The float32 values of the blocks: [rows, K].
at::Tensor dequantize_blocks(const at::Tensor& blocks, const std::string& format, int64_t k, const std::string& isa) {
  const Fmt f = parse_format(format);
  TORCH_CHECK(cpu_has(isa), "cbserve_cpu dequantize_blocks: this CPU lacks the instruction set of path '", isa, "'");
  check_blocks(blocks, f, k);
  at::Tensor out = at::empty({blocks.size(0), k}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, blocks.size(0) * (k / 32), 1024, [&](int64_t begin, int64_t end) {
    dequant_range(f, isa, src, dst, begin, end);
  });
  return out;
}

// y [M, N] = x [M, K] . dequant(blocks)^T + bias for calls of many rows (prefill, large decode
// batches), where the per-row kernel's arithmetic would dominate: each task dequantizes a tile of
// output features into a buffer of its own, small enough to stay in cache, and multiplies the whole
// input by it with one GEMM in the input's dtype (float32, or bfloat16: the tile rounded to
// bfloat16 as a dense bfloat16 model's weights are). The weights are never dequantized whole (a
// per-call float32 copy of the default model's 49k-row head cost ~34 ms of writes and page faults).
at::Tensor quant_linear_tiled(const at::Tensor& input, const at::Tensor& blocks, const std::string& format,
                              const std::optional<at::Tensor>& bias, const std::string& isa) {
  const Fmt f = parse_format(format);
  TORCH_CHECK(cpu_has(isa), "cbserve_cpu quant_linear_tiled: this CPU lacks the instruction set of path '", isa, "'");
  const auto dtype = input.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && input.device().is_cpu(),
              "cbserve_cpu quant_linear_tiled: float32 or bfloat16 CPU input");
  const int64_t k = input.size(-1), n = blocks.size(0);
  check_blocks(blocks, f, k);
  const at::Tensor x = input.reshape({-1, k}).contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const int64_t nb = k / 32;
  // A tile: ~512 KiB of weights in the GEMM's dtype, a multiple of 16 rows; bfloat16 tiles are
  // dequantized 16 rows at a time through a small float32 buffer.
  const int64_t tile = std::max<int64_t>(16, (512 * 1024 / x.element_size() / std::max<int64_t>(k, 1)) / 16 * 16);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  if (y.numel()) {
    const at::ThreadLocalState caller;  // inference / grad mode: the tasks' GEMMs write `y` as the caller would
    at::parallel_for(0, (n + tile - 1) / tile, 1, [&](int64_t t0, int64_t t1) {
      const at::ThreadLocalStateGuard mode(caller);
      const bool f32 = dtype == at::kFloat;
      at::Tensor w = at::empty({tile, k}, x.options());
      at::Tensor w32 = f32 ? w : at::empty({16, k}, x.options().dtype(at::kFloat));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * tile, rows = std::min(tile, n - n0);
        const uint8_t* tile_src = src + n0 * nb * block_bytes(f);
        if (f32) {
          dequant_range(f, isa, tile_src, w.data_ptr<float>(), 0, rows * nb);
        } else {
          for (int64_t r = 0; r < rows; r += 16) {
            const int64_t part = std::min<int64_t>(16, rows - r);
            dequant_range(f, isa, tile_src + r * nb * block_bytes(f), w32.data_ptr<float>(), 0, part * nb);
            w.narrow(0, r, part).copy_(w32.narrow(0, 0, part));
          }
        }
        at::Tensor out = y.narrow(1, n0, rows);
        at::mm_out(out, x, w.narrow(0, 0, rows).t());
      }
    });
  }
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "cbserve_cpu quant_linear_tiled: bias [out_features]");
    y.add_(bias->to(dtype));
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  return y.view(shape);
}

bool quant_isa_available(const std::string& isa) { return cpu_has(isa); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("quant_isa_available(str isa) -> bool", &quant_isa_available);
  m.def("quant_linear(Tensor input, Tensor blocks, str format, Tensor? bias, str isa) -> Tensor", &quant_linear);
  m.def("dequantize_blocks(Tensor blocks, str format, int k, str isa) -> Tensor", &dequantize_blocks);
  m.def("quant_linear_tiled(Tensor input, Tensor blocks, str format, Tensor? bias, str isa) -> Tensor", &quant_linear_tiled);
}
