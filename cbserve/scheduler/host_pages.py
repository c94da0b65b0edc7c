"""Which host-pool pages hold which evicted request's KV: bookkeeping only, no tensors.

The scheduler decides offloads and restores and records them as `KVTransfer`s in its step plan;
the engine executes the copies (`workers/kv/host_pool.py`) before the step's forward pass, in
the order they were decided. Host pages freed while a step is planned (a restore's) become
reusable only from the next step on, so that no transfer of a plan writes a page another
transfer of the same plan reads.

With a per-node KV pool (`node`, `workers/kv/node_pool.py`), a request admitted without its
whole prefix in the engine's own cache first asks the node pool which of the following pages it
holds: those are planned as a `pull` (node pool -> host pages, run with the plan's transfers)
followed by the `restore` of an offloaded request. A pull verifies each page it copies; one that
changed since the plan was made is a miss, and the request computes from there
(`Scheduler.pulled_short`). A request preempted when the host pool is full leaves its full
pages to the node pool (`export`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from cbserve.scheduler.request import Request


@dataclass(frozen=True)
class KVTransfer:
    """Copy pages between the device cache and the host pool: `offload` device -> host,
    `restore` host -> device, page i of one side to page i of the other; `export` device -> the
    node pool, the device pages holding `tokens` (whole pages, from the request's first) of a
    request with `cache_salt`; `pull` the node pool -> host pages, its pages `first_page`,
    `first_page + 1`, ... of `tokens` (request `request_id`'s) into `host_blocks`."""

    kind: Literal["offload", "restore", "export", "pull"]
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]
    tokens: tuple[int, ...] = ()
    cache_salt: str | None = None
    first_page: int = 0
    request_id: str = ""


class NodePages(Protocol):
    """The engine's side of the node pool, as the scheduler sees it."""

    def holds(self, tokens: list[int], first_page: int, num_pages: int, cache_salt: str | None = None) -> int:
        """How many of the node pool's pages `first_page`, `first_page + 1`, ... of `tokens` (up
        to `num_pages`, of requests with this `cache_salt`) it holds now, in a row; no copy."""
        ...


class HostPages:
    def __init__(self, num_blocks: int, page_size: int, node: NodePages | None = None) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.node = node
        self._free = list(range(num_blocks))
        self._released: list[int] = []  # free from the next step on
        self._first_page: dict[str, int] = {}  # pulled requests: where their host pages go
        self.num_offloads = 0
        self.num_restores = 0
        self.num_node_hit_tokens = 0
        self.num_exports = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._released)

    def begin_step(self) -> None:
        """A new plan: pages released while the last one was made may be reused."""
        self._free.extend(self._released)
        self._released.clear()

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
        first = self._first_page.get(request.request_id, 0)
        transfer = KVTransfer("restore", tuple(request.block_ids[first : first + len(request.host_block_ids)]),
                              tuple(request.host_block_ids))
        request.num_computed = request.num_offloaded_tokens
        self.release(request)
        self.num_restores += 1
        return transfer

    def release(self, request: Request) -> None:
        """Forget the request's host pages (restored, cancelled or failed)."""
        self._released.extend(request.host_block_ids)
        self._first_page.pop(request.request_id, None)
        request.host_block_ids = []
        request.num_offloaded_tokens = 0

    def pulled(self, request: Request) -> bool:
        """Its host pages came from the node pool (and go after its locally cached prefix)."""
        return request.request_id in self._first_page

    def pull(self, request: Request) -> KVTransfer | None:
        """After the request matched `len(block_ids)` pages in the engine's cache: the following
        pages the node pool holds, planned as a copy into host pages, which the request then
        restores as an offloaded one (`num_offloaded_tokens`). None: the pool holds none."""
        first, ps = len(request.block_ids), self.page_size
        wanted = min((request.num_tokens - 1) // ps - first, len(self._free))  # never the last token
        if self.node is None or wanted <= 0:
            return None
        got = self.node.holds(request.tokens, first, wanted, request.cache_salt)
        if got == 0:
            return None
        start = len(self._free) - wanted
        host_ids = self._free[start : start + got]
        del self._free[start : start + got]
        request.host_block_ids = host_ids
        request.num_offloaded_tokens = (first + got) * ps
        self._first_page[request.request_id] = first
        self.num_node_hit_tokens += got * ps
        return KVTransfer("pull", (), tuple(host_ids), tuple(request.tokens[: (first + got) * ps]),
                          request.cache_salt, first, request.request_id)

    def export(self, request: Request) -> KVTransfer | None:
        """A preempted request's full pages, for the node pool (None: no node pool, no full page)."""
        pages = min(request.num_computed // self.page_size, len(request.block_ids))
        if self.node is None or pages == 0:
            return None
        self.num_exports += 1
        return KVTransfer("export", tuple(request.block_ids[:pages]), (),
                          tuple(request.tokens[: pages * self.page_size]), request.cache_salt)
