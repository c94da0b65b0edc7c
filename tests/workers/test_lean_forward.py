"""The lean Llama forward (`kernels/llama_forward.py`): which models run it, that its tokens and
logprobs equal `generate()`'s on each of its paths (C++ ops on packed fused projections, C++ ops on
the model's own projections, transformers' functions), and that a broken op is caught."""

from __future__ import annotations

import copy

import pytest
import torch

import cbserve
from cbserve.kernels import cpu_kernels, llama_forward, packed_linear
from tests.support.exactness import assert_matches_reference, run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

LENGTHS = [1, 9, 40, 70]
MAX_NEW = 8
needs_kernels = pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason="no C++ CPU kernels here")


def config(**overrides) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=80, max_batch_tokens=96,
                                            return_logprobs=True, **overrides)


def run(model, cfg):
    prompts = random_prompts(LENGTHS)
    refs = [reference_generate(model, p, MAX_NEW) for p in prompts]
    seen = {}

    def setup(engine):
        seen["lean"] = engine.runner.forward.lean
        seen["fused"] = [n for n, _ in model.named_modules() if n.endswith((llama_forward.QKV, llama_forward.GATE_UP))]

    requests, _ = run_engine(model, prompts, cfg, MAX_NEW, setup)
    return requests, refs, seen


@pytest.mark.parametrize(("dtype", "pack", "tol"), [
    pytest.param(torch.float32, None, 1e-4, marks=needs_kernels, id="f32-cpp-fused"),
    pytest.param(torch.float32, False, 1e-4, marks=needs_kernels, id="f32-cpp-own-projections"),
    pytest.param(torch.float64, None, 1e-6, id="f64-transformers-functions"),
])
def test_lean_forward_equals_generate(dtype: torch.dtype, pack: bool | None, tol: float) -> None:
    model = tiny_model("llama", dtype=dtype)
    requests, refs, seen = run(model, config(prepack_weights=pack))
    assert seen["lean"] is not None and seen["lean"].cpp == (dtype == torch.float32)
    layers = model.config.num_hidden_layers
    assert len(seen["fused"]) == (2 * layers if dtype == torch.float32 and pack is None else 0)
    assert_matches_reference(requests, refs, tol=tol)
    assert not any(n.endswith(llama_forward.QKV) for n, _ in model.named_modules())  # given back


@needs_kernels
def test_float32_prompts_through_the_tiled_prefill_kernel_equal_generate(monkeypatch) -> None:
    """A head dimension the tiled prefill kernel takes (32): on a CPU with AVX-512 float32 prompt
    chunks go through it (by default, batch_invariant=None), and tokens and logprobs still equal
    `generate()`'s."""
    from cbserve.kernels import cpu_isa

    if not cpu_kernels.tiled_prefill_runs(torch.float32, 32, cpu_isa.selected()):
        pytest.skip(f"no float32 tiled prefill path on the {cpu_isa.selected()} path (it needs AVX-512)")
    calls = []
    original = cpu_kernels.tiled_prefill_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "tiled_prefill_attention", counted)
    requests, refs, _ = run(tiny_model("llama", dtype=torch.float32, head_dim=32), config())
    assert calls and max(calls) >= 40  # prompt chunks went through it
    assert_matches_reference(requests, refs, tol=1e-4)


@needs_kernels
@pytest.mark.parametrize("op", ["add_rms_norm_", "rope_", "silu_mul"])
def test_a_broken_op_is_caught(monkeypatch, op: str) -> None:
    owner = cpu_kernels
    if op == "silu_mul" and packed_linear.cpp_path(torch.float32) in packed_linear.EPILOGUE_PATHS:
        owner = packed_linear.PackedLinear  # silu(gate) * up runs in the gate/up GEMM's epilogue here
    original = getattr(owner, op)

    def broken(*args, **kwargs):
        out = original(*args, **kwargs)
        target = args[0] if op == "rope_" else out
        target.mul_(1.01)
        return out

    monkeypatch.setattr(owner, op, broken)
    requests, refs, _ = run(tiny_model("llama", dtype=torch.float32), config())
    with pytest.raises(AssertionError):
        assert_matches_reference(requests, refs, tol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gpt2"])
def test_other_models_keep_transformers_forward(arch: str) -> None:
    model = tiny_model(arch, dtype=torch.float32)
    assert llama_forward.unsupported_reason(model)
    assert llama_forward.fused_groups(model) == []


def test_compiled_hooked_or_switched_off_llamas_keep_transformers_forward(monkeypatch) -> None:
    model = copy.deepcopy(tiny_model("llama", dtype=torch.float32))  # the shared one stays without hooks
    assert llama_forward.unsupported_reason(model) == ""
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *args: None)
    assert "hooks" in llama_forward.unsupported_reason(model)
    handle.remove()
    with torch.no_grad():  # leaves transformers' output-capture hooks on the model: inactive, no obstacle
        model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules()) and llama_forward.unsupported_reason(model) == ""
    monkeypatch.setenv(llama_forward.ENV, "0")
    assert llama_forward.unsupported_reason(model) and llama_forward.fused_groups(model) == []
    monkeypatch.delenv(llama_forward.ENV)
    from cbserve.workers.compilation import CompiledForward

    compiled = CompiledForward(model, {"mode": "default", "dynamic": True}, None)
    try:
        assert compiled.lean is None
    finally:
        compiled.restore()
    plain = CompiledForward(model, None, None)
    assert plain.lean is not None
    plain.restore()
