// The elementwise parts of a Llama-family decoder layer, fused, for the lean forward
// (kernels/llama_forward.py): each is one pass over its rows instead of transformers' 5-10 ATen ops
// (and their temporaries) per call.
//
// - add_rms_norm_: residual += x (in place; x may be absent), returns RMSNorm(residual) * weight;
// - rope_: rotary embedding in place on the first `heads` heads of each row of a fused QKV output;
// - silu_mul: silu(gate) * up from a fused [T, 2I] gate/up output.
//
// Every op rounds where transformers' modules round (the residual sum, the normed value before the
// weight, each product and sum of the rotary, silu before the product), so bfloat16 results follow
// the same steps; sums of squares are in float32 like transformers' RMSNorm (8 partial sums, so
// the last bits may differ from ATen's own reduction). float32 and bfloat16 only.
//
// Paths (the `isa` argument, cpu_isa.py): "generic" (plain C++), "avx2" (compiled for AVX2 + FMA;
// also what avx512 CPUs run): rope vectorized by the compiler, RMSNorm and silu written 8 values at
// a time in GCC vector types (the compiler left them scalar: 5x slower on 2,048-row prefill steps).
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

#if defined(__x86_64__) || defined(_M_X64)
#define CB_X86 1
#define CB_AVX2 __attribute__((target("avx2,fma")))
#else
#define CB_X86 0
#define CB_AVX2
#endif

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cbserve_cpu layer ops: ", what); }

bool use_avx2(const std::string& isa) {
  if (isa == "generic") return false;
  check(isa == "avx2" || isa == "avx512" || isa == "avx512_bf16", "isa must be generic, avx2, avx512 or avx512_bf16");
#if CB_X86
  __builtin_cpu_init();
  check(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "this CPU lacks AVX2 + FMA");
  return true;
#else
  check(false, "the avx2 path needs an x86-64 build");
  return false;
#endif
}

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

#if CB_X86
// The avx2 path of silu_row, 8 values at a time in GCC vector types: the compiler does not
// vectorize CB_SILU_ROW itself (it threads exp's clamps into branches). Same arithmetic, same
// roundings: bfloat16 values are widened and rounded to nearest even exactly as c10::BFloat16.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

CB_AVX2 inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
CB_AVX2 inline v8f load8(const c10::BFloat16* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
}
CB_AVX2 inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
CB_AVX2 inline v8u to_bf16_bits(v8f v) {  // round to nearest even; NaN -> 0x7fc0, as c10::BFloat16
  const v8u u = (v8u)v;
  const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (v8u)(v == v ? (v8i)rounded : (v8i)(v8u{} + 0x7fc0u));
}
CB_AVX2 inline void store8(c10::BFloat16* p, v8f v) {
  const v8h h = __builtin_convertvector(to_bf16_bits(v), v8h);
  std::memcpy(p, &h, sizeof h);
}
CB_AVX2 inline v8f rnd8(v8f v, float) { return v; }
CB_AVX2 inline v8f rnd8(v8f v, c10::BFloat16) { return (v8f)(to_bf16_bits(v) << 16); }

CB_AVX2 inline v8f exp_poly8(v8f x) {  // exp_poly, lane by lane
  x = x < -87.3365f ? v8f{} - 87.3365f : x;
  x = x > 88.3762626647949f ? v8f{} + 88.3762626647949f : x;
  v8f fx = x * 1.44269504088896341f + 0.5f;
  const v8f truncated = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8f);
  fx = truncated > fx ? truncated - 1.0f : truncated;  // floor
  return exp_poly_reduced(x, fx) * (v8f)((__builtin_convertvector(fx, v8i) + 127) << 23);
}

// The avx2 path of rms_row: lane j of the 8-wide partial sums is rms_row's part[j].
template <typename T>
CB_AVX2 void rms_row_avx2(const T* x, T* res, const T* w, T* out, int64_t n, float eps) {
  v8f part8{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f v = load8(res + i);
    if (x) {
      v = rnd8(v + load8(x + i), T{});
      store8(res + i, v);
    }
    part8 += v * v;
  }
  float part[8];
  std::memcpy(part, &part8, sizeof part);
  for (; i < n; ++i) {
    const float v = x ? rnd<T>(f32(res[i]) + f32(x[i])) : f32(res[i]);
    if (x) res[i] = static_cast<T>(v);
    part[i % 8] += v * v;
  }
  float ss = 0;
  for (int j = 0; j < 8; ++j) ss += part[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i + 8 <= n; i += 8) store8(out + i, load8(w + i) * rnd8(load8(res + i) * r, T{}));
  for (; i < n; ++i) out[i] = static_cast<T>(f32(w[i]) * rnd<T>(f32(res[i]) * r));
}

template <typename T>
CB_AVX2 void silu_row_avx2(const T* gu, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f g = load8(gu + i);
    store8(out + i, rnd8(g / (1.0f + exp_poly8(-g)), T{}) * load8(gu + n + i));
  }
  for (; i < n; ++i) {
    const float g = f32(gu[i]);
    out[i] = static_cast<T>(rnd<T>(g / (1.0f + exp_poly(-g))) * f32(gu[n + i]));
  }
}
#else
template <typename T>
void rms_row_avx2(const T* x, T* res, const T* w, T* out, int64_t n, float eps) { rms_row<T>(x, res, w, out, n, eps); }
template <typename T>
void silu_row_avx2(const T* gu, T* out, int64_t n) { silu_row<T>(gu, out, n); }
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
  const bool avx2 = use_avx2(isa);
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
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* xr = xp ? xp + t * n : nullptr;
        if (avx2) rms_row_avx2<scalar_t>(xr, rp + t * n, wp, op + t * n, n, static_cast<float>(eps));
        else rms_row<scalar_t>(xr, rp + t * n, wp, op + t * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// qkv [T, W] rows (unit stride, any row stride), cos/sin [T, d] contiguous: the first `heads`
// heads of each row rotated in place.
void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t d,
           const std::string& isa) {
  const bool avx2 = use_avx2(isa);
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
    at::parallel_for(0, rows, grain(heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (avx2) rope_row_avx2<scalar_t>(p + t * ld, c + t * d, s + t * d, heads, d);
        else rope_row<scalar_t>(p + t * ld, c + t * d, s + t * d, heads, d);
      }
    });
  });
}

// gate_up [.., 2I] (gate first): returns silu(gate) * up [.., I].
at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& isa) {
  const bool avx2 = use_avx2(isa);
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
    at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (avx2) silu_row_avx2<scalar_t>(g + t * 2 * n, o + t * n, n);
        else silu_row<scalar_t>(g + t * 2 * n, o + t * n, n);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("add_rms_norm_(Tensor? x, Tensor(a!) residual, Tensor weight, float eps, str isa) -> Tensor", &add_rms_norm_);
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int head_dim, str isa) -> ()", &rope_);
  m.def("silu_mul(Tensor gate_up, str isa) -> Tensor", &silu_mul);
}
