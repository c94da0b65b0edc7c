"""Packed linear weights on a CPU (the C++ panel kernel, else oneDNN): same greedy tokens and
logprobs as `generate()`, the model's own modules back afterwards, and clear errors where
packing cannot be used."""

from __future__ import annotations

import pytest
import torch

import cbserve
from cbserve.kernels import packed_linear
from tests.test_exactness import assert_matches_reference, run_engine
from tests.tiny_models import random_prompts, reference_generate, tiny_model

LENGTHS = [1, 9, 40, 70, 130]
MAX_NEW = 8


def linears(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def config(**overrides) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=80, max_batch_tokens=96,
                                            return_logprobs=True, **overrides)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_packed_weights_equal_generate_and_are_given_back(arch: str) -> None:
    model = tiny_model(arch, dtype=torch.float32)
    prompts = random_prompts(LENGTHS)
    refs = [reference_generate(model, p, MAX_NEW) for p in prompts]
    before = linears(model)
    packed = []

    def setup(engine):
        packed.extend(m for m in model.modules() if isinstance(m, packed_linear.PackedLinear))

    requests, engine = run_engine(model, prompts, config(), MAX_NEW, setup)
    assert len(packed) == len(before) > 0  # every projection and lm_head ran packed
    assert_matches_reference(requests, refs, tol=1e-4)
    after = linears(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert not engine.packed_linears


def test_the_comparison_catches_a_wrong_packed_weight(monkeypatch) -> None:
    model = tiny_model("llama", dtype=torch.float32)
    prompts = random_prompts(LENGTHS)
    refs = [reference_generate(model, p, MAX_NEW) for p in prompts]
    forward = packed_linear.PackedLinear.forward
    monkeypatch.setattr(packed_linear.PackedLinear, "forward", lambda self, x: forward(self, x) * 1.01)
    requests, _ = run_engine(model, prompts, config(), MAX_NEW)
    with pytest.raises(AssertionError):
        assert_matches_reference(requests, refs, tol=1e-4)


KINDS = ["cbserve", "onednn"] if packed_linear.kernel() == "cbserve" else ["onednn"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_features,out_features,bias", [(48, 40, True), (33, 49, False), (576, 192, True),
                                                           (7, 3, True)])
def test_packed_linear_matches_f_linear(kind: str, in_features: int, out_features: int, bias: bool) -> None:
    """Row counts around the kernel's 6-row tiles, column counts around its 16-column panels."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = packed_linear.PackedLinear(linear, kind)
    inputs = [torch.randn(rows, in_features, generator=gen) for rows in (*range(1, 14), 64, 131)]
    inputs += [torch.randn(1, 7, in_features, generator=gen), torch.randn(in_features, 3, generator=gen).t(),
               torch.randn(0, in_features)]
    for x in inputs:
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5, msg=f"{tuple(x.shape)}")


def test_the_kernel_falls_back_to_onednn_without_the_cpp_kernels(monkeypatch) -> None:
    from cbserve.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no C++ compiler")
    packed_linear.kernel.cache_clear()
    try:
        assert packed_linear.kernel() == "onednn"
        assert packed_linear.PackedLinear(torch.nn.Linear(8, 4)).kind == "onednn"
    finally:
        packed_linear.kernel.cache_clear()


def test_hooked_and_subclassed_linears_are_not_packed() -> None:
    """Tensor parallelism's all-reduce is a forward hook on o_proj/down_proj: a replacement would
    skip it."""
    model = tiny_model("llama", dtype=torch.float32)
    layer = model.model.layers[0]
    calls = []
    layer.self_attn.o_proj.register_forward_hook(lambda *a: calls.append(1))
    swapped = packed_linear.pack_linears(model)
    try:
        assert type(layer.self_attn.o_proj) is torch.nn.Linear
        assert isinstance(layer.self_attn.q_proj, packed_linear.PackedLinear)
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]))
        assert calls == [1]
    finally:
        packed_linear.unpack_linears(swapped)
    assert type(layer.self_attn.q_proj) is torch.nn.Linear


def test_where_packing_cannot_be_used() -> None:
    model64 = tiny_model("llama")  # float64: oneDNN has no float64 GEMM
    with pytest.raises(ValueError, match="prepack_weights=True cannot be used here: packing supports"):
        run_engine(model64, [[1, 2, 3]], config(prepack_weights=True), 2)
    _, engine = run_engine(model64, [[1, 2, 3]], config(), 2)  # auto: off, and it still works
    assert engine.packed_linears == [] and not any(
        isinstance(m, packed_linear.PackedLinear) for m in model64.modules())
    model32 = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="torch.compile does not trace"):
        run_engine(model32, [[1, 2, 3]], config(prepack_weights=True, default_compile_level=1), 2)
    # Refused before the engine touched the model.
    assert model32.config._attn_implementation != "cbserve_paged"
    assert linears(model32) and not any(isinstance(m, packed_linear.PackedLinear) for m in model32.modules())
    assert "meta" in packed_linear.unavailable_reason(torch.device("meta"), torch.float32)
