// LoRA deltas of a packed batch whose rows use different adapters (kernels/lora.py), in one call
// per adapted projection: each row is shrunk and expanded through its own adapter's factors only
// (a segmented gather GEMV, as Punica's SGMV groups rows by adapter), where the dense form
// ((x @ a) * mask) @ b multiplies every row by every resident adapter's columns.
//
//   y [T, O] += per row t whose slot s = row_slots[t] is >= 0, per part p of the projection:
//       (a[(p * S + s) * r : +r] @ x[t]) @ b_t[s * r : +r, part_ends[p-1] : part_ends[p]]
//
// a [P * S * r, I] and b_t [S * r, O] hold the factors of S slots of rank r (any row strides: a
// part's factors are views into its fused group's): the shrink is r dot products of contiguous
// rows with x[t] per part (vectorized by `omp simd` reductions), the expand runs of axpy over
// b_t's contiguous rows; a fused projection (q/k/v, gate/up: P parts side by side in O) takes
// one call. Sums are in float (double for float64), one rounding into y.
// A run of at least kGemmRows consecutive rows of one slot (a prompt's chunk) goes through ATen's
// GEMMs instead (2 per part): per row, the GEMV would read the factors once for every row.
//
// Paths (the `isa` argument, cpu_isa.py): "generic", "avx2" (AVX2 + FMA) and "avx512" (F/BW/VL/DQ;
// "avx512_bf16" runs it too): the same loops, compiled for each target.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "vector_paths.h"

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cbserve_cpu lora_delta_: ", what); }

using cbserve_vector_paths::Path;

Path path_of(const std::string& isa) { return cbserve_vector_paths::path_of(isa, "cbserve_cpu lora_delta_"); }

constexpr int64_t kGemmRows = 16;

template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

struct Shape {
  int64_t in, out, parts, slots, rank;
  int64_t lda, ldb;  // row strides of a and b_t (a part's factors are a view into its group's)
  const int64_t* part_ends;
};

// One row: h = x @ a[:, its slot's columns of every part] (P * r values), then
// acc = h_p @ b_t[its slot's rows, part p's outputs] for every part, y += acc.
#define CB_LORA_ROW                                                                   \
  const int64_t r = sh.rank;                                                          \
  for (int64_t p = 0; p < sh.parts; ++p) {                                            \
    for (int64_t j = 0; j < r; ++j) {                                                 \
      const T* __restrict__ ak = a + ((p * sh.slots + s) * r + j) * sh.lda;           \
      A sum = 0;                                                                      \
      _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < sh.in; ++i)      \
        sum += static_cast<A>(ak[i]) * static_cast<A>(x[i]);                          \
      h[p * r + j] = sum;                                                             \
    }                                                                                 \
  }                                                                                   \
  for (int64_t o = 0; o < sh.out; ++o) acc[o] = 0;                                    \
  int64_t begin = 0;                                                                  \
  for (int64_t p = 0; p < sh.parts; ++p) {                                            \
    const int64_t end = sh.part_ends[p];                                              \
    for (int64_t j = 0; j < r; ++j) {                                                 \
      const A hj = h[p * r + j];                                                      \
      const T* __restrict__ bj = b + (s * r + j) * sh.ldb;                            \
      _Pragma("GCC ivdep") for (int64_t o = begin; o < end; ++o) acc[o] += hj * static_cast<A>(bj[o]); \
    }                                                                                 \
    begin = end;                                                                      \
  }                                                                                   \
  for (int64_t o = 0; o < sh.out; ++o) y[o] = static_cast<T>(static_cast<A>(y[o]) + acc[o]);

template <typename T, typename A>
void row_generic(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ b,
                 int64_t s, const Shape& sh, A* __restrict__ h, A* __restrict__ acc) { CB_LORA_ROW }
template <typename T, typename A>
CB_AVX2 void row_avx2(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ b,
                      int64_t s, const Shape& sh, A* __restrict__ h, A* __restrict__ acc) {
  CB_LORA_ROW
}
template <typename T, typename A>
CB_AVX512 void row_avx512(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ a,
                          const T* __restrict__ b, int64_t s, const Shape& sh, A* __restrict__ h, A* __restrict__ acc) {
  CB_LORA_ROW
}
#undef CB_LORA_ROW

template <typename F>
void dispatch(at::ScalarType type, F&& f) {
  if (type == at::kFloat) return f(float{});
  if (type == at::kBFloat16) return f(c10::BFloat16{});
  check(type == at::kDouble, "float32, bfloat16 or float64 tensors only");
  f(double{});
}

void lora_delta_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                 const at::Tensor& row_slots, const at::Tensor& part_ends, int64_t rank, const std::string& isa) {
  const Path path = path_of(isa);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&y, &x, &a, &b_t})
    check(t->device().is_cpu() && t->dim() == 2 && t->stride(1) == 1 && t->scalar_type() == y.scalar_type(),
          "y, x, a, b_t: 2-D CPU tensors of one dtype with unit column stride");
  check(y.is_contiguous() && x.is_contiguous(), "y and x must be contiguous");
  check(row_slots.dim() == 1 && row_slots.scalar_type() == at::kLong && row_slots.size(0) == x.size(0),
        "row_slots: int64, one per row of x");
  check(part_ends.dim() == 1 && part_ends.scalar_type() == at::kLong && part_ends.size(0) >= 1,
        "part_ends: int64, one per part");
  const at::Tensor slots = row_slots.contiguous(), ends = part_ends.contiguous();
  const int64_t parts = ends.size(0);
  check(rank >= 1 && b_t.size(0) % rank == 0, "b_t's rows must be slots x rank");
  Shape sh{x.size(1), y.size(1), parts, b_t.size(0) / rank, rank, a.stride(0), b_t.stride(0),
           ends.data_ptr<int64_t>()};
  check(y.size(0) == x.size(0) && a.size(1) == sh.in && a.size(0) == parts * sh.slots * rank &&
            b_t.size(1) == sh.out && sh.part_ends[parts - 1] == sh.out,
        "shapes: y [T, O], x [T, I], a [P*S*r, I], b_t [S*r, O], part_ends[-1] == O");
  const int64_t rows = x.size(0);
  const int64_t* given = slots.data_ptr<int64_t>();
  std::vector<int64_t> slot(given, given + rows);  // -1 where a run's GEMMs did the row
  for (int64_t t = 0; t < rows; ++t) check(slot[t] < sh.slots, "a row's slot is past the slots");
  for (int64_t begin = 0, end; begin < rows; begin = end) {
    for (end = begin + 1; end < rows && slot[end] == slot[begin];) ++end;
    const int64_t s = slot[begin], n = end - begin;
    if (s < 0 || n < kGemmRows) continue;
    const at::Tensor xs = x.narrow(0, begin, n), ys = y.narrow(0, begin, n), bs = b_t.narrow(0, s * rank, rank);
    int64_t first = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t last = sh.part_ends[p];
      const at::Tensor h = at::mm(xs, a.narrow(0, (p * sh.slots + s) * rank, rank).t());
      ys.narrow(1, first, last - first).addmm_(h, bs.narrow(1, first, last - first));
      first = last;
    }
    std::fill(slot.begin() + begin, slot.begin() + end, -1);
  }
  dispatch(y.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    T* yp = y.data_ptr<T>();
    const T *xp = x.data_ptr<T>(), *ap = a.data_ptr<T>(), *bp = b_t.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<A> h(parts * rank), acc(sh.out);
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;  // the base model's row: no delta
        T* yt = yp + t * sh.out;
        const T* xt = xp + t * sh.in;
        if (path == Path::kAvx512) row_avx512<T, A>(yt, xt, ap, bp, slot[t], sh, h.data(), acc.data());
        else if (path == Path::kAvx2) row_avx2<T, A>(yt, xt, ap, bp, slot[t], sh, h.data(), acc.data());
        else row_generic<T, A>(yt, xt, ap, bp, slot[t], sh, h.data(), acc.data());
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  m.def("lora_delta_(Tensor(a!) y, Tensor x, Tensor a, Tensor b_t, Tensor row_slots, Tensor part_ends, int rank, "
        "str isa) -> ()",
        &lora_delta_);
}
