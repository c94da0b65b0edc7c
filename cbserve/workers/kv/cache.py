"""The paged KV cache tensors, and how many pages fit in the memory budget."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory, or available host memory on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class PagedKVCache:
    """Per layer, K and V tensors of [num_blocks, page_size, num_kv_heads, head_dim]
    (flash-attn's paged layout). Page i of every layer belongs to the same block i."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)
