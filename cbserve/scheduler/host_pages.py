"""Which host-pool pages hold which evicted request's KV: bookkeeping only, no tensors.

The scheduler decides offloads and restores and records them as `KVTransfer`s in its step plan;
the engine executes the copies (`workers/kv/host_pool.py`) before the step's forward pass, in
the order they were decided, so a page freed by one transfer may be reused by a later one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cbserve.scheduler.request import Request


@dataclass(frozen=True)
class KVTransfer:
    """Copy pages between the device cache and the host pool: `offload` device -> host,
    `restore` host -> device, page i of one side to page i of the other."""

    kind: Literal["offload", "restore"]
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]


class HostPages:
    def __init__(self, num_blocks: int, page_size: int) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free = list(range(num_blocks))
        self.num_offloads = 0
        self.num_restores = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def offload(self, request: Request) -> KVTransfer | None:
        """Give the request host pages for its computed tokens; None when the pool lacks room."""
        pages = -(-request.num_computed // self.page_size)
        if pages == 0 or pages > len(self._free):
            return None
        host_ids = [self._free.pop() for _ in range(pages)]
        request.host_block_ids = host_ids
        request.num_offloaded_tokens = request.num_computed
        self.num_offloads += 1
        return KVTransfer("offload", tuple(request.block_ids[:pages]), tuple(host_ids))

    def restore(self, request: Request) -> KVTransfer:
        """Back into the request's (already allocated) device pages; its host pages are free again."""
        transfer = KVTransfer("restore", tuple(request.block_ids[: len(request.host_block_ids)]),
                              tuple(request.host_block_ids))
        request.num_computed = request.num_offloaded_tokens
        self.release(request)
        self.num_restores += 1
        return transfer

    def release(self, request: Request) -> None:
        """Forget the request's host pages (restored, cancelled or failed)."""
        self._free.extend(request.host_block_ids)
        request.host_block_ids = []
        request.num_offloaded_tokens = 0
