"""Plain-PyTorch reference kernels for the paged KV cache; ground truth for the tests.

Written for clarity, not speed: one request at a time, GQA by repeating K/V heads.

Layout (shared with the Triton and flash-attn paths):
- ``k_cache``/``v_cache``: ``[num_blocks, page_size, num_kv_heads, head_dim]``; the token in slot
  ``s`` lives at ``cache[s // page_size, s % page_size]``.
- ``context_lens[b]`` counts request b's KV tokens including this step's (already stored).
- The i-th of the ``q_len`` query tokens of request b sits at position ``context_lens[b] - q_len + i``.
- Sliding window W: a query at position p sees KV positions ``p - W < j <= p``. This matches
  ``transformers.masking_utils.sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) and
  flash-attn's ``window_size=(W - 1, 0)``.
- Positions outside the window are never read, so pages that a sliding layer recycled (a ring of
  pages) may hold anything, even NaN.
"""

from __future__ import annotations

import torch

__all__ = ["paged_decode_attention", "store_kv", "varlen_paged_attention"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, kvH, D]`` into the caches at ``slot_mapping``; slot -1 is skipped."""
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // page_size, slots % page_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attend_one_request(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of one request's ``q`` ``[q_len, H, D]`` (the last q_len positions) over its pages."""
    q_len, num_heads, _ = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cdtype = _compute_dtype(q.dtype)
    q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
    # Gather only the KV positions some query can see: out-of-window pages may be recycled.
    first = 0 if sliding_window is None else max(0, context_len - q_len - sliding_window + 1)
    kv_pos = torch.arange(first, context_len, device=q.device)
    pages = block_table.long()[kv_pos // page_size]
    k = k_cache[pages, kv_pos % page_size].to(cdtype)  # [L, kvH, D]
    v = v_cache[pages, kv_pos % page_size].to(cdtype)
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)

    scores = torch.einsum("qhd,khd->hqk", q.to(cdtype), k) * scale
    if softcap:  # None or 0.0: no capping (flash-attn convention)
        scores = softcap * torch.tanh(scores / softcap)
    visible = kv_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per request (``q`` ``[B, H, D]``) at position ``context_lens[b] - 1``; out ``[B, H, D]``."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        out[b] = _attend_one_request(
            q[b : b + 1],
            k_cache,
            v_cache,
            block_tables[b],
            int(context_lens[b]),
            scale,
            sliding_window,
            softcap,
        )[0]
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
) -> torch.Tensor:
    """Packed queries ``q`` ``[T, H, D]`` (request b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``),
    causal within each request over its cached pages; returns ``[T, H, D]``."""
    out = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    for b in range(len(starts) - 1):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        out[lo:hi] = _attend_one_request(
            q[lo:hi], k_cache, v_cache, block_tables[b], int(context_lens[b]), scale, sliding_window, softcap
        )
    return out
