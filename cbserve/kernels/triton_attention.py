"""Triton kernels for the paged KV cache: store K/V, paged decode, packed variable-length attention.

Same signatures and semantics as :mod:`cbserve.kernels.reference` (read its docstring for the cache
layout, positions, the sliding-window convention and soft-capping). Design:

- GQA without repeating K/V: one program handles all ``group = H // kvH`` query heads of one kv head,
  packed as rows of a ``[ROWS, D]`` tile (padded to >= 16 rows, which ``tl.dot`` needs on GPUs).
- K/V tiles of ``BLOCK_N`` tokens are gathered token by token through the block table, so any page
  size works (4, 16, 64...) and a tile may straddle pages.
- Online softmax (base 2, fp32 accumulators) over the tiles. Decode splits the context into
  partitions reduced by a second kernel (flash-decoding) so long contexts use more of the GPU.
- Only KV positions some query can see are read: with a sliding window the loop starts at the
  window's first position, so pages a sliding layer recycled are never touched.
- No host synchronisation: grids come from tensor shapes, never from ``.item()``.

The triton import is guarded: without triton this module still imports, ``TRITON_AVAILABLE`` is
False and the kernels raise RuntimeError. On CPU the kernels only run under Triton's interpreter
(``TRITON_INTERPRET=1``), which triton consults when a kernel is defined, i.e. when this module is
imported. The kernels avoid three interpreter pitfalls (triton 3.9): bf16 ``tl.dot`` (bf16 operands
are upcast, interpreter only), masks combining a scalar with a block, and standard-library @jit
helpers such as ``tl.max`` that fail when triton was imported before the variable was set.
"""

from __future__ import annotations

import math

import torch

from cbserve.kernels.triton_import import IMPORT_ERROR as _IMPORT_ERROR
from cbserve.kernels.triton_import import TRITON_AVAILABLE, tl, triton

__all__ = ["TRITON_AVAILABLE", "paged_decode_attention", "store_kv", "varlen_paged_attention"]

_DEFAULT_ROWS = 64  # query rows (tokens x heads of a GQA group) per varlen program
_DEFAULT_BLOCK_N = 32  # KV tokens per tile
_DEFAULT_PARTITION = 512  # KV tokens per decode split

if TRITON_AVAILABLE:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcp, stride_kch, stride_kcd,
        stride_vcb, stride_vcp, stride_vch, stride_vcd,
        page_size, num_kv_heads, head_dim,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)[:, None]
        # The slot, loaded as a [BLOCK_H, 1] column: the interpreter rejects masks built from a scalar.
        slot = tl.load(slot_ptr + t + h * 0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim) & (slot >= 0)  # slot -1: padding, store nothing
        block = slot // page_size
        off = slot % page_size
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + off * stride_kcp + h * stride_kch + d * stride_kcd
        v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcp + h * stride_vch + d * stride_vcd
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    # tl.max / tl.sum / tl.zeros are themselves @jit functions of triton's standard library: when triton
    # was imported before TRITON_INTERPRET=1 was set, the interpreter cannot call them. So reductions
    # call tl.reduce directly (what tl.max / tl.sum do) with the standard library's combine functions,
    # which the interpreter recognises and runs as numpy reductions; our own copies are the fallback.
    @triton.jit
    def _max_combine_fallback(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _add_combine_fallback(a, b):
        return a + b

    _max_combine = getattr(tl.standard, "_elementwise_max", _max_combine_fallback)
    _add_combine = getattr(tl.standard, "_sum_combine", _add_combine_fallback)

    @triton.jit
    def _softcap(s, softcap):
        # softcap * tanh(s / softcap), with tanh written through exp (portable, saturates cleanly).
        return softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))

    @triton.jit
    def _attend_tile(
        q, acc, m_i, l_i, n, visible, bt_row_ptr,
        k_cache_ptr, v_cache_ptr, kvh, d, d_ok,
        stride_kb, stride_kp, stride_kh, stride_kd,
        stride_vb, stride_vp, stride_vh, stride_vd,
        page_size, qk_scale, softcap,
        HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ):  # fmt: skip
        """One online-softmax step of a [ROWS, D] query tile over the KV tokens ``n`` ([BLOCK_N])."""
        n_ok = tl.reduce(visible.to(tl.int32), 0, _max_combine) > 0  # tokens at least one row may see
        page = tl.load(bt_row_ptr + n // page_size, mask=n_ok, other=0).to(tl.int64)
        off = (n % page_size).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_off = page * stride_kb + off * stride_kp + kvh * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        if DOT_UPCAST:  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = s * qk_scale
        if HAS_SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # base-2 logits from here on
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        # Rows that have seen nothing yet keep m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v_off = page * stride_vb + off * stride_vp + kvh * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        p_in = p.to(q.dtype)  # P rounded to the input dtype for the PV dot, as flash-attention does
        v = v.to(q.dtype)
        if DOT_UPCAST:
            pv = tl.dot(p_in.to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p_in, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.reduce(p, 1, _add_combine)
        return acc, m_new, l_i

    @triton.jit
    def _decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kp, stride_kh, stride_kd,
        stride_vb, stride_vp, stride_vh, stride_vd,
        stride_btb,
        stride_ob, stride_oh, stride_od,
        qk_scale, softcap, window, page_size, head_dim, group, num_heads, partition_size, num_splits,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(context_lens_ptr + b)
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(ctx - window, 0)  # query at ctx-1 sees positions > ctx-1-window
        start = first + split * partition_size
        end = tl.minimum(start + partition_size, ctx)

        rows = tl.arange(0, ROWS)
        row_ok = rows < group
        head = kvh * group + rows
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([ROWS], float("-inf"), ACC)
        l_i = tl.full([ROWS], 0.0, ACC)
        acc = tl.full([ROWS, BLOCK_D], 0.0, ACC)
        bt_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_btb
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            visible = (n[None, :] < end) & (rows[:, None] >= 0)  # one query: all of [first, ctx) is visible
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, n, visible, bt_row_ptr, k_cache_ptr, v_cache_ptr, kvh, d, d_ok,
                stride_kb, stride_kp, stride_kh, stride_kd, stride_vb, stride_vp, stride_vh, stride_vd,
                page_size, qk_scale, softcap, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST,
            )  # fmt: skip
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty partition: output 0, lse -inf
        out = acc / l_safe[:, None]
        mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            # part_out: [B, H, num_splits, BLOCK_D] fp32; part_lse: [B, H, num_splits] (base 2).
            idx = (b * num_heads + head) * num_splits + split
            tl.store(part_out_ptr + idx[:, None] * BLOCK_D + d[None, :], out, mask=mask)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + idx, lse, mask=row_ok)
        else:
            o_ptr = out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od
            tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _decode_reduce_kernel(
        part_out_ptr, part_lse_ptr, out_ptr,
        stride_ob, stride_oh, stride_od,
        num_heads, num_splits, head_dim,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        d = tl.arange(0, BLOCK_D)
        base = (b * num_heads + h) * num_splits
        lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
        # Split 0 holds the query's own token, so the max is finite unless the context is empty.
        m = tl.reduce(lse, 0, _max_combine)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
        w = w / tl.maximum(tl.reduce(w, 0, _add_combine), 1e-30)
        parts = tl.load(
            part_out_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0
        )
        out = tl.reduce(parts * w[:, None], 0, _add_combine)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=d < head_dim)  # fmt: skip

    @triton.jit
    def _varlen_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kp, stride_kh, stride_kd,
        stride_vb, stride_vp, stride_vh, stride_vd,
        stride_btb,
        stride_ot, stride_oh, stride_od,
        qk_scale, softcap, window, page_size, head_dim, group, num_seqs,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        BLOCK_M: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        # Program i covers query block i - (cu_seqlens_q[b] // BLOCK_M + b) of request b: a grid of
        # T // BLOCK_M + B programs covers every request without knowing max q_len on the host.
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:  # find the last request b with cu_seqlens_q[b] // BLOCK_M + b <= pid
            mid = (lo + hi) // 2
            if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        b = lo - 1
        q_start = tl.load(cu_seqlens_q_ptr + b)
        q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
        q_block = pid - (q_start // BLOCK_M + b)
        if q_block * BLOCK_M >= q_len:
            return
        ctx = tl.load(context_lens_ptr + b)

        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        tok = q_block * BLOCK_M + rows // GROUP_PAD  # query index within the request
        g = rows % GROUP_PAD
        row_ok = (tok < q_len) & (g < group)
        head = kvh * group + g
        pos = ctx - q_len + tok  # absolute position of each row's query
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        io_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + q_off + d[None, :] * stride_qd, mask=io_mask, other=0.0)

        first_pos = ctx - q_len + q_block * BLOCK_M
        kv_end = ctx - q_len + tl.minimum(q_block * BLOCK_M + BLOCK_M, q_len)  # last row's position + 1
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(first_pos - window + 1, 0)
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), ACC)
        l_i = tl.full([BLOCK_M * GROUP_PAD], 0.0, ACC)
        acc = tl.full([BLOCK_M * GROUP_PAD, BLOCK_D], 0.0, ACC)
        bt_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_btb
        for n0 in range(kv_start, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            visible = (n[None, :] <= pos[:, None]) & (n[None, :] < kv_end) & row_ok[:, None]
            if HAS_WINDOW:
                visible = visible & (n[None, :] > pos[:, None] - window)
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, n, visible, bt_row_ptr, k_cache_ptr, v_cache_ptr, kvh, d, d_ok,
                stride_kb, stride_kp, stride_kh, stride_kd, stride_vb, stride_vp, stride_vh, stride_vd,
                page_size, qk_scale, softcap, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST,
            )  # fmt: skip
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptr + o_off + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=io_mask)

    _INTERPRETED = type(_varlen_kernel).__name__ == "InterpretedFunction"
else:
    _INTERPRETED = False


def _check_ready(t: torch.Tensor) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            f"Triton kernels unavailable ({_IMPORT_ERROR}); install triton>=3.0 or use the SDPA/eager backend"
        )
    if t.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            "Triton kernels got CPU tensors: they only run on CPU under Triton's interpreter; "
            "set TRITON_INTERPRET=1 before cbserve.kernels.triton_attention is imported"
        )


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dots (no tf32), so results match the reference to ~1e-5.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _accumulator(dtype: torch.dtype):
    # The online softmax's running max, sum and output: float32, float64 for float64 inputs (whose
    # dots are float64: a loop-carried float32 would change type on a GPU).
    return tl.float64 if dtype == torch.float64 else tl.float32


def _dot_upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter (3.x) stores bf16 as uint16 and its tl.dot multiplies those integers; upcast
    # the (already bf16-rounded) operands to fp32 there, which gives the products a GPU computes.
    return _INTERPRETED and dtype == torch.bfloat16


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads, num_kv_heads, head_dim


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, kvH, D]`` into the caches at ``slot_mapping``; slot -1 is skipped."""
    _check_ready(key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim),
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    partition_size: int | None = None,
    block_n: int = _DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """One query per request ``q`` ``[B, H, D]`` at position ``context_lens[b] - 1``; returns ``[B, H, D]``.

    ``partition_size`` (KV tokens per split, rounded up to ``block_n``) is a tuning knob; the number
    of splits comes from the block table's width, an upper bound on the context, so no sync is needed.
    """
    _check_ready(q)
    batch, _, _ = q.shape
    num_heads, num_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_n = _pow2(block_n, 16)
    block_d = _pow2(head_dim, 16)
    max_tokens = block_tables.shape[1] * k_cache.shape[1]
    if sliding_window is not None:
        max_tokens = min(max_tokens, sliding_window)
    partition = _DEFAULT_PARTITION if partition_size is None else partition_size
    partition = max(block_n, math.ceil(partition / block_n) * block_n)
    num_splits = max(1, math.ceil(max_tokens / partition))
    split = num_splits > 1
    if split:
        part_out = torch.empty(batch, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when SPLIT is False
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        scale, softcap or 0.0, sliding_window or 0, k_cache.shape[1], head_dim, group, num_heads,
        partition, num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=bool(softcap), SPLIT=split,
        ROWS=_pow2(group, 16), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), DOT_UPCAST=_dot_upcast(q.dtype), ACC=_accumulator(q.dtype),
    )  # fmt: skip
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, *out.stride(), num_heads, num_splits, head_dim,
            BLOCK_S=_pow2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out


def varlen_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int = _DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """Packed queries ``q`` ``[T, H, D]`` (request b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``),
    causal within each request over its cached pages; returns ``[T, H, D]``.

    ``block_m`` (query tokens per program) and ``block_n`` (KV tokens per tile) are tuning knobs.
    """
    _check_ready(q)
    num_tokens = q.shape[0]
    num_heads, num_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache)
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    if block_m is None:
        block_m = max(1, _DEFAULT_ROWS // group_pad)
    block_m = _pow2(block_m)
    block_m = max(block_m, _pow2(16 // group_pad))  # tl.dot needs >= 16 rows on GPUs
    grid = (triton.cdiv(num_tokens, block_m) + num_seqs, num_kv_heads)
    _varlen_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        scale, softcap or 0.0, sliding_window or 0, k_cache.shape[1], head_dim, group, num_seqs,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=bool(softcap),
        BLOCK_M=block_m, GROUP_PAD=group_pad, BLOCK_N=_pow2(block_n, 16), BLOCK_D=_pow2(head_dim, 16),
        DOT_PRECISION=_dot_precision(q.dtype), DOT_UPCAST=_dot_upcast(q.dtype), ACC=_accumulator(q.dtype),
    )  # fmt: skip
    return out
