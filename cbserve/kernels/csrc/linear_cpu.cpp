// float32 linear layers for CPUs with AVX2 + FMA, on weights packed once into column panels.
//
// A weight [N, K] becomes ceil(N / 16) panels of [K, 16] (output columns padded with zeros), so
// one panel is streamed front to back while a tile of up to 6 input rows multiplies it: 12
// accumulator registers, 2 weight registers, 1 broadcast register. Panels are split across
// ATen's threads; every row tile reuses a panel while it is still in cache, so at decode row
// counts the weights are read from memory once per call (the step is bandwidth-bound, as it
// should be) and larger row counts are compute-bound (K in L1-sized slices, rows in L2-sized
// blocks). Each output sums its K products in order within a slice, then adds the slices, in
// float.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CB_HAS_AVX2 1
#else
#define CB_HAS_AVX2 0
#endif

namespace {

constexpr int64_t NR = 16;  // output columns per panel: two AVX2 vectors
constexpr int64_t MR = 6;   // input rows per tile
constexpr int64_t K_SLICE = 256;  // a panel slice of 256 x 16 floats: 16 KiB, half of L1
constexpr int64_t X_BLOCK_FLOATS = 1 << 16;  // 256 KiB of input rows per block

bool available() { return CB_HAS_AVX2; }

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cbserve_cpu linear: ", what); }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check(available(), "needs a CPU with AVX2 and FMA (built without them)");
  check(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "the weight must be a 2-D float32 tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR;
  at::Tensor out = at::zeros({panels, k, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * NR + j] = src[(p * NR + j) * k + i];
  });
  return out;
}

#if CB_HAS_AVX2
// Accumulators are named variables, not an array: GCC keeps an array of __m256 on the stack and
// stores it back on every iteration (3x slower).
#define CB_ROW(r)                                            \
  if constexpr (R > r) {                                     \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);  \
    a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);            \
    a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);            \
  }
#define CB_STORE(r)                                                  \
  if constexpr (R > r) {                                             \
    float* out = y + r * ldy;                                        \
    if (cols == NR) {                                                \
      if (first) {                                                   \
        _mm256_storeu_ps(out, _mm256_add_ps(a##r##0, b0));           \
        _mm256_storeu_ps(out + 8, _mm256_add_ps(a##r##1, b1));       \
      } else {                                                       \
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), a##r##0));         \
        _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(out + 8), a##r##1)); \
      }                                                              \
    } else {                                                         \
      _mm256_store_ps(buf, _mm256_add_ps(a##r##0, b0));              \
      _mm256_store_ps(buf + 8, _mm256_add_ps(a##r##1, b1));          \
      for (int64_t j = 0; j < cols; ++j) out[j] = first ? buf[j] : out[j] + buf[j]; \
    }                                                                \
  }

// y[r, :cols] (+)= x[r, :k] . panel[:k] for R rows of x (row stride ldx): the `first` slice of
// K writes y (plus the bias), later slices add to it.
template <int R>
inline void tile(const float* x, int64_t ldx, int64_t k, const float* panel, float* y, int64_t ldy, int64_t cols,
                 const float* bias, bool first) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_load_ps(panel + i * NR), w1 = _mm256_load_ps(panel + i * NR + 8);
    CB_ROW(0) CB_ROW(1) CB_ROW(2) CB_ROW(3) CB_ROW(4) CB_ROW(5)
  }
  // The bias joins the first slice only; a partial panel (the last one) goes through `buf`.
  alignas(32) float buf[NR];
  __m256 b0 = _mm256_setzero_ps(), b1 = b0;
  if (first && bias) {
    for (int64_t j = 0; j < cols; ++j) buf[j] = bias[j];
    for (int64_t j = cols; j < NR; ++j) buf[j] = 0.f;
    b0 = _mm256_load_ps(buf);
    b1 = _mm256_load_ps(buf + 8);
  }
  CB_STORE(0) CB_STORE(1) CB_STORE(2) CB_STORE(3) CB_STORE(4) CB_STORE(5)
}
#undef CB_ROW
#undef CB_STORE

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t, const float*, bool);
constexpr TileFn TILES[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
#endif

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  check(available(), "needs a CPU with AVX2 and FMA (built without them)");
  check(input.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  check(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "float32 only");
  check(packed.dim() == 3 && packed.size(2) == NR, "the weight must come from pack_linear_weight");
  const int64_t k = packed.size(1), panels = packed.size(0);
  check(input.size(-1) == k, "the input's last dimension must equal the weight's in_features");
  check(panels == (out_features + NR - 1) / NR, "out_features does not match the packed weight");
  check(packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
        "the packed weight must be contiguous and 32-byte aligned");
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t m = k ? x.numel() / k : 0;
  if (m == 0) return y;
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) {
    check(bias->scalar_type() == at::kFloat && bias->numel() == out_features,
          "the bias must be float32 [out_features]");
    b = bias->contiguous();
  }
#if CB_HAS_AVX2
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t n = out_features;
  // Rows in blocks, K in slices: a panel's slice (16 KiB) stays in L1 while every row tile of
  // the block passes over it, the block's inputs stay in L2, and the panels come back from L3
  // for the next block. Decode row counts are one block.
  const int64_t slice = m <= MR ? k : std::min(k, K_SLICE);  // one tile: nothing to reuse, stream K
  const int64_t rows = std::max<int64_t>(MR, X_BLOCK_FLOATS / std::max<int64_t>(slice, 1) / MR * MR);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
      const int64_t r1 = std::min(m, r0 + rows);
      for (int64_t k0 = 0; k0 < k; k0 += slice) {
        const int64_t kk = std::min(slice, k - k0);
        for (int64_t p = begin; p < end; ++p) {
          const float* panel = wp + (p * k + k0) * NR;
          const int64_t col = p * NR, cols = std::min(NR, n - col);
          const float* pb = bp ? bp + col : nullptr;
          for (int64_t r = r0; r < r1; r += MR) {
            TILES[std::min(MR, r1 - r)](xp + r * k + k0, k, kk, panel, yp + r * n + col, n, cols, pb, k0 == 0);
          }
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("linear_available() -> bool", &available);
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, int out_features) -> Tensor", &packed_linear);
}
