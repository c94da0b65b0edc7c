// Linear layers for CPUs on weights packed once into column panels, one path per instruction set,
// chosen at run time (`isa` argument; cpu_isa.py picks it from the CPU's flags):
//
// - "avx2":        float32, AVX2 + FMA: panels of 16 columns [K, 16], tiles of 6 rows x 16 columns
//                  (12 accumulator registers of 8 floats).
// - "avx512":      float32, AVX-512: panels of 32 columns [K, 32], tiles of 12 rows x 32 columns
//                  (24 accumulator registers of 16 floats).
// - "avx512_bf16": bfloat16 weights and inputs, AVX-512 BF16: panels of 32 columns stored as K pairs
//                  [ceil(K / 2), 32, 2], so one 64-byte load holds 2 K steps of 16 columns and
//                  `vdpbf16ps` multiplies them by a broadcast pair of the input row, accumulating in
//                  float32. Outputs are rounded to bfloat16 once (round to nearest even), after the bias.
//
// Each path's code is compiled with its own target attribute (never with -march=native), so one
// build runs on any x86-64 CPU and a path is only ever called where `__builtin_cpu_supports` says
// the CPU has it.
//
// Reduction order: every output element is one accumulator lane that sums its K products in
// order k = 0, 1, ..., K - 1 (fused multiply-adds; bf16: one pair per step), then adds the bias
// (AVX2: per fixed 256-wide K slice, the slices added in order, the bias with the first). Nothing
// depends on how many rows the call has, where a row falls in its tile, or on the thread split: a
// row's result is bitwise the same in any batch (batch invariance).
//
// Work split: tasks are (row block, panel) pairs over ATen's threads; a row block (at most
// ROW_BLOCK_BYTES of inputs) stays in L2 while a thread's consecutive panels pass over it; a panel
// streams from L2 (or memory, at decode row counts, where the call is bandwidth-bound).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "task_queue.h"

namespace cbserve_silu {  // layer_ops_cpu.cpp: silu_mul's avx512 rows
void rows_avx512(bool bf16, const void* gate_up, int64_t ld_in, void* out, int64_t ld_out, int64_t rows, int64_t n);
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CB_X86 1
#define CB_AVX2 __attribute__((target("avx2,fma")))
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define CB_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#else
#define CB_X86 0
#endif

namespace {

constexpr int64_t ROW_BLOCK_BYTES = 512 << 10;
// How far ahead (K pairs, 128 bytes each) tiles of 4 rows or more prefetch their bfloat16 panel:
// there the hardware prefetcher alone left the panel arriving late (measured on a model's layers,
// 2-core AMX Xeon: 8 rows 27 -> 12 ms, 32 rows 41 -> 35 ms; 1-2 rows, already at the memory's
// bandwidth or a little slower with it, go without).
constexpr int64_t PREFETCH_PAIRS = 16;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cbserve_cpu linear: ", what); }

enum class Isa { avx2, avx512, avx512_bf16 };

Isa parse_isa(const std::string& name) {
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  if (name == "avx512_bf16") return Isa::avx512_bf16;
  TORCH_CHECK(false, "cbserve_cpu linear: unknown isa '", name, "' (avx2, avx512, avx512_bf16)");
}

// Whether this CPU runs the path (and this build has it).
bool cpu_has(Isa isa) {
#if CB_X86
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case Isa::avx512_bf16:
      return cpu_has(Isa::avx512) && __builtin_cpu_supports("avx512bf16");
  }
#endif
  (void)isa;
  return false;
}

bool isa_available(const std::string& name) { return cpu_has(parse_isa(name)); }

int64_t panel_width(Isa isa) { return isa == Isa::avx2 ? 16 : 32; }
bool is_bf16(Isa isa) { return isa == Isa::avx512_bf16; }

// ------------------------------------------------------------------------------------- packing

at::Tensor pack_linear_weight(const at::Tensor& weight, const std::string& isa_name) {
  const Isa isa = parse_isa(isa_name);
  check(weight.dim() == 2 && weight.device().is_cpu(), "the weight must be a 2-D CPU tensor");
  const at::ScalarType dtype = is_bf16(isa) ? at::kBFloat16 : at::kFloat;
  check(weight.scalar_type() == dtype, is_bf16(isa) ? "isa avx512_bf16 packs bfloat16 weights"
                                                    : "isa avx2 / avx512 pack float32 weights");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), nr = panel_width(isa), panels = (n + nr - 1) / nr;
  if (!is_bf16(isa)) {
    at::Tensor out = at::zeros({panels, k, nr}, w.options());
    const float* src = w.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t j = 0; j < nr && p * nr + j < n; ++j)
          for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * nr + j] = src[(p * nr + j) * k + i];
    });
    return out;
  }
  // [panels, ceil(K / 2), NR, 2]: element (i, j) of the panel at [i / 2][j][i % 2].
  const int64_t pairs = (k + 1) / 2;
  at::Tensor out = at::zeros({panels, pairs, nr, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < nr && p * nr + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) dst[((p * pairs + i / 2) * nr + j) * 2 + i % 2] = src[(p * nr + j) * k + i];
  });
  return out;
}

// Arguments of one panel's pass over a block of rows: y[r, col:col+cols] = x[r, :k] . panel + bias.
struct PanelArgs {
  const void* x;
  int64_t ldx;  // elements
  int64_t k;
  const void* panel;
  void* y;
  int64_t ldy;
  int64_t cols;  // <= NR: the last panel may be partial
  const void* bias;  // bias + col, or null
  int64_t rows;
};
using PanelFn = void (*)(const PanelArgs&);

#if CB_X86
// Accumulators are named variables, not arrays: GCC keeps an array of vectors on the stack and
// stores it back on every iteration (3x slower).

// ------------------------------------------------------------------- AVX2, float32, 6 x 16

#define CB_ROW(r)                                           \
  if constexpr (R > r) {                                    \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i); \
    a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);           \
    a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);           \
  }
// The first K slice writes acc + bias, later ones add acc to what is there: the same order for
// every row count, so a row's result never depends on its batch.
#define CB_STORE(r)                                                                             \
  if constexpr (R > r) {                                                                        \
    float* out = y + r * ldy;                                                                   \
    if (cols == 16) {                                                                           \
      const __m256 p0 = first ? b0 : _mm256_loadu_ps(out), p1 = first ? b1 : _mm256_loadu_ps(out + 8); \
      _mm256_storeu_ps(out, _mm256_add_ps(a##r##0, p0));                                        \
      _mm256_storeu_ps(out + 8, _mm256_add_ps(a##r##1, p1));                                    \
    } else {                                                                                    \
      _mm256_store_ps(buf, a##r##0);                                                            \
      _mm256_store_ps(buf + 8, a##r##1);                                                        \
      for (int64_t j = 0; j < cols; ++j) out[j] = buf[j] + (first ? bb[j] : out[j]);           \
    }                                                                                           \
  }

template <int R>
CB_AVX2 inline void tile_avx2(const float* x, int64_t ldx, int64_t k, const float* panel, float* y, int64_t ldy,
                              int64_t cols, const float* bias, bool first) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_load_ps(panel + i * 16), w1 = _mm256_load_ps(panel + i * 16 + 8);
    CB_ROW(0) CB_ROW(1) CB_ROW(2) CB_ROW(3) CB_ROW(4) CB_ROW(5)
  }
  alignas(32) float buf[16], bb[16];
  for (int64_t j = 0; j < 16; ++j) bb[j] = bias && j < cols ? bias[j] : 0.f;
  const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
  CB_STORE(0) CB_STORE(1) CB_STORE(2) CB_STORE(3) CB_STORE(4) CB_STORE(5)
}
#undef CB_ROW
#undef CB_STORE

// K in fixed slices of AVX2_K_SLICE (a 16 KiB panel slice stays in L1 while every row tile of the
// block passes over it), whatever the number of rows; this call does the slice starting at k0.
constexpr int64_t AVX2_K_SLICE = 256;

CB_AVX2 void panel_slice_avx2(const PanelArgs& a, int64_t k0) {
  const float* bias = static_cast<const float*>(a.bias);
  const int64_t kk = std::min(AVX2_K_SLICE, a.k - k0);
  const float* x = static_cast<const float*>(a.x) + k0;
  const float* panel = static_cast<const float*>(a.panel) + k0 * 16;
  float* y = static_cast<float*>(a.y);
  const bool first = k0 == 0;
  int64_t r = 0;
  for (; r + 6 <= a.rows; r += 6) tile_avx2<6>(x + r * a.ldx, a.ldx, kk, panel, y + r * a.ldy, a.ldy, a.cols, bias, first);
  const float* xr = x + r * a.ldx;
  float* yr = y + r * a.ldy;
  switch (a.rows - r) {
    case 5: tile_avx2<5>(xr, a.ldx, kk, panel, yr, a.ldy, a.cols, bias, first); break;
    case 4: tile_avx2<4>(xr, a.ldx, kk, panel, yr, a.ldy, a.cols, bias, first); break;
    case 3: tile_avx2<3>(xr, a.ldx, kk, panel, yr, a.ldy, a.cols, bias, first); break;
    case 2: tile_avx2<2>(xr, a.ldx, kk, panel, yr, a.ldy, a.cols, bias, first); break;
    case 1: tile_avx2<1>(xr, a.ldx, kk, panel, yr, a.ldy, a.cols, bias, first); break;
    default: break;
  }
}

// A tile's float32 sums part-way through K (K in chunks: CB_PANEL_12), kept rows x 32 in `part`:
// stored and loaded back exactly, so a chunked sum is the unchunked one, bit for bit.
#define CB_SAVE_PART(r)                                   \
  if constexpr (R > r) {                                  \
    _mm512_store_ps(part + r * 32, a##r##0);              \
    _mm512_store_ps(part + r * 32 + 16, a##r##1);         \
  }
#define CB_LOAD_PART(r)                                   \
  if constexpr (R > r) {                                  \
    a##r##0 = _mm512_load_ps(part + r * 32);              \
    a##r##1 = _mm512_load_ps(part + r * 32 + 16);         \
  }
#define CB_PARTS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

// --------------------------------------------------------------- AVX-512, float32, 12 x 32

#define CB_ROW(r)                                           \
  if constexpr (R > r) {                                    \
    const __m512 xb = _mm512_set1_ps(x[r * ldx + i]);       \
    a##r##0 = _mm512_fmadd_ps(xb, w0, a##r##0);           \
    a##r##1 = _mm512_fmadd_ps(xb, w1, a##r##1);           \
  }
#define CB_STORE(r)                                                              \
  if constexpr (R > r) {                                                         \
    float* out = y + r * ldy;                                                    \
    _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(a##r##0, b0));                  \
    _mm512_mask_storeu_ps(out + 16, m1, _mm512_add_ps(a##r##1, b1));             \
  }

template <int R>
CB_AVX512 inline void tile_avx512(const float* x, int64_t ldx, int64_t k, int64_t i0, int64_t i1, const float* panel,
                                  int64_t ahead, float* part, float* y, int64_t ldy, int64_t cols, const float* bias) {
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m512 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  __m512 a60 = a00, a61 = a00, a70 = a00, a71 = a00, a80 = a00, a81 = a00;
  __m512 a90 = a00, a91 = a00, a100 = a00, a101 = a00, a110 = a00, a111 = a00;
  if (i0 > 0) { CB_PARTS(CB_LOAD_PART) }
  for (int64_t i = i0; i < i1; ++i) {
    if (ahead) {  // as tile_bf16: the same 128 bytes a step
      _mm_prefetch(reinterpret_cast<const char*>(panel + (i + ahead) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (i + ahead) * 32 + 16), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_load_ps(panel + i * 32), w1 = _mm512_load_ps(panel + i * 32 + 16);
    CB_ROW(0) CB_ROW(1) CB_ROW(2) CB_ROW(3) CB_ROW(4) CB_ROW(5)
    CB_ROW(6) CB_ROW(7) CB_ROW(8) CB_ROW(9) CB_ROW(10) CB_ROW(11)
  }
  if (i1 < k) {
    CB_PARTS(CB_SAVE_PART)
    return;
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  CB_STORE(0) CB_STORE(1) CB_STORE(2) CB_STORE(3) CB_STORE(4) CB_STORE(5)
  CB_STORE(6) CB_STORE(7) CB_STORE(8) CB_STORE(9) CB_STORE(10) CB_STORE(11)
}
#undef CB_ROW
#undef CB_STORE

// ---------------------------------------------------------- AVX-512 BF16, bfloat16, 12 x 32

// The input pair (x[k], x[k + 1]) as one 32-bit lane, broadcast; the last of an odd K pairs with 0.
#define CB_ROW(r)                                                                              \
  if constexpr (R > r) {                                                                       \
    int32_t pair;                                                                              \
    std::memcpy(&pair, x + r * ldx + 2 * i, 4);                                                \
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                     \
    a##r##0 = _mm512_dpbf16_ps(a##r##0, xb, w0);                                               \
    a##r##1 = _mm512_dpbf16_ps(a##r##1, xb, w1);                                               \
  }
#define CB_TAIL(r)                                                                             \
  if constexpr (R > r) {                                                                       \
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * ldx + k - 1])); \
    a##r##0 = _mm512_dpbf16_ps(a##r##0, xb, w0);                                               \
    a##r##1 = _mm512_dpbf16_ps(a##r##1, xb, w1);                                               \
  }
#define CB_STORE(r)                                                                                     \
  if constexpr (R > r) {                                                                                \
    uint16_t* out = y + r * ldy;                                                                        \
    _mm256_mask_storeu_epi16(out, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a##r##0, b0)));         \
    _mm256_mask_storeu_epi16(out + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a##r##1, b1)));    \
  }

CB_AVX512BF16 inline __m512 bf16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <int R>
CB_AVX512BF16 inline void tile_bf16(const uint16_t* x, int64_t ldx, int64_t k, int64_t i0, int64_t i1,
                                    const uint16_t* panel, int64_t ahead, float* part, uint16_t* y, int64_t ldy, int64_t cols,
                                    const uint16_t* bias) {
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m512 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  __m512 a60 = a00, a61 = a00, a70 = a00, a71 = a00, a80 = a00, a81 = a00;
  __m512 a90 = a00, a91 = a00, a100 = a00, a101 = a00, a110 = a00, a111 = a00;
  if (i0 > 0) { CB_PARTS(CB_LOAD_PART) }
  const int64_t full = k / 2;
  for (int64_t i = i0; i < i1; ++i) {
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (i + ahead) * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (i + ahead) * 64 + 32), _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_load_si512(panel + i * 64);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(panel + i * 64 + 32);
    CB_ROW(0) CB_ROW(1) CB_ROW(2) CB_ROW(3) CB_ROW(4) CB_ROW(5)
    CB_ROW(6) CB_ROW(7) CB_ROW(8) CB_ROW(9) CB_ROW(10) CB_ROW(11)
  }
  if (i1 < full) {
    CB_PARTS(CB_SAVE_PART)
    return;
  }
  if (k % 2) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(panel + full * 64);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(panel + full * 64 + 32);
    CB_TAIL(0) CB_TAIL(1) CB_TAIL(2) CB_TAIL(3) CB_TAIL(4) CB_TAIL(5)
    CB_TAIL(6) CB_TAIL(7) CB_TAIL(8) CB_TAIL(9) CB_TAIL(10) CB_TAIL(11)
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(m0, bias)) : _mm512_setzero_ps();
  const __m512 b1 = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(m1, bias + 16)) : _mm512_setzero_ps();
  CB_STORE(0) CB_STORE(1) CB_STORE(2) CB_STORE(3) CB_STORE(4) CB_STORE(5)
  CB_STORE(6) CB_STORE(7) CB_STORE(8) CB_STORE(9) CB_STORE(10) CB_STORE(11)
}
#undef CB_ROW
#undef CB_TAIL
#undef CB_STORE

// Row tiles of at most 12 rows, as even as they divide (16 rows: 8 + 8, not 12 + 4, whose 8
// accumulators would wait on the multiply-add latency). A panel of a few tiles (decode-sized row
// counts) goes K chunk by K chunk, every tile over each chunk while it is in L1: the panel then
// streams from memory once, behind the work of all its tiles, instead of ahead of the first tile's
// alone (where a call is neither compute- nor bandwidth-bound).
constexpr int64_t CHUNKED_MAX_TILES = 8;
constexpr int64_t CHUNK_STEPS = 96;  // K steps of a chunk: 12 KiB of a panel (bfloat16 pairs, float32 columns)
// How far ahead (K steps) a chunk's first tile prefetches the panel, into the chunk after: the rest of
// the chunk's tiles run from L1 while it arrives. Chunked this way, bfloat16 calls of 16-48 rows ran
// 5-8% faster than unchunked over a model's 120 matrices streamed from memory (2-core AMD EPYC); 64
// steps measured best of 48, 64, 96 and 192.
constexpr int64_t CHUNK_AHEAD = 64;

#define CB_TILE_CASE(TILE, n) \
  case n: TILE<n>(xr, a.ldx, a.k, i0, i1, panel, ahead, part, yr, a.ldy, a.cols, bias); break;
#define CB_PANEL_12(NAME, TILE, T, ATTR, STEPS)                                                       \
  ATTR void NAME(const PanelArgs& a) {                                                                \
    const T* x = static_cast<const T*>(a.x);                                                          \
    const T* panel = static_cast<const T*>(a.panel);                                                  \
    const T* bias = static_cast<const T*>(a.bias);                                                    \
    T* y = static_cast<T*>(a.y);                                                                      \
    const int64_t tiles = (a.rows + 11) / 12, steps = STEPS;                                          \
    const bool chunked = tiles > 1 && tiles <= CHUNKED_MAX_TILES;                                     \
    const int64_t chunk = chunked ? CHUNK_STEPS : std::max<int64_t>(steps, 1);                        \
    alignas(64) float parts[CHUNKED_MAX_TILES * 12 * 32];                                             \
    for (int64_t i0 = 0; i0 < std::max<int64_t>(steps, 1); i0 += chunk) {                            \
      const int64_t i1 = std::min(steps, i0 + chunk);                                                 \
      for (int64_t t = 0, r = 0, rows = 0; t < tiles; r += rows, ++t) {                               \
        rows = (a.rows - r) / (tiles - t);                                                            \
        const T* xr = x + r * a.ldx;                                                                  \
        T* yr = y + r * a.ldy;                                                                        \
        float* part = parts + (chunked ? r * 32 : 0);                                                 \
        const int64_t ahead = chunked ? (t == 0 ? CHUNK_AHEAD : 0) : rows >= 4 ? PREFETCH_PAIRS : 0;  \
        switch (rows) {                                                                               \
          CB_TILE_CASE(TILE, 12) CB_TILE_CASE(TILE, 11) CB_TILE_CASE(TILE, 10) CB_TILE_CASE(TILE, 9)     \
          CB_TILE_CASE(TILE, 8) CB_TILE_CASE(TILE, 7) CB_TILE_CASE(TILE, 6) CB_TILE_CASE(TILE, 5)        \
          CB_TILE_CASE(TILE, 4) CB_TILE_CASE(TILE, 3) CB_TILE_CASE(TILE, 2) CB_TILE_CASE(TILE, 1)        \
          default: break;                                                                             \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
  }

CB_PANEL_12(panel_avx512, tile_avx512, float, CB_AVX512, a.k)
CB_PANEL_12(panel_bf16, tile_bf16, uint16_t, CB_AVX512BF16, a.k / 2)
#undef CB_PANEL_12
#undef CB_TILE_CASE
#undef CB_PARTS
#undef CB_SAVE_PART
#undef CB_LOAD_PART
#endif  // CB_X86

PanelFn panel_fn(Isa isa) {
#if CB_X86
  switch (isa) {
    case Isa::avx2: return nullptr;  // by K slices: run_avx2
    case Isa::avx512: return panel_avx512;
    case Isa::avx512_bf16: return panel_bf16;
  }
#endif
  (void)isa;
  return nullptr;
}

// AVX2: each thread takes a range of panels; for a block of rows, every K slice passes over all of
// its panels while the rows' slice stays in L2 (the previous session's tuned order, measured on
// par with oneDNN's AVX2 kernel from 64 rows up and faster below).
void run_avx2(const float* x, int64_t m, int64_t k, const float* w, int64_t panels, const float* bias, float* y,
              int64_t n) {
#if CB_X86
  const int64_t slice = std::min(k, AVX2_K_SLICE);
  const int64_t rows = std::max<int64_t>(6, (ROW_BLOCK_BYTES / 2) / (slice * 4) / 6 * 6);
  // A few rows (decode): each panel's slices one after the other, so the weights stream once in
  // order. The same slices in the same order either way: the results are identical.
  const bool few = m <= 24;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
      for (int64_t outer = 0; outer < (few ? end - begin : (k + slice - 1) / slice); ++outer) {
        for (int64_t inner = 0; inner < (few ? (k + slice - 1) / slice : end - begin); ++inner) {
          const int64_t p = begin + (few ? outer : inner), k0 = (few ? inner : outer) * slice, col = p * 16;
          PanelArgs a{x + r0 * k, k, k, w + p * k * 16, y + r0 * n + col, n, std::min<int64_t>(16, n - col),
                      bias ? bias + col : nullptr, std::min(rows, m - r0)};
          panel_slice_avx2(a, k0);
        }
      }
    }
  });
#else
  (void)x, (void)m, (void)k, (void)w, (void)panels, (void)bias, (void)y, (void)n;
#endif
}

// ----------------------------------------------------------------------------------- the op

// The checks every packed op makes of its input and packed weight (for `out_features` outputs).
void check_packed(const at::Tensor& input, const at::Tensor& packed, int64_t out_features, Isa isa) {
  check(cpu_has(isa), "this CPU lacks the instruction set of the requested path");
  check(input.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  const at::ScalarType dtype = is_bf16(isa) ? at::kBFloat16 : at::kFloat;
  check(input.scalar_type() == dtype && packed.scalar_type() == dtype,
        is_bf16(isa) ? "isa avx512_bf16 takes bfloat16 inputs and weights" : "isa avx2 / avx512 take float32");
  const int64_t nr = panel_width(isa), k = input.size(-1), panels = packed.size(0);
  if (is_bf16(isa)) {
    check(packed.dim() == 4 && packed.size(2) == nr && packed.size(3) == 2 && packed.size(1) == (k + 1) / 2,
          "the weight must come from pack_linear_weight(..., 'avx512_bf16') with in_features = input.size(-1)");
  } else {
    check(packed.dim() == 3 && packed.size(2) == nr && packed.size(1) == k,
          "the weight must come from pack_linear_weight with this isa and in_features = input.size(-1)");
  }
  check(panels == (out_features + nr - 1) / nr, "out_features does not match the packed weight");
  check(packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
        "the packed weight must be contiguous and 64-byte aligned");
}

// Tasks of (row block, panel) for `m` rows of K = k: `run(first row, rows, panel)` each. Row
// blocks of equal size (in whole 12-row tiles) hold at most ROW_BLOCK_BYTES of inputs each.
template <typename F>
void for_each_panel_task(int64_t m, int64_t k, int64_t elem, int64_t panels, const F& run) {
  const int64_t blocks = std::max<int64_t>(1, (m * k * elem + ROW_BLOCK_BYTES - 1) / ROW_BLOCK_BYTES);
  const int64_t block = ((m + blocks - 1) / blocks + 11) / 12 * 12, nblocks = (m + block - 1) / block;
  cbserve_tasks::for_each_task(nblocks * panels, [&](int64_t t) {
    const int64_t r0 = t / panels * block;
    run(r0, std::min(block, m - r0), t % panels);
  });
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features, const std::string& isa_name) {
  const Isa isa = parse_isa(isa_name);
  check_packed(input, packed, out_features, isa);
  const int64_t nr = panel_width(isa), k = input.size(-1), panels = packed.size(0);
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x.options());
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) {
    check(bias->scalar_type() == x.scalar_type() && bias->numel() == out_features && bias->device().is_cpu(),
          "the bias must be a CPU tensor [out_features] of the input's dtype");
    b = bias->contiguous();
  }
  if (y.numel() == 0) return y;
  const int64_t m = y.numel() / out_features;
  if (k == 0) return b ? y.copy_(b->expand_as(y)) : y.zero_();  // empty sums
  if (isa == Isa::avx2) {
    check(CB_X86, "this build has no kernel for the requested path (not an x86-64 build)");
    run_avx2(x.data_ptr<float>(), m, k, packed.data_ptr<float>(), panels, b ? b->data_ptr<float>() : nullptr,
             y.data_ptr<float>(), out_features);
    return y;
  }
  const PanelFn fn = panel_fn(isa);
  check(fn != nullptr, "this build has no kernel for the requested path (not an x86-64 build)");
  const int64_t elem = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(packed.data_ptr());
  const char* bp = b ? static_cast<const char*>(b->data_ptr()) : nullptr;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t n = out_features, panel_bytes = packed.numel() / panels * elem;
  for_each_panel_task(m, k, elem, panels, [&](int64_t r0, int64_t rows, int64_t p) {
    const int64_t col = p * nr;
    fn(PanelArgs{xp + r0 * k * elem, k, k, wp + p * panel_bytes, yp + (r0 * n + col) * elem, n,
                 std::min(nr, n - col), bp ? bp + col * elem : nullptr, rows});
  });
  return y;
}

// silu(gate) * up of a gate/up projection, [.., intermediate], from a weight packed with each
// 32-column panel holding 16 gate columns then the same 16 up columns (PackedLinear's
// `silu_epilogue`): a panel's tile goes to a small buffer, rounded as packed_linear rounds it,
// and silu_mul's own row code makes the panel's 16 outputs from it. The [.., 2 * intermediate]
// projection is never written out and read back: the same results as packed_linear then silu_mul,
// bit for bit.
at::Tensor packed_gate_up_silu(const at::Tensor& input, const at::Tensor& packed, int64_t intermediate,
                               const std::string& isa_name) {
  const Isa isa = parse_isa(isa_name);
  check(isa != Isa::avx2, "the gate/up silu epilogue runs on the avx512 and avx512_bf16 paths (32-column panels)");
  check(intermediate > 0 && intermediate % 16 == 0, "intermediate must be a positive multiple of 16");
  check_packed(input, packed, 2 * intermediate, isa);
  const PanelFn fn = panel_fn(isa);
  check(fn != nullptr, "this build has no kernel for the requested path (not an x86-64 build)");
  const int64_t k = input.size(-1), panels = packed.size(0);
  check(k > 0, "in_features must be positive");
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = intermediate;
  at::Tensor y = at::empty(shape, x.options());
  if (y.numel() == 0) return y;
  const int64_t m = y.numel() / intermediate, elem = x.element_size(), panel_bytes = packed.numel() / panels * elem;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(packed.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  const bool bf16 = is_bf16(isa);
  for_each_panel_task(m, k, elem, panels, [&](int64_t r0, int64_t rows, int64_t p) {
    thread_local std::vector<char> tile;  // rows x [16 gate | 16 up]
    tile.resize(std::max<size_t>(tile.size(), static_cast<size_t>(rows * 32 * elem)));
    fn(PanelArgs{xp + r0 * k * elem, k, k, wp + p * panel_bytes, tile.data(), 32, 32, nullptr, rows});
    cbserve_silu::rows_avx512(bf16, tile.data(), 32, yp + (r0 * intermediate + p * 16) * elem, intermediate, rows, 16);
  });
  return y;
}

}  // namespace

// For decoder_layers_cpu.cpp's layer loop.
namespace cbserve_layer {
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features, const std::string& isa) {
  return ::packed_linear(input, packed, std::nullopt, out_features, isa);
}
at::Tensor gate_up_silu(const at::Tensor& input, const at::Tensor& packed, int64_t intermediate, const std::string& isa) {
  return ::packed_gate_up_silu(input, packed, intermediate, isa);
}
}  // namespace cbserve_layer

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("linear_isa_available(str isa) -> bool", &isa_available);
  m.def("pack_linear_weight(Tensor weight, str isa) -> Tensor", &pack_linear_weight);
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, int out_features, str isa) -> Tensor",
        &packed_linear);
  m.def("packed_gate_up_silu(Tensor input, Tensor packed, int intermediate, str isa) -> Tensor", &packed_gate_up_silu);
}
