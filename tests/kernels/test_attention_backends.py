"""The engine on each attention backend, the decode fast path and decode CUDA graphs' buffer logic.

Kernel backends read the pages through block tables instead of gathering rows; on this CPU the
Triton kernels run under Triton's interpreter (slow: small cases only), and CUDA graphs are
replaced by a stand-in that re-runs the captured function on the same static buffers.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from transformers import GenerationConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_attention defines its kernels

import cbserve
from cbserve.kernels import attention_backends, cpu_kernels
from cbserve.kernels import triton_attention as tri
from cbserve.kernels.paged_attention import AttentionMetadata, KernelInputs
from cbserve.workers import cuda_graphs
from cbserve.workers.block_table import BlockTables
from cbserve.workers.factory import build_engine
from tests.support.exactness import assert_matches_reference, run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

if tri.TRITON_AVAILABLE and not tri._INTERPRETED and not torch.cuda.is_available():
    tri = importlib.reload(tri)  # imported earlier without TRITON_INTERPRET: redefine the kernels

LENGTHS = [1, 9, 40, 70]
MAX_NEW = 6


def reference(model, prompts, max_new=MAX_NEW):
    return [reference_generate(model, p, max_new) for p in prompts]


def run(model, prompts, max_new=MAX_NEW, graphs=None, **config):
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=120, max_batch_tokens=64,
                                           return_logprobs=True, **config)

    def setup(engine):
        if graphs is not None:
            engine.runner.graphs = graphs(engine)

    return run_engine(model, prompts, cfg, max_new, setup)


def assert_same(requests, refs, tol=1e-6):
    assert_matches_reference(requests, refs, tol)


# -- selection ---------------------------------------------------------------------------------


def test_auto_on_cpu_is_the_cpp_kernel_else_sdpa_and_explicit_choices_say_why_they_cannot_run(
    monkeypatch, caplog
) -> None:
    cpu = torch.device("cpu")
    assert attention_backends.select("auto", cpu, 16, True) == "cpu"  # CI machines have a C++ compiler
    with pytest.raises(ValueError, match="runs on CPUs, the model is on cuda"):
        attention_backends.select("cpu", torch.device("cuda"), 16, True)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no C++ compiler ('c++' is not on PATH)")
    with caplog.at_level("WARNING", logger="cbserve.kernels.attention_backends"):
        assert attention_backends.select("auto", cpu, 16, True) == "sdpa"
    assert "no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here: no C\\+\\+ compiler"):
        attention_backends.select("cpu", cpu, 16, True)
    with pytest.raises(ValueError, match="flash-attn runs only on CUDA"):
        attention_backends.select("flash", cpu, 256, True)
    monkeypatch.setattr(tri, "_INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention_backends.select("triton", cpu, 16, True)
    monkeypatch.setenv("CBSERVE_ATTENTION_BACKEND", "reference")
    assert attention_backends.select("auto", cpu, 16, True) == "reference"
    monkeypatch.setenv("CBSERVE_ATTENTION_BACKEND", "fast")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        attention_backends.select("auto", cpu, 16, True)
    with pytest.raises(ValueError, match="attention_backend"):
        cbserve.ContinuousBatchingConfig(attention_backend="fast")


def test_auto_on_cuda_prefers_flash_then_triton(monkeypatch) -> None:
    """The decision logic, with the device checks stubbed (no GPU here)."""
    from cbserve.kernels import flash_attn_adapter as fa

    cuda = torch.device("cuda")
    monkeypatch.setattr(attention_backends, "_triton_problem", lambda device: "")
    monkeypatch.setattr(attention_backends, "_flash_version", lambda: "test")
    monkeypatch.setattr(fa, "flash_unavailable_reason", lambda: "")
    assert attention_backends.select("auto", cuda, 256, True) == "flash"
    assert attention_backends.select("auto", cuda, 16, True) == "triton"  # flash needs pages of 256
    assert attention_backends.select("auto", cuda, 256, False) == "triton"  # auto_switch_to_flash off
    with pytest.raises(ValueError, match="multiple of 256"):
        attention_backends.select("flash", cuda, 16, True)
    monkeypatch.setattr(fa, "flash_unavailable_reason", lambda: "flash_attn is not importable")
    monkeypatch.setattr(attention_backends, "_triton_problem", lambda device: "triton is not importable")
    assert attention_backends.select("auto", cuda, 256, True) == "sdpa"


# -- exactness per backend ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("fast_path", [0, 8])
def test_reference_backend_equals_generate(arch: str, fast_path: int) -> None:
    model = tiny_model(arch)
    prompts = random_prompts(LENGTHS)
    requests, engine = run(model, prompts, attention_backend="reference", max_blocks_per_request=fast_path)
    assert engine.attention_backend == "reference"
    assert_same(requests, reference(model, prompts))


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen3", {}), ("gpt2", {}),
                                            ("mistral", {"sliding_window": 8}), ("gemma2", {"sliding_window": 8})])
def test_cpu_backends_equal_generate(backend: str, arch: str, overrides: dict, monkeypatch) -> None:
    """The CPU backends: decode rows through the C++ kernel (cpu) or gathered SDPA (sdpa)."""
    calls = []
    kernel = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a: calls.append(a[3].shape) or kernel(*a))
    model = tiny_model(arch, **overrides)
    prompts = random_prompts([3, 30, 50] if overrides else LENGTHS)
    requests, engine = run(model, prompts, attention_backend=backend)
    assert engine.attention_backend == backend
    assert_same(requests, reference(model, prompts))
    assert bool(calls) == (backend == "cpu")


def test_cpu_backend_test_catches_a_wrong_kernel(monkeypatch) -> None:
    kernel = cpu_kernels.paged_decode_attention

    def wrong_scale(q, k_cache, v_cache, block_tables, context_lens, scale, *args):
        return kernel(q, k_cache, v_cache, block_tables, context_lens, scale * 0.9, *args)

    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", wrong_scale)
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS)
    requests, _ = run(model, prompts, attention_backend="cpu")
    with pytest.raises(AssertionError):
        assert_same(requests, reference(model, prompts))


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_reference_backend_with_sliding_windows_and_softcap(arch: str) -> None:
    model = tiny_model(arch, sliding_window=8)
    prompts = random_prompts([3, 30, 50])
    requests, engine = run(model, prompts, attention_backend="reference")
    assert engine.runner.max_blocks_per_request == 0  # the fast path is off for sliding windows
    assert_same(requests, reference(model, prompts))


@pytest.mark.skipif(not tri.TRITON_AVAILABLE, reason="triton is not importable")
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gemma2", torch.float64)])
def test_triton_backend_equals_generate(arch: str, dtype: torch.dtype) -> None:
    overrides = {"sliding_window": 8} if arch == "gemma2" else {}
    device = "cpu" if tri._INTERPRETED else "cuda"  # compiled Triton kernels run on a GPU only
    model = tiny_model(arch, dtype=dtype, **overrides).to(device)
    prompts = random_prompts([1, 20, 37])
    requests, engine = run(model, prompts, max_new=4, attention_backend="triton")
    assert engine.attention_backend == "triton"
    assert_same(requests, reference(model, prompts, 4), tol=1e-4 if dtype == torch.float32 else 1e-6)


def test_kernels_are_called_with_the_fast_path_table(monkeypatch) -> None:
    """Decode-only steps go to the decode kernel with a table exactly max_blocks_per_request wide;
    mixed steps go to the varlen kernel. And a kernel that forgets the cached prefix is caught."""
    from cbserve.kernels import reference as ref

    calls: list[tuple[str, int]] = []

    def decode(q, k_cache, v_cache, block_tables, *args):
        calls.append(("decode", block_tables.shape[1]))
        return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, *args)

    def varlen(q, k_cache, v_cache, cu, block_tables, context_lens, *args, max_seqlen_q, max_seqlen_k):
        calls.append(("varlen", block_tables.shape[1]))
        # Host ints given to flash-attn so that it need not synchronise to find them.
        assert max_seqlen_q == int((cu[1:] - cu[:-1]).max()) and max_seqlen_k == int(context_lens.max())
        return ref.varlen_paged_attention(q, k_cache, v_cache, cu, block_tables, context_lens, *args)

    monkeypatch.setattr(attention_backends, "kernels", lambda name, batch_invariant=None, dtype=None: attention_backends.KernelBackend(
        name, ref.store_kv, decode, varlen, varlen_takes_max_seqlen=True))
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS)
    requests, _ = run(model, prompts, attention_backend="reference", max_blocks_per_request=7)
    assert_same(requests, reference(model, prompts))
    assert {c for c in calls if c[0] == "decode"} == {("decode", 7)}
    assert any(c[0] == "varlen" for c in calls)

    def forgetful(q, k_cache, v_cache, block_tables, context_lens, *args):
        return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.ones_like(context_lens), *args)

    monkeypatch.setattr(attention_backends, "kernels", lambda name, batch_invariant=None, dtype=None: attention_backends.KernelBackend(
        name, ref.store_kv, forgetful, varlen, varlen_takes_max_seqlen=True))
    requests, _ = run(model, prompts, attention_backend="reference", max_blocks_per_request=7)
    with pytest.raises(AssertionError):
        assert_same(requests, reference(model, prompts))


# -- block tables ------------------------------------------------------------------------------


def test_block_table_rows_grow_by_appends_and_rebuild_when_pages_are_replaced() -> None:
    from cbserve.scheduler.request import Request

    tables = BlockTables(min_width=2)
    req = Request("r", [1, 2, 3], 4, frozenset())
    req.block_ids = [5, 9]
    first = tables.row(req, 2)
    assert first.tolist() == [5, 9]
    req.block_ids.extend([4, 7, 1])  # appends: the row's storage grows, old entries are kept
    assert tables.table([req], 6).tolist() == [[5, 9, 4, 7, 1, 0]]
    req.block_ids = [3]  # freed and reallocated (preemption): a new list rebuilds the row
    assert tables.row(req, 2).tolist() == [3, 0]


# -- CUDA graphs (buffer and padding logic, on the CPU) ----------------------------------------


def step_graphs(captured: list, *, decode: bool, varlen: bool, q: int = 0, kv: int = 0, max_requests: int = 8):
    """Builds StepGraphs for an engine with the eager stand-in; `captured` gets each new shape."""
    def make(engine):
        def factory(fn):
            captured.append(1)
            return cuda_graphs.eager_graph_factory(fn)

        return cuda_graphs.StepGraphs(
            engine.runner.forward, max_requests=max_requests, max_tokens=engine.max_batch_tokens,
            decode_width=engine.runner.max_blocks_per_request, page_size=engine.cache.page_size,
            q_padding_interval=q, kv_padding_interval=kv, decode=decode, varlen=varlen, device=engine.device,
            graph_factory=factory)

    return make


@pytest.mark.parametrize("interval", [0, 3])
def test_decode_graphs_replay_static_buffers_exactly(interval: int) -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts([2, 5, 17, 33, 40])
    captured: list[int] = []
    requests, engine = run(model, prompts, max_new=10, attention_backend="reference", max_blocks_per_request=4,
                           graphs=step_graphs(captured, decode=True, varlen=False, q=interval))
    assert_same(requests, reference(model, prompts, 10))
    shapes = set(engine.runner.graphs._graphs)
    assert shapes, "no decode step went through the graphs"
    assert all(s.decode and s.tokens == s.requests and s.width == 4 for s in shapes)
    allowed = {3, 6, 8} if interval else {1, 2, 4, 8}  # buckets, capped at 8 requests
    assert {s.requests for s in shapes} <= allowed
    assert len(captured) == len(shapes)  # each bucket captured once, then replayed
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.parametrize("arch,q,kv", [("qwen3", 0, 0), ("llama", 24, 40), ("gpt2", 0, 100)])
def test_varlen_graphs_of_padded_shapes_equal_generate(arch: str, q: int, kv: int) -> None:
    """Prefill and mixed steps replay padded shapes: padding tokens and request rows change nothing."""
    model = tiny_model(arch)
    prompts = random_prompts([1, 9, 40, 70, 23, 5])
    captured: list[int] = []
    requests, engine = run(model, prompts, max_new=8, attention_backend="reference", max_blocks_per_request=8,
                           graphs=step_graphs(captured, decode=True, varlen=True, q=q, kv=kv))
    assert_same(requests, reference(model, prompts, 8))
    varlen = [s for s in engine.runner.graphs._graphs if not s.decode]
    assert varlen, "no varlen step went through the graphs"
    for s in varlen:
        assert s.tokens % q == 0 if q else s.tokens & (s.tokens - 1) == 0
        assert (s.width * 16) % kv < 16 if kv else s.width & (s.width - 1) == 0
        assert s.requests == min(s.tokens, 9)
    assert len(captured) == len(engine.runner.graphs._graphs)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_varlen_graphs_with_sliding_windows_and_no_decode_fast_path() -> None:
    model = tiny_model("mistral", sliding_window=8)
    prompts = random_prompts([3, 30, 50])
    captured: list[int] = []
    requests, engine = run(model, prompts, attention_backend="reference",
                           graphs=step_graphs(captured, decode=False, varlen=True))
    assert engine.runner.max_blocks_per_request == 0
    assert_same(requests, reference(model, prompts))
    assert captured and not any(s.decode for s in engine.runner.graphs._graphs)


def test_graph_shapes_buckets_and_limits(monkeypatch) -> None:
    """Which steps get which padded shape, and which run eagerly."""
    model = tiny_model("llama")
    engine = build_engine(model, GenerationConfig(max_new_tokens=4), cbserve.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=256, attention_backend="reference", max_blocks_per_request=4))
    try:
        graphs = step_graphs([], decode=True, varlen=True, q=0, kv=0, max_requests=8)(engine)
        kernels = engine.runner.kernels

        def meta(lens: list[int], q_lens: list[int], width: int, fast: bool = False):
            ki = KernelInputs(kernels, torch.zeros(len(lens), width, dtype=torch.int64), torch.tensor(lens),
                              torch.tensor([0, *q_lens]).cumsum(0), decode_only=fast)
            return AttentionMetadata([], [], torch.zeros(sum(q_lens)), 16, len(lens) if fast else 0, None, None, [],
                                     ki, fast_decode=fast)

        S = cuda_graphs.Shape
        assert graphs.shape_of(meta([5, 9, 20], [1, 1, 1], 4, fast=True), 3) == S(True, 4, 4, 4)
        assert graphs.shape_of(meta([5] * 9, [1] * 9, 4, fast=True), 9) is None  # more than max_requests
        assert graphs.shape_of(meta([40, 3], [30, 3], 3), 33) == S(False, 64, 9, 4)
        assert graphs.shape_of(meta([40, 3], [2, 3], 3), 5) == S(False, 8, 8, 4)
        graphs.kv_padding_interval, graphs.q_padding_interval = 100, 24
        assert graphs.shape_of(meta([40, 3], [30, 3], 3), 33) == S(False, 48, 9, 7)  # 100 tokens -> 7 pages
        assert graphs.shape_of(meta([400], [300], 25), 300) is None  # past the varlen token limit
        monkeypatch.setattr(cuda_graphs, "MAX_VARLEN_GRAPHS", 0)
        kwargs = {"input_ids": torch.zeros(1, 5, dtype=torch.int64), "cb_meta": meta([40, 3], [2, 3], 3)}
        assert graphs.run(kwargs) is None  # no room for another varlen shape: eager
    finally:
        engine.release_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("backend", ["triton", "flash"])
@pytest.mark.parametrize("graphs", [(False, True), (True, True)], ids=["decode", "decode+varlen"])
def test_cuda_backends_with_real_graphs_equal_generate(backend: str, graphs: tuple[bool, bool]) -> None:
    from cbserve.kernels import flash_attn_adapter as fa

    if backend == "flash" and fa.flash_unavailable_reason():
        pytest.skip(fa.flash_unavailable_reason())
    model = tiny_model("qwen3", dtype=torch.float32).cuda()
    prompts = random_prompts([1, 9, 40, 70, 120])
    cfg = cbserve.ContinuousBatchingConfig(page_size=256, num_blocks=16, max_batch_tokens=256, return_logprobs=True,
                                           attention_backend=backend, use_cuda_graph=graphs,
                                           q_padding_interval_size=32 if graphs[0] else 0, max_blocks_per_request=2)
    requests, engine = run_engine(model, prompts, cfg, 8)
    shapes = engine.runner.graphs._graphs
    assert any(s.decode for s in shapes) and any(not s.decode for s in shapes) == graphs[0]
    assert_same(requests, reference(model, prompts, 8), tol=1e-3)



@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512", "avx2"])
def test_cpu_prefill_kernel_by_dtype_cpu_and_batch_invariance(amx: bool, isa: str, monkeypatch) -> None:
    """Prefill chunks: the per-row C++ kernel with batch_invariant=True; otherwise bfloat16 goes to
    SDPA on a CPU with AMX (its flash kernel multiplies on AMX tiles) and to the tiled C++ kernel
    on the avx512_bf16 path, float32 to the tiled kernel on the AVX-512 paths; anything else to
    SDPA with batch_invariant=False, else the per-row kernel. The CPU's flags are faked so that
    every rule is checked on every CPU."""
    from cbserve.kernels import cpu_isa

    monkeypatch.setattr(cpu_isa, "has_amx_bf16", lambda: amx)
    monkeypatch.setattr(cpu_isa, "selected", lambda: isa)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for invariant in (None, True, False):
            got = attention_backends.kernels("cpu", invariant, dtype).varlen
            bf16 = dtype == torch.bfloat16
            if invariant:
                want = cpu_kernels.varlen_paged_attention
            elif bf16 and amx:
                want = None
            elif (bf16 and isa == "avx512_bf16") or (dtype == torch.float32 and isa in ("avx512", "avx512_bf16")):
                want = cpu_kernels.tiled_prefill_attention
            else:
                want = None if invariant is False else cpu_kernels.varlen_paged_attention
            assert got is want, (dtype, invariant)


def test_graph_kinds_default_to_what_can_run_on_cuda() -> None:
    """use_cuda_graph=None: varlen graphs on CUDA with a kernel backend, decode graphs with the fast
    path too (transformers' rule); nothing on a CPU or without kernels; explicit choices kept."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cuda_graphs.graph_kinds(None, cuda, True, True) == (True, True)
    assert cuda_graphs.graph_kinds(None, cuda, True, False) == (True, False)  # sliding windows: no fast path
    assert cuda_graphs.graph_kinds(None, cuda, False, True) == (False, False)  # sdpa
    assert cuda_graphs.graph_kinds(None, cpu, True, True) == (False, False)
    assert cuda_graphs.graph_kinds((False, None), cuda, True, True) == (False, True)
    assert cuda_graphs.graph_kinds(True, cpu, True, True) == (True, True)  # refused later, saying why
