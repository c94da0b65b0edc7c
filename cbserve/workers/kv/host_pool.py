"""A host memory pool that evicted requests' KV pages are copied to when the device cache is
full, and copied back from when room returns, so the request resumes without recomputing.

The scheduler decides which pages move (`scheduler/host_pages.py`); this pool only holds the
host tensors and executes the copies of a step plan's `KVTransfer`s. Under tensor parallelism
every rank has its own pool and runs the same transfers on its shard of the pages.

The order of the copies matters on an accelerator, where they are asynchronous:

- offload: the pages are gathered on the device, copied into a pinned staging buffer, and only
  when that copy has landed (`fence().synchronize()`) scattered into the pool's pages on the
  host. Reading the staging buffer earlier would read what was there before.
- restore: the pool's pages are gathered into the staging buffer on the host, copied to the
  device and scattered into the cache's pages there (ordered after the copy on the stream); the
  staging buffer is written again only once that copy has read it.

The copies go through a `copies` object: `CudaCopies` (non-blocking copies, an event as
fence), `SyncCopies` on a CPU, or a test's stand-in whose device-to-host copies land only when
the fence is waited on, as a DMA engine's may (tests/workers/test_kv_memory.py: without the fence the
pool would hold stale pages, and the test fails).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

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


class Fence(Protocol):
    def synchronize(self) -> None: ...


class Copies(Protocol):
    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def fence(self) -> Fence: ...


class _Done:
    def synchronize(self) -> None:
        pass


class SyncCopies:
    """A CPU engine: every copy is complete when it returns."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    to_device = to_host

    def fence(self) -> Fence:
        return _Done()


class CudaCopies:
    """Non-blocking copies on the current stream; the fence is an event recorded after them."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    to_device = to_host

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record()
        return event


class HostKVPool:
    def __init__(self, cache: PagedKVCache, num_blocks: int, copies: Copies | None = None) -> None:
        self.cache = cache
        self.num_blocks = num_blocks
        self.pin = cache.device.type == "cuda"
        self.copies = copies or (CudaCopies() if self.pin else SyncCopies())
        shape = (num_blocks, cache.page_size, cache.num_kv_heads, cache.head_dim)
        self.k = [torch.empty(shape, dtype=cache.dtype, pin_memory=self.pin) for _ in range(cache.num_layers)]
        self.v = [torch.empty(shape, dtype=cache.dtype, pin_memory=self.pin) for _ in range(cache.num_layers)]
        self._staging: list[torch.Tensor] = []  # per layer, K then V: [pages, page, heads, dim]
        self.node: Any = None  # the node pool's client (`workers/kv/node_client.py`), if any
        self.short_pulls: list[tuple[KVTransfer, int]] = []  # of the last `execute`

    def write_page(self, host_block: int, page: torch.Tensor) -> None:
        """Host page `host_block` of every layer from one page's bytes ([2, layers, page_size,
        kv_heads, head_dim] as uint8): a `pull`, run in order with the plan's other transfers
        (a restore of the page comes after it)."""
        shape = (2, self.cache.num_layers, *self.k[0].shape[1:])
        kv = page.view(self.cache.dtype).view(shape)
        for layer in range(self.cache.num_layers):
            self.k[layer][host_block] = kv[0, layer]
            self.v[layer][host_block] = kv[1, layer]

    def _staged(self, n: int) -> list[torch.Tensor]:
        """Staging buffers of at least `n` pages (grown geometrically), pinned on a GPU host."""
        if not self._staging or self._staging[0].shape[0] < n:
            size = max(n, 2 * self._staging[0].shape[0] if self._staging else 1)
            shape = (size, *self.k[0].shape[1:])
            self._staging = [torch.empty(shape, dtype=self.cache.dtype, pin_memory=self.pin)
                             for _ in range(2 * self.cache.num_layers)]
        return [s[:n] for s in self._staging]

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device cache, host pool) tensor pairs, K then V for each layer, in staging order."""
        return list(zip(self.cache.k + self.cache.v, self.k + self.v))

    def offload(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        device = torch.tensor(device_blocks, device=self.cache.device)
        host = torch.tensor(host_blocks)
        staging = self._staged(len(device_blocks))
        for (cached, _), stage in zip(self._layers(), staging):
            self.copies.to_host(stage, cached.index_select(0, device))
        self.copies.fence().synchronize()  # the device-to-host copies have landed in `staging`
        for (_, pool), stage in zip(self._layers(), staging):
            pool[host] = stage

    def restore(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        device = torch.tensor(device_blocks, device=self.cache.device)
        host = torch.tensor(host_blocks)
        staging = self._staged(len(device_blocks))
        for (cached, pool), stage in zip(self._layers(), staging):
            torch.index_select(pool, 0, host, out=stage)
            landed = torch.empty_like(stage, device=self.cache.device)
            self.copies.to_device(landed, stage)
            cached.index_copy_(0, device, landed)
        self.copies.fence().synchronize()  # `staging` has been read: it may be written again

    def execute(self, transfers: list[KVTransfer]) -> None:
        """Run a step plan's copies in order; they are complete when this returns. Pulls that
        copied fewer pages than planned are left in `short_pulls`, with the pages copied."""
        self.short_pulls = []
        for transfer in transfers:
            if transfer.kind == "offload":
                self.offload(list(transfer.device_blocks), list(transfer.host_blocks))
            elif transfer.kind == "restore":
                self.restore(list(transfer.device_blocks), list(transfer.host_blocks))
            elif transfer.kind == "pull":  # verified page by page: one changed since it was planned is a miss
                planned = len(transfer.host_blocks)
                copied = self.node.pull(list(transfer.tokens), transfer.first_page, planned,
                                        list(transfer.host_blocks), transfer.cache_salt)
                if copied < planned:
                    self.short_pulls.append((transfer, copied))
            else:  # export: a preempted request's pages, to the node pool
                self.node.publish(list(transfer.tokens), list(transfer.device_blocks), 0, len(transfer.device_blocks),
                                  transfer.cache_salt)
