"""A lean forward pass of a Llama model inside the engine's eager CPU steps, on the model's own weights.

transformers' eager Llama layer is ~12 module calls and ~60 ATen ops per token batch: at the row
counts of decode steps on a CPU each costs more in dispatch than in arithmetic. This one does per layer:

- the residual add + RMSNorm, the rotary embedding (in place on the QKV rows) and silu(gate) * up as
  one C++ op each (`csrc/layer_ops_cpu.cpp`, float32 / bfloat16), rounding where transformers does;
- q/k/v and gate/up as one GEMM each when `packed_linear.pack_linears` packed them fused (attributes
  `cb_qkv_proj` / `cb_gate_up_proj` of the attention / MLP module), else the model's own projections;
  gate/up with silu(gate) * up in the GEMM's epilogue where the C++ kernel has one (AVX-512 paths);
- attention through the engine's paged attention function, called as transformers calls it.

A decode step on the C++ kernels (packed projections, the ``cpu`` attention backend) runs all of
that as one call, `llama_layers` (`csrc/decoder_layers_cpu.cpp`): the same kernels in the same order,
so the same numbers, without ~17 Python calls a layer (a decode step ~1 ms shorter) and without the
GIL between them. Prompt steps keep the loop: run as one call too they were no faster offline, and
served at 32 clients slower in the one round measured (README, Benchmarks, session 23).

Other dtypes (float64 in the exactness tests) or a CPU without the C++ kernels: the same steps with
transformers' own norm, rotary and activation functions. Only plain `LlamaForCausalLM`s on a CPU
(exact module types, SiLU, no hooks but transformers' inactive output-capture ones: tensor
parallelism's all-reduce hooks keep their forward);
anything else keeps transformers' forward. `$CBSERVE_LEAN_FORWARD=0` turns it off and
`$CBSERVE_LAYERS_ONE_CALL=0` the one call (A/B benchmarks).
"""

from __future__ import annotations

import os

import torch

from cbserve.kernels import cpu_isa, cpu_kernels, paged_attention

ENV = "CBSERVE_LEAN_FORWARD"
ONE_CALL_ENV = "CBSERVE_LAYERS_ONE_CALL"  # 0: decode steps run the per-op loop too (A/B benchmarks)
# The attention kernels the one call runs itself: a backend holding anything else keeps the loop.
ONE_CALL_ATTENTION = (cpu_kernels.paged_decode_attention, cpu_kernels.store_kv)
QKV, GATE_UP = "cb_qkv_proj", "cb_gate_up_proj"
FUSED = {QKV: ("q_proj", "k_proj", "v_proj"), GATE_UP: ("gate_proj", "up_proj")}
CAPTURE_HOOKS_MODULE = "transformers.utils.output_capturing"


def unsupported_reason(model: torch.nn.Module) -> str:
    """'' when `model` runs the lean forward, else why not."""
    from transformers.models.llama import modeling_llama as llama

    if os.environ.get(ENV, "1").strip() == "0":
        return f"${ENV}=0"
    if type(model) is not llama.LlamaForCausalLM or type(model.model) is not llama.LlamaModel:
        return f"{type(model).__name__} is not a LlamaForCausalLM"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on a CPU"
    if model.config.hidden_act != "silu" or getattr(model.config, "pretraining_tp", 1) != 1:
        return "the model's MLP is not SiLU-gated"
    expected = (llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm)
    for layer in model.model.layers:
        if (type(layer), type(layer.self_attn), type(layer.mlp), type(layer.input_layernorm)) != expected:
            return "a decoder layer is not transformers' Llama layer"
    if any(_foreign_hooks(m) for m in model.modules()):
        return "a module of the model has forward hooks"
    return ""


def _foreign_hooks(module: torch.nn.Module) -> bool:
    """Forward hooks other than transformers' output capture, which a model keeps once it has been
    run with `output_hidden_states` / `output_attentions` and which record nothing outside such a
    call (the lean forward makes none)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return any(getattr(h, "__module__", None) != CAPTURE_HOOKS_MODULE for h in hooks)


def fused_groups(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, tuple[str, ...]]]:
    """(module, fused attribute, projections) for every q/k/v and gate/up group the lean forward can
    run as one GEMM; empty when the model does not run the lean forward."""
    if unsupported_reason(model):
        return []
    groups = []
    for layer in model.model.layers:
        for module, name in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
            parts = [getattr(module, p) for p in FUSED[name]]
            if all(type(p) is torch.nn.Linear for p in parts) and len({p.in_features for p in parts}) == 1 \
                    and len({p.bias is None for p in parts}) == 1:
                groups.append((module, name, FUSED[name]))
    return groups


def _packed_cpp(module: torch.nn.Module | None, rows: int) -> bool:
    """`module` is a `packed_linear.PackedLinear` (not imported: it imports this module) running
    `rows` rows through the C++ linear kernel, without a bias."""
    runs = getattr(module, "cpp_runs_rows", None)
    return runs is not None and module.bias is None and runs(rows)


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's forward without `nn.Module.__call__` (no hooks: `unsupported_reason`)."""
    if type(module) is torch.nn.Linear:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return module.forward(x)


class LlamaForward:
    """Called with the runner's forward kwargs; returns the logits of the `logits_to_keep` rows,
    ``[1, rows, vocab]``, like the model's forward, and the final (normed) hidden states of
    `pooled_rows` (embeddings; None when not asked)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        dtype = next(model.parameters()).dtype
        self.cpp = dtype in (torch.float32, torch.bfloat16) and not cpu_kernels.unavailable_reason()
        # The fused ops' path, read once (not from the environment at each of a step's ~90 calls).
        self.isa = cpu_kernels.layer_ops_isa() if self.cpp else None
        self.one_call = self.cpp and os.environ.get(ONE_CALL_ENV, "1").strip() != "0"

    def __call__(self, kwargs: dict, pooled_rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        inner, meta = self.model.model, kwargs["cb_meta"]
        residual = inner.embed_tokens(kwargs["input_ids"])  # [1, T, hidden]; a new tensor: added to in place
        cos, sin = inner.rotary_emb(residual, kwargs["position_ids"])  # [1, T, head_dim]
        rotary = (cos[0].contiguous(), sin[0].contiguous()) if self.cpp else (cos, sin)
        one_call = self.one_call_args(meta, residual.shape[1]) if self.one_call else None
        if one_call is not None:
            out = torch.ops.cbserve_cpu.llama_layers(residual, *rotary, *one_call)
        else:
            out = None
            for layer in inner.layers:
                x, residual = self.norm(layer.input_layernorm, out, residual)
                out = self.attention(layer.self_attn, x, rotary, meta)
                x, residual = self.norm(layer.post_attention_layernorm, out, residual)
                out = self.mlp(layer.mlp, x)
        x, _ = self.norm(inner.norm, out, residual)
        hidden = None if pooled_rows is None else x[0, pooled_rows]
        return linear(self.model.lm_head, x[:, kwargs["logits_to_keep"]]), hidden

    def one_call_args(self, meta, rows: int) -> tuple | None:
        """The arguments after the residual and rotary tables of `llama_layers`
        (`csrc/decoder_layers_cpu.cpp`: this loop's kernels in one call) for a decode-only step on the C++
        attention kernels whose every layer this loop would run through the C++ kernels; else None.
        Read at each step: the projections are swapped when the model is given back and taken again."""
        ki = meta.kernel_inputs
        if (ki is None or not ki.decode_only or meta.slot_mapping.numel() != rows
                or (ki.kernels.decode, ki.kernels.store_kv) != ONE_CALL_ATTENTION):
            return None
        norms, packed, eps, isas, scales, epilogues = [], [], set(), set(), set(), set()
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn._modules.get(QKV), attn.o_proj, mlp._modules.get(GATE_UP), mlp.down_proj)
            if not all(_packed_cpp(p, rows) for p in linears):
                return None
            packed += [p.packed for p in linears]
            epilogues.add(linears[2].silu_epilogue)
            isas.update(p.isa for p in linears)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norms.append(norm.weight)
                eps.add(norm.variance_epsilon)
            scales.add(attn.scaling)
        if len(eps) != 1 or len(isas) != 1 or len(scales) != 1 or len(epilogues) != 1:
            return None
        config = self.model.config
        sizes = [self.heads, self.kv_heads, self.head_dim, config.hidden_size, config.intermediate_size,
                 int(epilogues.pop())]
        return (norms, packed, meta.k_caches, meta.v_caches, ki.cu_seqlens_q, ki.block_tables, ki.context_lens,
                meta.slot_mapping, sizes, float(eps.pop()), float(scales.pop()), isas.pop(), self.isa,
                cpu_isa.selected())

    def norm(self, norm: torch.nn.Module, x: torch.Tensor | None, residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None: norm(residual)."""
        if self.cpp:
            return cpu_kernels.add_rms_norm_(x, residual, norm.weight, norm.variance_epsilon, self.isa), residual
        residual = residual if x is None else residual + x
        return norm(residual), residual

    def attention(self, attn: torch.nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                  meta) -> torch.Tensor:
        t, nh, nkv, d = x.shape[1], self.heads, self.kv_heads, self.head_dim
        fused = attn._modules.get(QKV)
        if fused is not None:
            qkv = linear(fused, x)[0]  # [T, (nh + 2 nkv) d]
            q, k, v = qkv[:, : nh * d], qkv[:, nh * d : (nh + nkv) * d], qkv[:, (nh + nkv) * d :]
        else:
            q, k, v = (linear(attn.q_proj, x)[0], linear(attn.k_proj, x)[0], linear(attn.v_proj, x)[0])
        if self.cpp:
            if fused is not None:
                cpu_kernels.rope_(qkv, *rotary, nh + nkv, d, self.isa)
            else:
                cpu_kernels.rope_(q, *rotary, nh, d, self.isa)
                cpu_kernels.rope_(k, *rotary, nkv, d, self.isa)
            q4, k4 = q.view(1, t, nh, d).transpose(1, 2), k.view(1, t, nkv, d).transpose(1, 2)
        else:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            q4, k4 = apply_rotary_pos_emb(q.view(1, t, nh, d).transpose(1, 2), k.view(1, t, nkv, d).transpose(1, 2),
                                          *rotary)
        v4 = v.view(1, t, nkv, d).transpose(1, 2)
        o, _ = paged_attention.paged_attention_forward(attn, q4, k4, v4, None, scaling=attn.scaling, cb_meta=meta)
        return linear(attn.o_proj, o.reshape(1, t, -1))

    def mlp(self, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        fused = mlp._modules.get(GATE_UP)
        if fused is not None:
            if self.cpp and getattr(fused, "silu_epilogue", False):
                return linear(mlp.down_proj, fused.silu_mul(x))
            gate_up = linear(fused, x)
            if self.cpp:
                h = cpu_kernels.silu_mul(gate_up, self.isa)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = mlp.act_fn(gate) * up
        else:
            h = mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x)
        return linear(mlp.down_proj, h)
