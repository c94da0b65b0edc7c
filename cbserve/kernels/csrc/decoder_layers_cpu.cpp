// A Llama model's decoder layers for a decode step on the C++ attention kernels as one op: the kernels
// llama_forward.py's lean forward calls, in its order and on the same views, so the same numbers
// bit for bit, without its ~17 Python calls a layer (1-32 decode rows of the default model: ~1 ms a
// step of Python and dispatch) and without holding the GIL between them, so a serving thread's
// Python (SSE, detokenizing, Ray's own threads) neither waits for the step's glue nor delays it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

namespace cbserve_layer {  // linear_cpu.cpp, layer_ops_cpu.cpp, paged_attention_cpu.cpp
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features, const std::string& isa);
at::Tensor gate_up_silu(const at::Tensor& input, const at::Tensor& packed, int64_t intermediate, const std::string& isa);
at::Tensor add_rms_norm(const std::optional<at::Tensor>& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        const std::string& isa);
at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& isa);
void rope(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t d,
          const std::string& isa);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, const std::string& isa);
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
}  // namespace cbserve_layer

namespace {

// residual [1, T, hidden]: the embeddings, updated in place to the last layer's input residual;
// returns that layer's MLP output [1, T, hidden] (the final norm adds it). Per layer l: norms[2l],
// norms[2l + 1] (input / post-attention RMSNorm weights), packed[4l..4l + 3] (q/k/v fused, o,
// gate/up fused, down; no biases); sizes: heads, kv_heads, head_dim, hidden, intermediate, and
// 1 when gate/up's weights are packed for the silu epilogue (AVX-512 paths), else 0 (silu_mul
// after the GEMM). Request b owns the query rows cu_seqlens_q[b]..cu_seqlens_q[b + 1] (the kernel
// backend's inputs: one row each in a decode step), attended by the per-row kernel (paged_attention).
at::Tensor llama_layers(at::Tensor& residual, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
                        at::TensorList packed, at::TensorList k_caches, at::TensorList v_caches,
                        const at::Tensor& cu_seqlens_q, const at::Tensor& block_tables, const at::Tensor& context_lens,
                        const at::Tensor& slot_mapping, at::IntArrayRef sizes, double eps, double scale,
                        const std::string& linear_isa, const std::string& layer_isa,
                        const std::string& attention_isa) {
  TORCH_CHECK(sizes.size() == 6,
              "llama_layers: sizes are heads, kv_heads, head_dim, hidden, intermediate, silu epilogue");
  const int64_t heads = sizes[0], kv_heads = sizes[1], d = sizes[2], hidden = sizes[3], intermediate = sizes[4];
  const bool epilogue = sizes[5] != 0;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(packed.size()) == 4 * layers,
              "llama_layers: 2 norms, 4 packed weights and a K and a V cache per layer");
  TORCH_CHECK(residual.dim() == 3 && residual.size(0) == 1 && residual.size(2) == hidden,
              "llama_layers: residual [1, T, hidden]");
  const int64_t t = residual.size(1);
  TORCH_CHECK(slot_mapping.numel() == t && block_tables.dim() == 2 && cu_seqlens_q.numel() == block_tables.size(0) + 1 &&
                  context_lens.numel() == block_tables.size(0),
              "llama_layers: a slot per row, a block table row, context length and query range per request");
  std::optional<at::Tensor> out;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor x = cbserve_layer::add_rms_norm(out, residual, norms[2 * l], eps, layer_isa);
    at::Tensor qkv = cbserve_layer::linear(x, packed[4 * l], (heads + 2 * kv_heads) * d, linear_isa)[0];  // [T, W]
    cbserve_layer::rope(qkv, cos, sin, heads + kv_heads, d, layer_isa);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    cbserve_layer::store_kv(qkv.narrow(1, heads * d, kv_heads * d).view({t, kv_heads, d}),
                            qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d).view({t, kv_heads, d}), k_cache,
                            v_cache, slot_mapping);
    const at::Tensor q = qkv.narrow(1, 0, heads * d).view({t, heads, d}).contiguous();
    const at::Tensor o = cbserve_layer::paged_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens,
                                                        scale, attention_isa);
    x = cbserve_layer::add_rms_norm(cbserve_layer::linear(o.view({1, t, heads * d}), packed[4 * l + 1], hidden,
                                                          linear_isa),
                                    residual, norms[2 * l + 1], eps, layer_isa);
    const at::Tensor h =
        epilogue ? cbserve_layer::gate_up_silu(x, packed[4 * l + 2], intermediate, linear_isa)
                 : cbserve_layer::silu_mul(cbserve_layer::linear(x, packed[4 * l + 2], 2 * intermediate, linear_isa),
                                           layer_isa);
    out = cbserve_layer::linear(h, packed[4 * l + 3], hidden, linear_isa);
  }
  return *out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbserve_cpu, m) {
  // The caches are written (each step's K/V rows) as the residual is.
  m.def("llama_layers(Tensor(a!) residual, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] packed, "
        "Tensor[] k_caches, Tensor[] v_caches, Tensor cu_seqlens_q, Tensor block_tables, Tensor context_lens, "
        "Tensor slot_mapping, int[] sizes, float eps, float scale, str linear_isa, str layer_isa, "
        "str attention_isa) -> Tensor",
        &llama_layers);
}
