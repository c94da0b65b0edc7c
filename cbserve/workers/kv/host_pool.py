"""A host memory pool that evicted requests' KV pages are copied to when the device cache is
full, and copied back from when room returns, so the request resumes without recomputing.

The scheduler decides which pages move (`scheduler/host_pages.py`); this pool only holds the
host tensors and executes the copies of a step plan's `KVTransfer`s. Pinned memory when a GPU is
present (fast copies); plain host memory otherwise, so the same logic runs, and is tested, on a
CPU-only machine.
"""

from __future__ import annotations

import logging

import torch

from cbserve.scheduler.host_pages import KVTransfer
from cbserve.workers.kv.cache import PagedKVCache, available_memory_bytes

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


class HostKVPool:
    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        self.cache = cache
        self.num_blocks = num_blocks
        pin = cache.device.type == "cuda"
        shape = (num_blocks, cache.page_size, cache.num_kv_heads, cache.head_dim)
        self.k = [torch.empty(shape, dtype=cache.dtype, pin_memory=pin) for _ in range(cache.num_layers)]
        self.v = [torch.empty(shape, dtype=cache.dtype, pin_memory=pin) for _ in range(cache.num_layers)]

    def execute(self, transfers: list[KVTransfer]) -> None:
        """Run a step plan's copies in order; they are complete when this returns."""
        for transfer in transfers:
            device = torch.tensor(transfer.device_blocks, device=self.cache.device)
            host = torch.tensor(transfer.host_blocks)
            for layer in range(self.cache.num_layers):
                if transfer.kind == "offload":
                    # A blocking copy: the indexed write must not read the staging tensor before
                    # the device-to-host copy has landed in it.
                    self.k[layer][host] = self.cache.k[layer][device].cpu()
                    self.v[layer][host] = self.cache.v[layer][device].cpu()
                else:
                    self.cache.k[layer][device] = self.k[layer][host].to(self.cache.device, non_blocking=True)
                    self.cache.v[layer][device] = self.v[layer][host].to(self.cache.device, non_blocking=True)
