"""Packed linear weights on a CPU (the C++ panel kernel, else oneDNN): same greedy tokens and
logprobs as `generate()`, the model's own modules back afterwards, and clear errors where
packing cannot be used."""

from __future__ import annotations

import os

import pytest
import torch

import cbserve
from cbserve.kernels import cpu_isa, llama_forward, packed_linear
from tests.support.exactness import assert_matches_reference, run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

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
        packed.extend((name, m) for name, m in model.named_modules() if isinstance(m, packed_linear.PackedLinear))

    requests, engine = run_engine(model, prompts, config(), MAX_NEW, setup)
    # Every projection and lm_head ran packed: a fused group (the lean Llama forward's q/k/v and
    # gate/up) packs its parts' weights side by side.
    covered = sum(len(llama_forward.FUSED.get(name.rsplit(".", 1)[-1], ("",))) for name, _ in packed)
    assert covered == len(before) > 0
    assert sum(m.out_features for _, m in packed) == sum(m.out_features for m in before.values())
    assert any(name.endswith(llama_forward.QKV) for name, _ in packed) == (arch == "llama")
    # The lean forward's gate/up: silu(gate) * up in the GEMM's epilogue where the path has one.
    gate_ups = [m for name, m in packed if name.endswith(llama_forward.GATE_UP)]
    assert all(m.silu_epilogue == (m.isa in packed_linear.EPILOGUE_PATHS) for m in gate_ups)
    assert_matches_reference(requests, refs, tol=1e-4)
    after = linears(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert not any(hasattr(m, llama_forward.QKV) or hasattr(m, llama_forward.GATE_UP) for m in model.modules())
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


# The C++ kernel's paths: (instruction set, dtype). Each runs where the CPU has it, else is skipped.
CPP_PATHS = [("avx2", torch.float32), ("avx512", torch.float32), ("avx512_bf16", torch.bfloat16)]
SHAPES = [(48, 40, True), (33, 49, False), (576, 192, True), (7, 3, True), (1, 1, False), (0, 5, True),
          (229, 40, False), (385, 33, True)]  # K over several of the kernel's chunks, odd and on their edge


def skip_unless_runs(isa: str) -> None:
    from cbserve.kernels import cpu_isa, cpu_kernels

    reason = cpu_kernels.unavailable_reason() or cpu_isa.why_not(isa)
    if reason:
        pytest.skip(f"the {isa} path cannot run on this machine: {reason}")


def check_against_float64(packed, linear: torch.nn.Linear, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Row counts around the kernels' 6- and 12-row tiles and column counts around their 16- and
    32-column panels, against F.linear in float64 on the same (rounded) numbers; and every row of
    a batch bitwise equal to that row alone (batch invariance)."""
    k = linear.in_features
    weight = linear.weight.double()
    bias = None if linear.bias is None else linear.bias.double()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 4e-3, "atol": 4e-3}
    inputs = [torch.randn(rows, k, generator=gen).to(dtype) for rows in (*range(1, 26), 64, 131)]
    inputs += [torch.randn(1, 7, k, generator=gen).to(dtype), torch.randn(k, 3, generator=gen).to(dtype).t(),
               torch.randn(0, k).to(dtype)]
    with torch.inference_mode():
        for x in inputs:
            y = packed(x)
            assert y.dtype == dtype and y.shape == (*x.shape[:-1], linear.out_features)
            want = torch.nn.functional.linear(x.double(), weight, bias)
            torch.testing.assert_close(y.double(), want, **tol, msg=lambda m, x=x: f"{tuple(x.shape)}: {m}")
            if k == 0:  # empty sums: the bias, checked above
                continue
            rows = x.reshape(-1, k)
            for r in {0, len(rows) // 2, len(rows) - 1} if len(rows) else ():
                assert torch.equal(packed(rows[r : r + 1]), y.reshape(-1, linear.out_features)[r : r + 1])


@pytest.mark.parametrize("isa,dtype", CPP_PATHS, ids=[p[0] for p in CPP_PATHS])
@pytest.mark.parametrize("in_features,out_features,bias", SHAPES)
def test_cpp_linear_paths_match_float64(isa: str, dtype, in_features: int, out_features: int, bias: bool) -> None:
    skip_unless_runs(isa)
    gen = torch.Generator().manual_seed(in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    packed = packed_linear.PackedLinear(linear, isa=isa)
    assert packed.kind == "cbserve" and packed.isa == isa
    check_against_float64(packed, linear, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features,bias", SHAPES[:3])
def test_onednn_packing_matches_float64(dtype, in_features: int, out_features: int, bias: bool) -> None:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 support on this CPU")
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    packed = packed_linear.PackedLinear(linear, "onednn")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, in_features, generator=gen).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).double(), torch.nn.functional.linear(
            x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double()), **tol)


def test_the_environment_picks_the_path(monkeypatch) -> None:
    from cbserve.kernels import cpu_isa

    skip_unless_runs("avx2")
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert packed_linear.PackedLinear(torch.nn.Linear(8, 4)).isa == "avx2"
    assert packed_linear.kernel(torch.bfloat16) == "onednn"  # no bfloat16 path on AVX2
    monkeypatch.setenv(cpu_isa.ISA_ENV, "generic")
    assert packed_linear.kernel(torch.float32) == "onednn"
    assert "batch-invariant mode needs the C++ linear kernel" in packed_linear.unavailable_reason(
        torch.device("cpu"), torch.float32, batch_invariant=True)


def test_the_kernel_falls_back_to_onednn_without_the_cpp_kernels(monkeypatch) -> None:
    from cbserve.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no C++ compiler")
    packed_linear._kernel.cache_clear()
    try:
        assert packed_linear.kernel() == "onednn"
        assert packed_linear.PackedLinear(torch.nn.Linear(8, 4)).kind == "onednn"
        assert "no C++ compiler" in packed_linear.unavailable_reason(torch.device("cpu"), torch.float32, True)
    finally:
        packed_linear._kernel.cache_clear()


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


def test_bfloat16_calls_of_many_rows_go_to_onednn_on_amx(monkeypatch) -> None:
    """With AMX, a bfloat16 call of `AMX_ONEDNN_FROM_ROWS` rows or more runs oneDNN's (AMX) kernel, a
    smaller one ours: each gives bitwise what that kernel alone gives. Forced by faking the AMX flag
    where oneDNN has bfloat16, so the split is tested on every such CPU."""
    from cbserve.kernels import cpu_isa

    if packed_linear.cpp_path(torch.bfloat16) is None:
        pytest.skip(f"no bfloat16 path of the C++ kernel here ({cpu_isa.why_not('avx512_bf16')})")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 on this CPU")
    monkeypatch.setattr(cpu_isa, "has_amx_bf16", lambda: True)
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=True).to(torch.bfloat16)
    split = packed_linear.PackedLinear(linear)
    ours, onednn = packed_linear.PackedLinear(linear, "cbserve"), packed_linear.PackedLinear(linear, "onednn")
    assert split.onednn_from == packed_linear.AMX_ONEDNN_FROM_ROWS and "oneDNN from" in split.extra_repr()
    with torch.inference_mode():
        for rows in (1, packed_linear.AMX_ONEDNN_FROM_ROWS - 1, packed_linear.AMX_ONEDNN_FROM_ROWS, 37):
            x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
            expected = (onednn if rows >= packed_linear.AMX_ONEDNN_FROM_ROWS else ours)(x)
            assert torch.equal(split(x), expected), rows
    # A gate/up projection with the silu epilogue: its few-row calls take it, oneDNN's calls give the
    # projection in the weight's column order, then silu_mul.
    from cbserve.kernels import cpu_kernels

    gate_up = torch.nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    split = packed_linear.PackedLinear(gate_up, silu_epilogue=True)
    ours, onednn = packed_linear.PackedLinear(gate_up, "cbserve"), packed_linear.PackedLinear(gate_up, "onednn")
    assert split.silu_epilogue and split.onednn_from == packed_linear.AMX_ONEDNN_FROM_ROWS
    with torch.inference_mode():
        for rows in (1, packed_linear.AMX_ONEDNN_FROM_ROWS, 37):
            x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
            expected = (onednn if rows >= packed_linear.AMX_ONEDNN_FROM_ROWS else ours)(x)
            assert torch.equal(split(x), expected), rows
            assert torch.equal(split.silu_mul(x), cpu_kernels.silu_mul(expected)), rows
    monkeypatch.setattr(cpu_isa, "has_amx_bf16", lambda: False)
    assert packed_linear.PackedLinear(linear).onednn_from is None
    assert packed_linear.PackedLinear(linear.float()).onednn_from is None  # float32: ours at every row count


def test_amx_is_read_from_the_cpu_flags(monkeypatch) -> None:
    from cbserve.kernels import cpu_isa

    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "amx_tile", "amx_bf16"}))
    assert cpu_isa.has_amx_bf16()
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert not cpu_isa.has_amx_bf16()


@pytest.mark.parametrize("isa,dtype", CPP_PATHS, ids=[p[0] for p in CPP_PATHS])
def test_cpp_linear_results_do_not_depend_on_the_thread_count(isa: str, dtype) -> None:
    """Threads take the next (row block, panel) task as they free up (`csrc/task_queue.h`): which
    thread ran a task must not show in the result."""
    skip_unless_runs(isa)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: no second thread to split the tasks with")
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(576, 1000, bias=True).to(dtype)
    packed = packed_linear.PackedLinear(linear, isa=isa)
    inputs = [torch.randn(rows, 576, generator=gen).to(dtype) for rows in (1, 13, 131, 1200)]
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            alone = [packed(x) for x in inputs]
            torch.set_num_threads(2)
            for x, want in zip(inputs, alone, strict=True):
                assert torch.equal(packed(x), want), tuple(x.shape)
    finally:
        torch.set_num_threads(threads)


EPILOGUE_PATHS = [p for p in CPP_PATHS if p[0] in packed_linear.EPILOGUE_PATHS]


@pytest.mark.parametrize("isa,dtype", EPILOGUE_PATHS, ids=[p[0] for p in EPILOGUE_PATHS])
@pytest.mark.parametrize("in_features,intermediate", [(48, 16), (576, 1536), (33, 80)])
def test_gate_up_silu_epilogue_equals_the_projection_then_silu_mul(isa: str, dtype, in_features: int,
                                                                    intermediate: int) -> None:
    """The gate/up GEMM with silu(gate) * up in its epilogue: bit for bit what the projection then
    `silu_mul` give, at every row count (row tiles of 12, row blocks of several tasks); its plain
    forward keeps the weight's column order."""
    from cbserve.kernels import cpu_kernels

    skip_unless_runs(isa)
    gen = torch.Generator().manual_seed(intermediate)
    linear = torch.nn.Linear(in_features, 2 * intermediate, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.mul_(4)  # gate values far enough out for silu's both tails
    fused = packed_linear.PackedLinear(linear, isa=isa, silu_epilogue=True)
    plain = packed_linear.PackedLinear(linear, isa=isa)
    assert fused.silu_epilogue and not plain.silu_epilogue
    assert "silu(gate) * up in the epilogue" in repr(fused)
    with torch.inference_mode():
        for rows in (*range(1, 26), 64, 131, 1200):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            gate_up = plain(x)
            assert torch.equal(fused(x), gate_up), rows
            assert torch.equal(fused.silu_mul(x), cpu_kernels.silu_mul(gate_up)), rows
        x = torch.randn(2, 3, in_features, generator=gen).to(dtype)
        assert torch.equal(fused.silu_mul(x), cpu_kernels.silu_mul(plain(x)))
        assert fused.silu_mul(torch.randn(0, in_features).to(dtype)).shape == (0, intermediate)


def test_the_silu_epilogue_is_only_taken_where_it_applies() -> None:
    """A bias, a width the 16-column halves do not divide, or a path without 32-column panels
    (AVX2) keep the projection and `silu_mul` apart, with the same results."""
    from cbserve.kernels import cpu_kernels

    skip_unless_runs("avx2")
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.nn.Linear(40, 64, bias=True), "avx2"), (torch.nn.Linear(40, 64, bias=False), "avx2")]
    if not (cpu_kernels.unavailable_reason() or cpu_isa.why_not("avx512")):
        cases += [(torch.nn.Linear(40, 64, bias=True), "avx512"), (torch.nn.Linear(40, 48, bias=False), "avx512")]
    for linear, isa in cases:
        fused = packed_linear.PackedLinear(linear, isa=isa, silu_epilogue=True)
        assert not fused.silu_epilogue, (linear, isa)
        x = torch.randn(5, 40, generator=gen)
        with torch.inference_mode():
            assert torch.equal(fused.silu_mul(x), cpu_kernels.silu_mul(fused(x)))
    with pytest.raises(RuntimeError, match="avx512 and avx512_bf16 paths"):
        plain = packed_linear.PackedLinear(torch.nn.Linear(40, 64, bias=False), isa="avx2")
        torch.ops.cbserve_cpu.packed_gate_up_silu(torch.randn(2, 40), plain.packed, 32, "avx2")
