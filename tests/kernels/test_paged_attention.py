"""Paged-attention kernels: reference vs dense attention, Triton and the C++ CPU decode kernel vs
reference, flash-attn adapters.

On a machine without CUDA the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1,
set below before triton is imported), so shapes stay small. CBSERVE_TEST_DEVICE=cuda runs them on a GPU.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import sys
import types
from dataclasses import dataclass

import pytest
import torch

DEVICE = os.environ.get("CBSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when kernels are defined

from torch.utils import cpp_extension
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from cbserve.kernels import cpu_kernels
from cbserve.kernels import flash_attn_adapter as fa
from cbserve.kernels import reference as ref
from cbserve.kernels import triton_attention as tri

if DEVICE == "cpu" and tri.TRITON_AVAILABLE and not tri._INTERPRETED:
    tri = importlib.reload(tri)  # imported earlier without TRITON_INTERPRET: redefine the kernels

needs_triton = pytest.mark.skipif(
    not tri.TRITON_AVAILABLE, reason=f"triton is not importable ({getattr(tri, '_IMPORT_ERROR', '')})"
)

# (ctx_len, q_len) per request: first token, long decode, full prefill, prefill chunk over cached
# pages, a request with no query tokens this step.
MIXED = [(1, 1), (37, 1), (20, 20), (30, 7), (12, 0)]
DECODE_CTX = [1, 37, 20, 9]


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    keys: list[torch.Tensor]  # per request, contiguous [ctx, kvH, D]: the dense truth
    values: list[torch.Tensor]
    q_lens: list[int]


def make_batch(
    reqs: list[tuple[int, int]],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    window: int | None = None,
    poison: bool = True,
) -> Batch:
    """Random requests whose K/V are scattered over shuffled pages. With a window (and ``poison``),
    every slot no query of its request may see is set to NaN: kernels must never read it, as a
    sliding layer's ring of pages recycles them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=DEVICE)

    blocks_per = [math.ceil(ctx / page_size) for ctx, _ in reqs]
    num_blocks = sum(blocks_per) + 3
    pages = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(reqs), max(blocks_per) + 2), -1, dtype=torch.int32)
    k_cache, v_cache = (
        randn(num_blocks, page_size, num_kv_heads, head_dim),
        randn(num_blocks, page_size, num_kv_heads, head_dim),
    )
    keys, values = [], []
    for b, (ctx, q_len) in enumerate(reqs):
        block_tables[b, : blocks_per[b]] = torch.tensor(pages[: blocks_per[b]], dtype=torch.int32)
        pages = pages[blocks_per[b] :]
        keys.append(randn(ctx, num_kv_heads, head_dim))
        values.append(randn(ctx, num_kv_heads, head_dim))
        pos = torch.arange(ctx)
        slots = (block_tables[b, pos // page_size].long() * page_size + pos % page_size).to(DEVICE)
        ref.store_kv(keys[b], values[b], k_cache, v_cache, slots)
        if window is not None and poison:
            unseen = slots[: max(0, ctx - q_len - window + 1)]
            k_cache.view(-1, num_kv_heads, head_dim)[unseen] = float("nan")
            v_cache.view(-1, num_kv_heads, head_dim)[unseen] = float("nan")
    q_lens = [q_len for _, q_len in reqs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return Batch(
        q=randn(sum(q_lens), num_kv_heads * group, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu,
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor([ctx for ctx, _ in reqs], dtype=torch.int32, device=DEVICE),
        keys=keys,
        values=values,
        q_lens=q_lens,
    )


def dense_attention(batch: Batch, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Per request, from contiguous K/V, with a mask built by transformers' own mask functions."""
    out = torch.zeros_like(batch.q)
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    for b, q_len in enumerate(batch.q_lens):
        if q_len == 0:
            continue
        lo = int(batch.cu_seqlens_q[b])
        ctx = int(batch.context_lens[b])
        q = batch.q[lo : lo + q_len].transpose(0, 1)  # [H, q_len, D]
        k, v = batch.keys[b].transpose(0, 1), batch.values[b].transpose(0, 1)  # [kvH, ctx, D]
        q_idx = torch.arange(ctx - q_len, ctx, device=DEVICE)[:, None]
        mask = mask_fn(0, 0, q_idx, torch.arange(ctx, device=DEVICE)[None, :])
        if softcap is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:  # SDPA has no soft-capping: spell it out
            group = q.shape[0] // k.shape[0]
            s = q @ k.repeat_interleave(group, 0).transpose(1, 2) * scale
            s = (softcap * torch.tanh(s / softcap)).masked_fill(~mask, float("-inf"))
            o = torch.softmax(s, -1) @ v.repeat_interleave(group, 0)
        out[lo : lo + q_len] = o.transpose(0, 1)
    return out


def decode_q(batch: Batch) -> torch.Tensor:
    return batch.q  # every request has q_len 1, so rows are requests


# ---------------------------------------------------------------- reference vs dense


@pytest.mark.parametrize(
    "page_size,group,window,softcap",
    [(4, 1, None, None), (16, 3, 8, None), (64, 4, None, 30.0), (4, 3, 5, 30.0), (16, 1, 1, None)],
)
def test_reference_matches_dense(
    page_size: int, group: int, window: int | None, softcap: float | None
) -> None:
    batch = make_batch(MIXED, page_size, 2, group, 32, torch.float64, seed=page_size + group, window=window)
    args = (batch.k_cache, batch.v_cache)
    got = ref.varlen_paged_attention(
        batch.q, *args, batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.3, window, softcap
    )
    torch.testing.assert_close(got, dense_attention(batch, 0.3, window, softcap), rtol=1e-10, atol=1e-10)

    dec = make_batch(
        [(c, 1) for c in DECODE_CTX], page_size, 2, group, 32, torch.float64, seed=7, window=window
    )
    got = ref.paged_decode_attention(
        decode_q(dec), dec.k_cache, dec.v_cache, dec.block_tables, dec.context_lens, 0.3, window, softcap
    )
    torch.testing.assert_close(got, dense_attention(dec, 0.3, window, softcap), rtol=1e-10, atol=1e-10)


def test_reference_window_convention() -> None:
    """Window 1 sees only the query's own token: the output is exactly its V (transformers' convention)."""
    batch = make_batch([(6, 3)], 4, 1, 2, 32, torch.float64, seed=3, window=1)
    got = ref.varlen_paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.cu_seqlens_q,
        batch.block_tables,
        batch.context_lens,
        1.0,
        1,
    )
    torch.testing.assert_close(got, batch.values[0][3:].repeat_interleave(2, dim=1))


def test_reference_store_kv_skips_padding() -> None:
    _check_store_kv(ref.store_kv, torch.float32)


def _check_store_kv(store, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(5, 4, 2, 32, generator=gen).to(dtype=dtype, device=DEVICE)
    v_cache = torch.randn(5, 4, 2, 32, generator=gen).to(dtype=dtype, device=DEVICE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    # Non-contiguous inputs, as a [1, kvH, T, D] -> [T, kvH, D] transpose from a model produces. Same
    # dtype as the cache (the engine's case; Triton's interpreter truncates fp32 -> bf16, GPUs round).
    key = torch.randn(1, 2, 6, 32, generator=gen).to(DEVICE, dtype)[0].transpose(0, 1)
    value = torch.randn(1, 2, 6, 32, generator=gen).to(DEVICE, dtype)[0].transpose(0, 1)
    slots = torch.tensor([13, -1, 0, 7, -1, 19], dtype=torch.int64, device=DEVICE)
    store(key, value, k_cache, v_cache, slots)
    exp_k, exp_v = before_k.view(20, 2, 32).clone(), before_v.view(20, 2, 32).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            exp_k[s], exp_v[s] = key[t], value[t]
    assert torch.equal(k_cache.view(20, 2, 32), exp_k)
    assert torch.equal(v_cache.view(20, 2, 32), exp_v)


# ---------------------------------------------------------------- Triton vs reference

# page_size x GQA group cover all 9 pairs; head dim, window, softcap and dtype vary across them.
CASES = [
    # page, kv_heads, group, head_dim, window, softcap, dtype
    (4, 2, 1, 32, None, None, torch.float32),
    (4, 1, 3, 64, 8, 30.0, torch.bfloat16),
    (4, 2, 4, 32, 5, None, torch.float32),
    (16, 1, 1, 64, 8, 30.0, torch.float32),
    (16, 2, 3, 32, None, 30.0, torch.float32),
    (16, 1, 4, 64, None, None, torch.bfloat16),
    (64, 2, 1, 32, 8, None, torch.bfloat16),
    (64, 1, 3, 32, 8, None, torch.float16),
    (64, 2, 4, 64, None, 30.0, torch.float32),
]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # Half types: the kernel feeds P to the PV dot in the input dtype (as flash-attention does) while
    # the reference keeps fp32 probabilities.
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _case_id(case: tuple) -> str:
    page, kvh, group, d, window, softcap, dtype = case
    return f"p{page}-kv{kvh}-g{group}-d{d}-w{window}-cap{softcap}-{str(dtype).split('.')[-1]}"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_varlen_matches_reference(case: tuple) -> None:
    page, kvh, group, d, window, softcap, dtype = case
    batch = make_batch(MIXED, page, kvh, group, d, dtype, seed=page * 10 + group, window=window)
    args = (batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.25)
    want = ref.varlen_paged_attention(batch.q, *args, window, softcap)
    assert not want.isnan().any()
    # Default tiling, then small tiles: several query blocks per request, KV tiles straddling pages.
    for tiling in ({}, {"block_m": 2, "block_n": 16}):
        got = tri.varlen_paged_attention(batch.q, *args, window, softcap, **tiling)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **_tol(dtype), msg=lambda m, t=tiling: f"{t}: {m}")


@needs_triton
@pytest.mark.parametrize("window", [None, 8])
def test_varlen_kernels_on_a_cuda_graph_padded_batch(window: int | None) -> None:
    """A padded varlen graph shape: real requests, then one request with no context that owns the
    padding tokens, then empty request rows. Real rows are unchanged, padding rows are zeros."""
    batch = make_batch(MIXED, 16, 2, 2, 32, torch.float32, seed=3, window=window)
    pad_tokens, empty_rows = 5, 3
    t = batch.q.shape[0]
    q = torch.cat([batch.q, torch.randn(pad_tokens, *batch.q.shape[1:], device=DEVICE)])
    cu = torch.cat([batch.cu_seqlens_q, torch.full((1 + empty_rows,), t + pad_tokens, dtype=torch.int32,
                                                   device=DEVICE)])
    tables = torch.cat([batch.block_tables, torch.zeros(1 + empty_rows, batch.block_tables.shape[1],
                                                        dtype=batch.block_tables.dtype, device=DEVICE)])
    lens = torch.cat([batch.context_lens, torch.zeros(1 + empty_rows, dtype=torch.int32, device=DEVICE)])
    want = ref.varlen_paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q,
                                      batch.block_tables, batch.context_lens, 0.25, window)
    for kernel in (ref.varlen_paged_attention, tri.varlen_paged_attention):
        got = kernel(q, batch.k_cache, batch.v_cache, cu, tables, lens, 0.25, window)
        torch.testing.assert_close(got[:t], want, **_tol(torch.float32))
        assert got[t:].abs().max() == 0, f"{kernel.__module__}: padding rows attend to something"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_decode_matches_reference(case: tuple) -> None:
    page, kvh, group, d, window, softcap, dtype = case
    batch = make_batch(
        [(c, 1) for c in DECODE_CTX], page, kvh, group, d, dtype, seed=page + group, window=window
    )
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.25, window, softcap)
    want = ref.paged_decode_attention(decode_q(batch), *args)
    assert not want.isnan().any()
    # One partition, then 16-token partitions (flash-decoding splits and their reduction).
    for tiling in ({}, {"partition_size": 16, "block_n": 16}):
        got = tri.paged_decode_attention(decode_q(batch), *args, **tiling)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **_tol(dtype), msg=lambda m, t=tiling: f"{t}: {m}")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_kv(dtype: torch.dtype) -> None:
    _check_store_kv(tri.store_kv, dtype)


def test_triton_missing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tri, "TRITON_AVAILABLE", False)
    batch = make_batch([(3, 1)], 4, 1, 1, 32, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="Triton kernels unavailable"):
        tri.paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 1.0
        )


# ---------------------------------------------------------------- C++ CPU decode vs reference

needs_cpu_kernel = pytest.mark.skipif(
    DEVICE != "cpu" or shutil.which(cpp_extension.get_cxx_compiler()) is None,
    reason="the C++ decode kernel is built for CPUs, with a C++ compiler",
)


@needs_cpu_kernel
@pytest.mark.parametrize("case", [*CASES, (16, 2, 3, 64, 7, 50.0, torch.float64)], ids=_case_id)
@pytest.mark.parametrize("many", [False, True], ids=["few-requests", "many-requests"])
def test_cpu_decode_matches_reference(case: tuple, many: bool) -> None:
    """Few requests: tasks split by KV head; many (>= 4 per thread): a task reads whole token rows."""
    assert cpu_kernels.unavailable_reason() == ""  # a compiler is here: the build must work
    page, kvh, group, d, window, softcap, dtype = case
    ctx = DECODE_CTX * 12 if many else DECODE_CTX
    batch = make_batch([(c, 1) for c in ctx], page, kvh, group, d, dtype, seed=page + group, window=window)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.25, window, softcap)
    want = ref.paged_decode_attention(decode_q(batch), *args)
    assert not want.isnan().any()
    got = cpu_kernels.paged_decode_attention(decode_q(batch), *args)
    assert got.dtype == dtype
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else _tol(dtype)
    torch.testing.assert_close(got, want, **tol)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_store_kv_skips_padding(dtype: torch.dtype) -> None:
    _check_store_kv(cpu_kernels.store_kv, dtype)


@needs_cpu_kernel
@pytest.mark.parametrize("tokens", [3, 2048], ids=["decode-rows", "prefill-split-over-threads"])
def test_cpu_store_kv_of_fused_qkv_rows(tokens: int) -> None:
    """K/V as the lean forward hands them (views into the [T, (H + 2 kvH) D] QKV rows), int32 slots:
    the C++ row copies put every token where the reference puts it, and touch nothing else."""
    gen = torch.Generator().manual_seed(1)
    kvh, d, page = 3, 64, 16
    k_cache = torch.randn(300, page, kvh, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(300, page, kvh, d, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(tokens, 9 * d + 2 * kvh * d, generator=gen).to(torch.bfloat16)
    key = qkv[:, 9 * d : (9 + kvh) * d].view(tokens, kvh, d)
    value = qkv[:, (9 + kvh) * d :].view(tokens, kvh, d)
    slots = torch.randperm(300 * page, generator=gen)[:tokens].to(torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, want_k, want_v, slots)
    cpu_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@needs_cpu_kernel
@pytest.mark.parametrize("slot", [-2, 5 * 4 * 1])
def test_cpu_store_kv_refuses_a_slot_outside_the_cache(slot: int) -> None:
    k_cache, v_cache = torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)
    key = torch.ones(2, 2, 8)
    with pytest.raises(RuntimeError, match=f"slot {slot} of token 1 is outside the cache's \\[0, 20\\)"):
        cpu_kernels.store_kv(key, key, k_cache, v_cache, torch.tensor([3, slot]))
    assert not k_cache.any() and not v_cache.any()  # checked before anything is written


CPU_PATHS = ["generic", "avx2", "avx512", "avx512_bf16"]


def _skip_unless_cpu_path(isa: str) -> None:
    from cbserve.kernels import cpu_isa

    if DEVICE != "cpu":
        pytest.skip("the C++ kernels are CPU kernels")
    reason = cpu_kernels.unavailable_reason() or cpu_isa.why_not(isa)
    if reason:
        pytest.skip(f"the {isa} path cannot run on this machine: {reason}")


@needs_cpu_kernel
@pytest.mark.parametrize("isa", CPU_PATHS)
@pytest.mark.parametrize("case", [*CASES, (16, 2, 3, 64, 7, 50.0, torch.float64), (8, 3, 3, 64, None, None,
                                                                                      torch.bfloat16)], ids=_case_id)
def test_cpu_paths_match_reference(isa: str, case: tuple) -> None:
    """Every instruction-set path of the C++ attention kernel, forced, on decode rows and on packed
    varlen rows (prefill chunks over cached pages, a request with no rows), against the reference."""
    _skip_unless_cpu_path(isa)
    page, kvh, group, d, window, softcap, dtype = case
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else _tol(dtype)
    batch = make_batch([*MIXED, (70, 33)], page, kvh, group, d, dtype, seed=page * 10 + group, window=window)
    args = (batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.25)
    want = ref.varlen_paged_attention(batch.q, *args, window, softcap)
    assert not want.isnan().any()
    got = cpu_kernels.varlen_paged_attention(batch.q, *args, window, softcap, isa=isa)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    dec = make_batch([(c, 1) for c in DECODE_CTX * 3], page, kvh, group, d, dtype, seed=page + group, window=window)
    args = (dec.k_cache, dec.v_cache, dec.block_tables, dec.context_lens, 0.25, window, softcap)
    got = cpu_kernels.paged_decode_attention(decode_q(dec), *args, isa=isa)
    torch.testing.assert_close(got, ref.paged_decode_attention(decode_q(dec), *args), **tol)


# Contexts around the kernel's softmax segments (512 positions): one segment, its edges, several.
LONG_CTX = [1, 511, 512, 513, 1100, 2100]
LONG_CASES = [  # page, kv_heads, group, head_dim, window, softcap, dtype
    (16, 3, 3, 64, None, None, torch.bfloat16),  # the default model's shape
    (16, 2, 3, 64, 700, 50.0, torch.float64),  # a window spanning segments, its start between pages
    (8, 2, 2, 32, None, 30.0, torch.float32),
]


@needs_cpu_kernel
@pytest.mark.parametrize("isa", CPU_PATHS)
@pytest.mark.parametrize("case", LONG_CASES, ids=_case_id)
def test_cpu_long_rows_match_reference(isa: str, case: tuple) -> None:
    """Rows over several softmax segments, whose partial sums combine after: decode rows alone (a
    long row's segments are tasks of their own), a few and many together (a task per row), and a
    prefill chunk over cached pages, against the reference."""
    _skip_unless_cpu_path(isa)
    page, kvh, group, d, window, softcap, dtype = case
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else _tol(dtype)
    dec = make_batch([(c, 1) for c in LONG_CTX * 2], page, kvh, group, d, dtype, seed=3, window=window)
    for rows in (1, 2, len(LONG_CTX) * 2):
        sub = slice(len(LONG_CTX) - 1, len(LONG_CTX) - 1 + rows) if rows < 3 else slice(None)
        args = (dec.k_cache, dec.v_cache, dec.block_tables[sub], dec.context_lens[sub], 0.25, window, softcap)
        want = ref.paged_decode_attention(decode_q(dec)[sub], *args)
        assert not want.isnan().any()
        got = cpu_kernels.paged_decode_attention(decode_q(dec)[sub], *args, isa=isa)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{rows} rows: {m}")
    pre = make_batch([(1300, 70), (600, 3)], page, kvh, group, d, dtype, seed=4, window=window)
    args = (pre.k_cache, pre.v_cache, pre.cu_seqlens_q, pre.block_tables, pre.context_lens, 0.25)
    want = ref.varlen_paged_attention(pre.q, *args, window, softcap)
    torch.testing.assert_close(cpu_kernels.varlen_paged_attention(pre.q, *args, window, softcap, isa=isa), want, **tol)


@needs_cpu_kernel
@pytest.mark.parametrize("isa", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rows_do_not_depend_on_the_batch(isa: str, dtype: torch.dtype) -> None:
    """A query row's output is bitwise the same as a decode row alone, inside a prefill chunk of any
    length, or among many other rows (batch invariance of the attention kernel); also a row over
    several softmax segments, whose segments are tasks of their own when it is alone, and on one
    thread."""
    _skip_unless_cpu_path(isa)
    batch = make_batch([(90, 40), (5, 5), (61, 1), (130, 17), (1100, 6)], 16, 3, 3, 64, dtype, seed=11)
    args = (batch.k_cache, batch.v_cache)
    together = cpu_kernels.varlen_paged_attention(batch.q, *args, batch.cu_seqlens_q, batch.block_tables,
                                                  batch.context_lens, 0.125, isa=isa)
    for b, q_len in enumerate(batch.q_lens):
        lo, ctx = int(batch.cu_seqlens_q[b]), int(batch.context_lens[b])
        table = batch.block_tables[b : b + 1]
        for i in range(q_len):  # each row alone, as a decode row at its position
            alone = cpu_kernels.paged_decode_attention(batch.q[lo + i : lo + i + 1], *args, table,
                                                       torch.tensor([ctx - q_len + i + 1]), 0.125, isa=isa)
            assert torch.equal(alone[0], together[lo + i]), (b, i)
            if ctx > 512 and i == 0:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    one = cpu_kernels.paged_decode_attention(batch.q[lo : lo + 1], *args, table,
                                                             torch.tensor([ctx - q_len + 1]), 0.125, isa=isa)
                finally:
                    torch.set_num_threads(threads)
                assert torch.equal(one[0], together[lo]), (b, "one thread")
        cut = q_len // 3  # the same rows as two chunks
        for a, e in ((0, cut), (cut, q_len)):
            if e > a:
                part = cpu_kernels.varlen_paged_attention(
                    batch.q[lo + a : lo + e], *args, torch.tensor([0, e - a]), table,
                    torch.tensor([ctx - q_len + e]), 0.125, isa=isa)
                assert torch.equal(part, together[lo + a : lo + e]), (b, a, e)


TILED_CASES = [  # page, kv_heads, group, head_dim, window, softcap (bfloat16)
    (16, 3, 3, 64, None, None),  # the default model's shape
    (4, 2, 1, 32, 8, None),
    (16, 1, 4, 128, None, 30.0),
    (64, 2, 2, 64, 40, 30.0),
    (8, 1, 8, 256, None, None),
]


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", TILED_CASES, ids=lambda c: "p{}-kv{}-g{}-d{}-w{}-cap{}".format(*c))
def test_tiled_prefill_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    """The tiled prefill kernel (bfloat16 on AVX-512 BF16, float32 on AVX-512) on prompts of several
    tasks and K/V blocks, chunks over cached pages and decode rows in the same call, against float64
    attention of the same inputs: as close as the per-row kernel (bfloat16: its probabilities are
    rounded to bfloat16 for p.v, as flash attention's are), and decode rows bitwise the per-row
    kernel's (they take it)."""
    isa = "avx512_bf16" if dtype == torch.bfloat16 else "avx512"
    _skip_unless_cpu_path(isa)
    page, kvh, group, d, window, softcap = case
    assert cpu_kernels.tiled_prefill_runs(dtype, d, isa)
    reqs = [*MIXED, (70, 33), (150, 150), (300, 97), (40, 3)]
    batch = make_batch(reqs, page, kvh, group, d, dtype, seed=page + d, window=window)
    args = (batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.125,
            window, softcap)
    want = ref.varlen_paged_attention(batch.q.double(), batch.k_cache.double(), batch.v_cache.double(), *args[2:])
    got = cpu_kernels.tiled_prefill_attention(batch.q, *args, isa=isa)
    rows = cpu_kernels.varlen_paged_attention(batch.q, *args, isa=isa)
    assert got.dtype == dtype and not got.isnan().any()
    err, row_err = (got.double() - want).abs(), (rows.double() - want).abs()
    if dtype == torch.bfloat16:
        assert err.max() <= 2 * row_err.max() + 1e-3 and err.mean() <= 1.6 * row_err.mean(), (err.max(), row_err.max())
    else:  # q.k in one chain over the head dimension (the per-row kernel: two halves, then a tree), so
        # up to ~3x its mean error at a head dimension of 256, still within 1e-5 of float64 throughout
        assert err.max() <= 1e-5 and err.mean() <= 4 * row_err.mean(), (err.max(), err.mean(), row_err.mean())
    starts = batch.cu_seqlens_q.tolist()
    for b, q_len in enumerate(batch.q_lens):
        part = slice(starts[b], starts[b] + q_len)
        if q_len < 4:  # decode rows and short chunks: the per-row routine
            assert torch.equal(got[part], rows[part]), b
        else:
            assert not torch.equal(got[part], rows[part]), b  # the tiles ran (their sums run in another order)


@needs_cpu_kernel
def test_tiled_prefill_falls_back_to_the_per_row_kernel_where_it_has_no_path() -> None:
    """A head dimension the tiles do not take, another dtype, or an instruction set without the
    dtype's path: the per-row kernel, bitwise."""
    from cbserve.kernels import cpu_isa

    if cpu_kernels.unavailable_reason():
        pytest.skip(f"the C++ kernels cannot run here: {cpu_kernels.unavailable_reason()}")
    isa = cpu_isa.selected()
    for dtype, d, path in ((torch.float32, 48, isa), (torch.bfloat16, 48, isa), (torch.float64, 64, isa),
                           (torch.float32, 64, "generic"), (torch.bfloat16, 64, "generic")):
        batch = make_batch([(70, 33), (9, 1)], 16, 2, 3, d, dtype, seed=3)
        args = (batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.125)
        assert not cpu_kernels.tiled_prefill_runs(dtype, d, path)
        assert torch.equal(cpu_kernels.tiled_prefill_attention(batch.q, *args, isa=path),
                           cpu_kernels.varlen_paged_attention(batch.q, *args, isa=path))
    assert not cpu_kernels.tiled_prefill_runs(torch.bfloat16, 64, "avx512")
    assert not cpu_kernels.tiled_prefill_runs(torch.float32, 64, "avx2")


@needs_cpu_kernel
def test_cpu_kernel_refuses_a_path_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from cbserve.kernels import cpu_isa

    missing = [isa for isa in CPU_PATHS if not cpu_isa.cpu_supports(isa)]
    if not missing:
        pytest.skip("this CPU runs every path")
    batch = make_batch([(3, 1)], 4, 1, 1, 32, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="lacks the instruction set"):
        cpu_kernels.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                           batch.context_lens, 1.0, isa=missing[0])


# ---------------------------------------------------------------- flash-attn adapters


def _fake_flash_module(calls: list[dict]) -> types.ModuleType:
    """A stand-in for ``flash_attn`` that records its arguments and computes what the real library
    documents: causal aligned to the end of the KV, window [i - left, i + right] inclusive, softcap
    0.0 = off, K/V read through ``block_table`` from [num_blocks, page, kvH, D] caches."""

    def attend(q, k_cache, v_cache, table, seqlen_k, scale, window_size, softcap):
        page = k_cache.shape[1]
        pos_k = torch.arange(seqlen_k, device=q.device)
        k = k_cache[table[pos_k // page].long(), pos_k % page].double()
        v = v_cache[table[pos_k // page].long(), pos_k % page].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(q.shape[0], device=q.device)[:, None] + seqlen_k - q.shape[0]
        keep = pos_k[None, :] <= i
        if window_size[0] >= 0:
            keep &= pos_k[None, :] >= i - window_size[0]
        s = s.masked_fill(~keep, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(), v).to(q.dtype)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
        calls.append({"fn": "varlen", "q": q.shape, "cu_seqlens_q": cu_seqlens_q,
                      "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
                      "max_seqlen_k": max_seqlen_k, **kw})  # fmt: skip
        assert kw["causal"] is True and kw["block_table"].dtype == torch.int32
        out = torch.zeros_like(q)
        for b in range(cu_seqlens_q.numel() - 1):
            lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            if hi > lo:
                out[lo:hi] = attend(q[lo:hi], k, v, kw["block_table"][b], seqlen_k, kw["softmax_scale"],
                                    kw["window_size"], kw["softcap"])  # fmt: skip
        return out

    def flash_attn_with_kvcache(q, k_cache, v_cache, **kw):
        calls.append({"fn": "kvcache", "q": q.shape, **kw})
        assert kw["causal"] is True and kw["cache_seqlens"].dtype == torch.int32
        out = torch.zeros_like(q)
        for b in range(q.shape[0]):
            out[b] = attend(q[b], k_cache, v_cache, kw["block_table"][b], int(kw["cache_seqlens"][b]),
                            kw["softmax_scale"], kw["window_size"], kw["softcap"])  # fmt: skip
        return out

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    return mod


@pytest.mark.parametrize("window,softcap", [(None, None), (8, 30.0)])
def test_flash_adapters_prepare_arguments(monkeypatch: pytest.MonkeyPatch, window, softcap) -> None:
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(calls))
    batch = make_batch([(300, 1), (520, 40), (17, 17)], 256, 2, 3, 32, torch.float64, 1, window, poison=False)
    meta = (batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.2, window, softcap)
    got = fa.flash_varlen_paged(batch.q, batch.k_cache, batch.v_cache, *meta)
    want = ref.varlen_paged_attention(batch.q, batch.k_cache, batch.v_cache, *meta)
    torch.testing.assert_close(got, want)
    call = calls[-1]
    assert call["q"] == batch.q.shape
    assert call["cu_seqlens_k"].tolist() == [0, 300, 820, 837]
    assert call["cu_seqlens_k"].dtype == torch.int32
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (40, 520)
    assert torch.equal(call["block_table"], batch.block_tables)
    assert call["window_size"] == ((-1, -1) if window is None else (window - 1, 0))
    assert call["softcap"] == (softcap or 0.0) and call["softmax_scale"] == 0.2

    dec = make_batch([(300, 1), (5, 1)], 256, 2, 3, 32, torch.float64, 2, window, poison=False)
    meta = (dec.block_tables, dec.context_lens, 0.2, window, softcap)
    got = fa.flash_decode_with_kvcache(dec.q, dec.k_cache, dec.v_cache, *meta)
    want = ref.paged_decode_attention(dec.q, dec.k_cache, dec.v_cache, *meta)
    assert got.shape == dec.q.shape
    torch.testing.assert_close(got, want)
    call = calls[-1]
    assert call["q"] == (2, 1, 6, 32)  # [B, seqlen_q=1, H, D]
    assert call["cache_seqlens"].tolist() == [300, 5]
    assert call["window_size"] == ((-1, -1) if window is None else (window - 1, 0))
    assert "k" not in call and "v" not in call  # K/V are already in the cache


def test_flash_adapter_rejects_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module([]))
    batch = make_batch([(5, 1)], 16, 1, 1, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        fa.flash_decode_with_kvcache(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 1.0
        )


def test_flash_availability_is_explained() -> None:
    reason = fa.flash_unavailable_reason()
    assert fa.FLASH_ATTN_AVAILABLE == (reason == "")
    if not torch.cuda.is_available():
        assert not fa.FLASH_ATTN_AVAILABLE and reason


@pytest.mark.skipif(
    not fa.FLASH_ATTN_AVAILABLE, reason=f"flash-attn unusable: {fa.flash_unavailable_reason()}"
)
@pytest.mark.parametrize("window,softcap", [(None, None), (100, 30.0)])
def test_real_flash_attn_matches_reference(window: int | None, softcap: float | None) -> None:
    batch = make_batch(
        [(300, 1), (520, 40), (17, 17)], 256, 2, 4, 64, torch.bfloat16, 5, window, poison=False
    )
    meta = (batch.cu_seqlens_q, batch.block_tables, batch.context_lens, 0.125, window, softcap)
    got = fa.flash_varlen_paged(batch.q, batch.k_cache, batch.v_cache, *meta)
    want = ref.varlen_paged_attention(batch.q, batch.k_cache, batch.v_cache, *meta)
    torch.testing.assert_close(got, want, **_tol(torch.bfloat16))
    dec = make_batch([(300, 1), (5, 1)], 256, 2, 4, 64, torch.bfloat16, 6, window, poison=False)
    meta = (dec.block_tables, dec.context_lens, 0.125, window, softcap)
    got = fa.flash_decode_with_kvcache(dec.q, dec.k_cache, dec.v_cache, *meta)
    torch.testing.assert_close(
        got, ref.paged_decode_attention(dec.q, dec.k_cache, dec.v_cache, *meta), **_tol(torch.bfloat16)
    )
