"""Adapters from cbserve's paged KV layout to flash-attention 2 (``flash_attn``), when installed.

The cache layout ``[num_blocks, page_size, num_kv_heads, head_dim]`` is flash-attn's paged layout, so
the adapters only translate metadata:
- ``context_lens`` (KV tokens per request, this step's included) -> ``cu_seqlens_k`` /
  ``cache_seqlens``; ``causal=True`` aligns queries to the end of each context, as cbserve does.
- sliding window W (query at p sees ``p - W < j <= p``, the transformers convention) ->
  ``window_size=(W - 1, 0)`` (flash-attn keeps ``[p - left, p + right]`` inclusive).
- softcap ``None`` -> ``0.0`` (flash-attn's "off").
Upstream flash-attn 2 requires the page size to be a multiple of 256 for paged KV.

``flash_attn`` is imported once at import time, guarded; the adapters look it up in ``sys.modules``
at call time (so tests can substitute a fake module).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

__all__ = [
    "FLASH_ATTN_AVAILABLE",
    "FLASH_PAGE_SIZE_MULTIPLE",
    "flash_decode_with_kvcache",
    "flash_unavailable_reason",
    "flash_varlen_paged",
]

FLASH_PAGE_SIZE_MULTIPLE = 256  # flash_api.cpp: "Paged KV cache block size must be divisible by 256"

try:
    import flash_attn as _flash_attn  # noqa: F401  (imported to learn whether it works)

    _IMPORT_ERROR = ""
except (ImportError, OSError, RuntimeError) as exc:  # missing, or built against another torch/CUDA
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def flash_unavailable_reason() -> str:
    """Why flash-attn cannot be used here, for a log line; empty string when it can."""
    if _IMPORT_ERROR:
        return f"flash_attn is not importable ({_IMPORT_ERROR})"
    if not torch.cuda.is_available():
        return "flash_attn is installed but no CUDA device is available"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"flash_attn 2 needs an Ampere or newer GPU (compute capability >= 8.0), found {major}.x"
    return ""


FLASH_ATTN_AVAILABLE: bool = flash_unavailable_reason() == ""


def _flash_module() -> ModuleType:
    return importlib.import_module("flash_attn")


def _window(sliding_window: int | None) -> tuple[int, int]:
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def _check_page_size(k_cache: torch.Tensor) -> None:
    page_size = k_cache.shape[1]
    if page_size % FLASH_PAGE_SIZE_MULTIPLE:
        raise ValueError(
            f"flash-attn paged KV needs a page size that is a multiple of {FLASH_PAGE_SIZE_MULTIPLE}, "
            f"got {page_size}; use the Triton or SDPA backend, or a larger page size"
        )


def flash_varlen_paged(
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
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Packed queries ``q`` ``[T, H, D]`` over paged KV via ``flash_attn_varlen_func(block_table=...)``.

    Pass ``max_seqlen_q``/``max_seqlen_k`` when the caller knows them (host ints) to avoid a device sync.
    """
    _check_page_size(k_cache)
    context_lens = context_lens.to(torch.int32)
    cu_seqlens_k = torch.zeros(context_lens.shape[0] + 1, dtype=torch.int32, device=context_lens.device)
    torch.cumsum(context_lens, dim=0, out=cu_seqlens_k[1:])
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int(context_lens.max())
    return _flash_module().flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        window_size=_window(sliding_window),
        softcap=float(softcap or 0.0),
        block_table=block_tables.to(torch.int32).contiguous(),
    )


def flash_decode_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per request ``q`` ``[B, H, D]`` via ``flash_attn_with_kvcache``; returns ``[B, H, D]``.

    The new K/V are already in the cache (stored by ``store_kv``), so no ``k``/``v`` are passed and
    ``cache_seqlens`` is the full context length.
    """
    _check_page_size(k_cache)
    out = _flash_module().flash_attn_with_kvcache(
        q.unsqueeze(1),  # [B, 1, H, D]: one new token per request
        k_cache,
        v_cache,
        cache_seqlens=context_lens.to(torch.int32),
        block_table=block_tables.to(torch.int32).contiguous(),
        softmax_scale=scale,
        causal=True,
        window_size=_window(sliding_window),
        softcap=float(softcap or 0.0),
    )
    return out.squeeze(1)
