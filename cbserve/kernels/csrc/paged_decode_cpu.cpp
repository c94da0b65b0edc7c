// Paged decode attention for CPUs: one query token per request, K/V read straight from the
// pages through the block table (no gathered copy), GQA by reading each KV head once for its
// group of query heads, optional sliding window and soft-capping. Parallel over requests (over
// (request, KV head) pairs when there are few) on ATen's thread pool. Accumulates in float
// (double for double tensors).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Eight independent partial sums so that the compiler vectorizes without reassociating.
template <typename T, typename A>
inline A dot(const A* q, const T* k, int64_t n) {
  A s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) s[j] += q[i + j] * static_cast<A>(k[i + j]);
  }
  A r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) r += q[i] * static_cast<A>(k[i]);
  return r;
}

// Calls f(j, slot) for the positions [first, len) of a request, j counting from 0, walking the
// block table a page at a time (one division per page, not per token).
template <typename F>
inline void for_each_slot(const int64_t* table, int64_t page_size, int64_t first, int64_t len, F&& f) {
  for (int64_t pos = first; pos < len;) {
    const int64_t off = pos % page_size;
    const int64_t count = std::min(page_size - off, len - pos);
    const int64_t base = table[pos / page_size] * page_size + off;
    for (int64_t t = 0; t < count; ++t) f(pos - first + t, base + t);
    pos += count;
  }
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
            double scale, int64_t window, double softcap) {
  using A = at::opmath_type<T>;
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = block_tables.size(1);
  const int64_t row = kv_heads * dim;  // one token's K (or V) of every KV head: contiguous
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const A a_scale = static_cast<A>(scale), a_cap = static_cast<A>(softcap);
  // A task reads whole token rows (all KV heads) so that K/V stream sequentially from memory;
  // with fewer requests than ~4 per thread, tasks split by KV head instead, to keep threads busy.
  const int64_t splits = batch >= 4 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_task = kv_heads / splits;

  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> qf, acc, scores, top, inv;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, g0 = (task % splits) * heads_per_task;
      const int64_t nq = heads_per_task * group;  // query heads of this task: [g0 * group, +nq)
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + b * width;
      const T* qrow = qp + (b * heads + g0 * group) * dim;
      qf.assign(qrow, qrow + nq * dim);
      scores.resize(nq * n);
      top.assign(nq, -std::numeric_limits<A>::infinity());
      inv.resize(nq);
      for_each_slot(table, page_size, first, len, [&](int64_t j, int64_t slot) {
        const T* krow = kp + slot * row + g0 * dim;
        for (int64_t h = 0; h < nq; ++h) {
          A s = dot(qf.data() + h * dim, krow + (h / group) * dim, dim) * a_scale;
          if (a_cap > 0) s = a_cap * std::tanh(s / a_cap);
          scores[h * n + j] = s;
          top[h] = std::max(top[h], s);
        }
      });
      for (int64_t h = 0; h < nq; ++h) {
        A sum = 0;
        A* p = scores.data() + h * n;
        for (int64_t j = 0; j < n; ++j) {
          p[j] = std::exp(p[j] - top[h]);
          sum += p[j];
        }
        inv[h] = A(1) / sum;
      }
      acc.assign(nq * dim, A(0));
      for_each_slot(table, page_size, first, len, [&](int64_t j, int64_t slot) {
        const T* vrow = vp + slot * row + g0 * dim;
        for (int64_t h = 0; h < nq; ++h) {
          const A p = scores[h * n + j];
          const T* v = vrow + (h / group) * dim;
          A* a = acc.data() + h * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<A>(v[d]);
        }
      });
      T* orow = op + (b * heads + g0 * group) * dim;
      for (int64_t h = 0; h < nq; ++h) {
        for (int64_t d = 0; d < dim; ++d) orow[h * dim + d] = static_cast<T>(acc[h * dim + d] * inv[h]);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, H, D] and caches [blocks, page, kvH, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(3), "shape mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "one block table row and one context length per request");
  auto lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "cbserve_paged_decode", [&] {
    decode<scalar_t>(q, k_cache, v_cache, block_tables, lens, out, scale, window, softcap);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(cbserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
}
