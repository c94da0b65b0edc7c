"""A host memory pool that evicted requests' KV pages are copied to when the device cache is
full, and copied back from when room returns, so the request resumes without recomputing.

Pinned memory when a GPU is present (fast asynchronous copies); plain host memory otherwise,
so the same logic runs, and is tested, on a CPU-only machine.
"""

from __future__ import annotations

import logging

import torch

from cbserve.scheduler.request import Request
from cbserve.workers.kv_cache import PagedKVCache, available_memory_bytes

logger = logging.getLogger(__name__)


def host_pool_blocks(cache: PagedKVCache, space_gib: float | None, safety_threshold: float) -> int:
    """Pages the pool holds: `space_gib` GiB, or `safety_threshold` of free host memory when
    None, never more than the threshold allows."""
    per_block = PagedKVCache.bytes_per_block(cache.num_layers, cache.page_size, cache.num_kv_heads,
                                             cache.head_dim, cache.dtype)
    cap = available_memory_bytes(torch.device("cpu")) * safety_threshold
    budget = cap if space_gib is None else min(space_gib * 2**30, cap)
    if space_gib is not None and space_gib * 2**30 > cap:
        logger.warning("cpu_offload_space=%.2f GiB clamped to %.2f GiB (%.0f%% of free host memory)",
                       space_gib, cap / 2**30, safety_threshold * 100)
    return int(budget // per_block)


class HostOffloadPool:
    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        self.cache = cache
        self.num_blocks = num_blocks
        pin = cache.device.type == "cuda"
        shape = (num_blocks, cache.page_size, cache.num_kv_heads, cache.head_dim)
        self.k = [torch.empty(shape, dtype=cache.dtype, pin_memory=pin) for _ in range(cache.num_layers)]
        self.v = [torch.empty(shape, dtype=cache.dtype, pin_memory=pin) for _ in range(cache.num_layers)]
        self._free = list(range(num_blocks))
        self.num_offloads = 0
        self.num_restores = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def offload(self, request: Request) -> bool:
        """Copy the request's computed pages to the host; False when the pool lacks room."""
        pages = -(-request.num_computed // self.cache.page_size)
        if pages == 0 or pages > len(self._free):
            return False
        host_ids = [self._free.pop() for _ in range(pages)]
        src = torch.tensor(request.block_ids[:pages], device=self.cache.device)
        dst = torch.tensor(host_ids)
        for layer in range(self.cache.num_layers):
            self.k[layer][dst] = self.cache.k[layer][src].to("cpu", non_blocking=True)
            self.v[layer][dst] = self.cache.v[layer][src].to("cpu", non_blocking=True)
        if self.cache.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        request.host_block_ids = host_ids
        request.num_offloaded_tokens = request.num_computed
        self.num_offloads += 1
        return True

    def restore(self, request: Request) -> None:
        """Copy the request's pages back into its (already allocated) device pages."""
        host_ids = request.host_block_ids
        src = torch.tensor(host_ids)
        dst = torch.tensor(request.block_ids[: len(host_ids)], device=self.cache.device)
        for layer in range(self.cache.num_layers):
            self.cache.k[layer][dst] = self.k[layer][src].to(self.cache.device, non_blocking=True)
            self.cache.v[layer][dst] = self.v[layer][src].to(self.cache.device, non_blocking=True)
        request.num_computed = request.num_offloaded_tokens
        self.release(request)
        self.num_restores += 1

    def release(self, request: Request) -> None:
        """Forget the request's host pages (restored, cancelled or failed)."""
        self._free.extend(request.host_block_ids)
        request.host_block_ids = []
        request.num_offloaded_tokens = 0
