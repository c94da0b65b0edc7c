"""The attention function that `transformers` models call inside cbserve's forward pass.

It is registered with `transformers.AttentionInterface`; each layer hands it the new tokens'
query/key/value of the packed batch ([1, heads, T, head_dim]) and the step's metadata. It
writes the new K/V into the layer's pages by slot mapping, then attends:

- decode rows (one query per request) through the backend's paged decode kernel when it has one
  for this path (the C++ CPU kernel of the ``cpu`` backend with ``batch_invariant=False``), else
  in batched SDPA calls over each request's gathered K/V, padded to the longest context, with
  SDPA's GQA support;
- prefill chunks one request at a time, causal with an offset over the cached prefix.

No dense block-diagonal mask over the whole batch is ever built.

With a full kernel backend (`attention_backends.py`: cpu, triton, flash, reference) the step's block tables
go to the backend's kernels instead: one paged decode call for a decode-only batch, one varlen call
over every request otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cbserve.kernels.attention_backends import KernelBackend

ATTENTION_NAME = "cbserve_paged"
DECODE_CHUNK_BYTES = 5 << 19  # K+V gathered per decode SDPA call on a CPU (2.5 MiB: stays in cache)


def window_slots(
    table: torch.Tensor, lens: torch.Tensor, page_size: int, window: int | None, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots to gather for each row's visible context.

    table [B, pages] block ids, lens [B] context lengths. Full attention gathers positions
    [0, max_len); a window W gathers only each row's last W positions (older pages may have
    been released). Returns slots [B, L] (0 where invalid), positions [B, L] and validity.
    """
    if window is None or window >= max_len:
        positions = torch.arange(max_len).expand(len(lens), max_len)
    else:
        positions = lens[:, None] - window + torch.arange(window)[None, :]
    valid = (positions >= 0) & (positions < lens[:, None])
    safe = positions.clamp(min=0, max=max_len - 1)
    slots = table.gather(1, safe // page_size) * page_size + safe % page_size
    return slots.masked_fill(~valid, 0), positions, valid


@dataclass
class PrefillChunk:
    q_start: int
    q_end: int
    first_position: int  # absolute position of the chunk's first query token
    block_table: torch.Tensor  # [1, pages] the request's block ids
    page_size: int
    _kv: dict[int | None, tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    def kv(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(slots of the visible KV positions, or None to use the chunk's new K/V as is;
        bool [q, kv] mask, or None when plain causal SDPA is exact)."""
        if window not in self._kv:
            start, end = self.first_position, self.first_position + self.num_queries
            q_pos = torch.arange(start, end)[:, None]
            if start == 0:  # nothing cached before: the new K/V are the whole context
                slots, kv_pos = None, torch.arange(end)[None, :]
            else:
                # A window needs the W-1 positions before the chunk's first query, and the chunk.
                span = None if window is None else window - 1 + self.num_queries
                slots, kv_pos, valid = window_slots(self.block_table, torch.tensor([end]), self.page_size,
                                                    span, end)
                slots, kv_pos = slots[0][valid[0]], kv_pos[0][valid[0]][None, :]
            allowed = kv_pos <= q_pos
            if window is not None:
                allowed &= kv_pos > q_pos - window
            mask = None if window is None and start == 0 else allowed
            self._kv[window] = (slots, mask)
        return self._kv[window]


@dataclass
class KernelInputs:
    """Block-table view of a step for kernel backends; requests in row order (decodes first)."""

    kernels: KernelBackend
    block_tables: torch.Tensor  # [num_requests, pages] int64
    context_lens: torch.Tensor  # [num_requests] int32: cached + this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_requests + 1] int32
    decode_only: bool
    max_seqlen_q: int = 0  # host copies of the longest query / context, for flash-attn
    max_seqlen_k: int = 0


@dataclass
class AttentionMetadata:
    """Everything the attention function needs for one step, built once for all layers."""

    k_caches: list[torch.Tensor]  # per layer [num_blocks, page_size, kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64
    page_size: int
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_block_table: torch.Tensor | None  # [num_decodes, pages] int64
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunk]
    kernel_inputs: KernelInputs | None = None
    decode_kernel: Callable[..., torch.Tensor] | None = None  # for the decode rows (reference signature)
    fast_decode: bool = False  # decode-only batch on the fixed-width block table (decode fast path)
    _decode_kv: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def decode_kv(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [num_decodes, L] of each decode row's visible context and the bool mask
        [num_decodes, 1, 1, L] of real positions."""
        if window not in self._decode_kv:
            lens = self.decode_context_lens
            slots, _, valid = window_slots(self.decode_block_table, lens, self.page_size, window,
                                           int(lens.max()))
            self._decode_kv[window] = (slots.to(self.slot_mapping.device),
                                       valid[:, None, None, :].to(self.slot_mapping.device))
        return self._decode_kv[window]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, kvH, Lk, D], bool mask broadcastable to [B, 1, Lq, Lk] or
    None for causal. GQA without repeating K/V heads."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    # SDPA cannot soft-cap scores (Gemma 2): an eager path grouped by KV head.
    b, h, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, kv_heads, h // kv_heads, lq, d)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    grouped_mask = mask.unsqueeze(2) if mask.dim() == 4 else mask  # [B, 1, 1, Lq, Lk]
    scores = scores.masked_fill(~grouped_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2)).reshape(b, h, lq, d)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, kvH, D] into the pages at `slot_mapping` [T]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cb_meta: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if cb_meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside the cbserve engine")
    layer = module.layer_idx
    k_cache, v_cache = cb_meta.k_caches[layer], cb_meta.v_caches[layer]
    num_tokens = query.shape[2]
    k_new = key[0].transpose(0, 1)  # [T, kvH, D]
    v_new = value[0].transpose(0, 1)
    # Static-shape compilation pads the batch: padded rows store nothing and stay zero.
    num_real = cb_meta.slot_mapping.numel()
    if num_real < num_tokens:
        key, value = key[:, :, :num_real], value[:, :, :num_real]
        k_new, v_new = k_new[:num_real], v_new[:num_real]
    if cb_meta.kernel_inputs is not None:
        return _kernel_attention(query, k_new, v_new, k_cache, v_cache, cb_meta, num_real, scaling,
                                 sliding_window, softcap), None
    store_kv(k_new, v_new, k_cache, v_cache, cb_meta.slot_mapping)
    return _gathered_attention(query, key, value, k_cache, v_cache, cb_meta, num_real, scaling, sliding_window,
                               softcap), None


def _gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, cb_meta: AttentionMetadata, num_real: int, scaling: float | None,
                        sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Without a varlen kernel: decode rows through the backend's decode kernel or SDPA over
    gathered pages, prefill chunks through SDPA over their gathered context."""
    _, num_heads, num_tokens, head_dim = query.shape
    out = (query.new_zeros if num_real < num_tokens else query.new_empty)(1, num_tokens, num_heads, head_dim)
    kv_heads = k_cache.shape[2]
    # Rows of whole tokens: index_select over a 2-D view is a row memcpy, several times faster
    # than advanced indexing of the 4-D cache.
    k_rows = k_cache.view(-1, kv_heads * head_dim)
    v_rows = v_cache.view(-1, kv_heads * head_dim)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = slots.reshape(-1)
        shape = (*slots.shape, kv_heads, head_dim)
        return k_rows.index_select(0, flat).view(shape), v_rows.index_select(0, flat).view(shape)

    nd = cb_meta.num_decodes
    if nd and cb_meta.decode_kernel is not None:
        scale = head_dim**-0.5 if scaling is None else scaling
        out[0, :nd] = cb_meta.decode_kernel(query[0, :, :nd].transpose(0, 1), k_cache, v_cache,
                                            cb_meta.decode_block_table, cb_meta.decode_context_lens, scale,
                                            sliding_window, softcap)
    elif nd:
        q = query[0, :, :nd].transpose(0, 1).unsqueeze(2)  # [nd, H, 1, D]
        slots, mask = cb_meta.decode_kv(sliding_window)
        # On a CPU, gather and attend a few requests at a time: their K/V copy is still in cache
        # when SDPA reads it (1.3-2x faster than one gather of the whole batch at 128 requests).
        row_bytes = 2 * slots.shape[1] * kv_heads * head_dim * k_cache.element_size()
        step = nd if k_cache.is_cuda else max(1, DECODE_CHUNK_BYTES // row_bytes)
        for s in range(0, nd, step):
            e = min(nd, s + step)
            k, v = gather(slots[s:e])  # [rows, L, kvH, D]
            out[0, s:e] = attend(q[s:e], k.transpose(1, 2), v.transpose(1, 2), mask[s:e], scaling,
                                 softcap).squeeze(2)
    for chunk in cb_meta.prefills:
        s, e = chunk.q_start, chunk.q_end
        slots, mask = chunk.kv(sliding_window)
        if slots is None:
            k, v = key[:, :, s:e], value[:, :, s:e]
        else:
            k, v = gather(slots)  # [L, kvH, D]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = attend(query[:, :, s:e], k, v, mask, scaling, softcap)
        out[0, s:e] = o[0].transpose(0, 1)
    return out


def _kernel_attention(
    query: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_real: int,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Store and attend with a kernel backend; returns [1, T, H, D] like the SDPA path."""
    ki = meta.kernel_inputs
    _, num_heads, num_tokens, head_dim = query.shape
    scale = head_dim**-0.5 if scaling is None else scaling
    ki.kernels.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    q = query[0, :, :num_real].transpose(0, 1).contiguous()  # [T, H, D]
    if ki.decode_only:
        o = ki.kernels.decode(q, k_cache, v_cache, ki.block_tables, ki.context_lens, scale, sliding_window, softcap)
    else:
        extra = {"max_seqlen_q": ki.max_seqlen_q, "max_seqlen_k": ki.max_seqlen_k} \
            if ki.kernels.varlen_takes_max_seqlen else {}
        o = ki.kernels.varlen(q, k_cache, v_cache, ki.cu_seqlens_q, ki.block_tables, ki.context_lens, scale,
                              sliding_window, softcap, **extra)
    if num_real == num_tokens:
        return o.unsqueeze(0)
    out = query.new_zeros(1, num_tokens, num_heads, head_dim)
    out[0, :num_real] = o
    return out


def register() -> None:
    """Register the attention function and a mask function that builds no dense mask."""
    from transformers import AttentionInterface, AttentionMaskInterface

    # Kept out of torch.compile graphs: it holds per-step Python control flow.
    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(paged_attention_forward))
    AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)
