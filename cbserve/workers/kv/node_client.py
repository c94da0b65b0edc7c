"""An engine's side of the per-node KV pool (`node_pool.py`): it pulls the pages of a missed
prefix into the engine's host pool for the scheduler (`scheduler/host_pages.HostPages.pull`),
and publishes pages to the pool: each request's prompt pages once computed (skipping those the
pool holds already, so a shared system prompt is copied once per node), and the full pages of a
request preempted without room in the host pool (`export` transfers).

Keys chain from a salt that fingerprints the model (its text config, dtype and a few weights)
and the page geometry, so engines of different models never share pages even if their pages
have the same size; a request's `cache_salt` is mixed into that root (`chain_root`), so its
pages are shared only with requests of the same salt, as in the engine's own prefix cache.
"""

from __future__ import annotations

import hashlib
import logging
import weakref

import torch

from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.kv.host_pool import HostKVPool
from cbserve.workers.kv.node_pool import NodeKVPool, chain_keys, to_signed

logger = logging.getLogger(__name__)


def model_fingerprint(model: torch.nn.Module, cache: PagedKVCache) -> int:
    cfg = model.config.get_text_config().to_dict()
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(sorted((k, repr(v)) for k, v in cfg.items() if not k.startswith("_"))).encode())
    h.update(repr((str(cache.dtype), cache.page_size, cache.num_layers, cache.num_kv_heads, cache.head_dim)).encode())
    embedding = model.get_input_embeddings()
    first_rows = embedding.weight[:4] if hasattr(embedding, "weight") else embedding(torch.arange(4))  # quantized
    for t in (first_rows, next(iter(reversed(list(model.parameters())))).reshape(-1)[:64]):
        h.update(t.detach().to("cpu", torch.float64).numpy().tobytes())
    return to_signed(int.from_bytes(h.digest(), "little"))


def chain_root(fingerprint: int, cache_salt: str | None) -> int:
    """The parent key of a request's first page: the model's fingerprint, salted by the request's
    `cache_salt` when it has one."""
    if cache_salt is None:
        return fingerprint
    h = hashlib.blake2b(fingerprint.to_bytes(8, "little", signed=True), digest_size=8, person=b"cbserve-salt")
    h.update(cache_salt.encode())
    return to_signed(int.from_bytes(h.digest(), "little"))


class NodePoolClient:
    def __init__(self, pool: NodeKVPool, cache: PagedKVCache, host_pool: HostKVPool, salt: int) -> None:
        self.pool, self.cache, self.host_pool, self.salt = pool, cache, host_pool, salt
        self.page_size = cache.page_size
        self.page_bytes = PagedKVCache.bytes_per_block(cache.num_layers, cache.page_size, cache.num_kv_heads,
                                                       cache.head_dim, cache.dtype)
        self.usable = pool.format(self.page_size, self.page_bytes, salt)
        if not self.usable:
            logger.warning("node KV pool %s holds other pages (another model, dtype or page size): not used",
                           pool.path)
        self._published: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> prompt pages
        self.num_pulled = self.num_published = 0

    def _live(self) -> bool:
        if self.usable and not self.pool.alive():
            logger.warning("node KV pool %s closed or its owner died: no longer used", self.pool.path)
            self.usable = False
        return self.usable

    @staticmethod
    def _parent(keys: list[int], page: int, root: int) -> int:
        return keys[page - 1] if page else root

    def holds(self, tokens: list[int], first_page: int, num_pages: int, cache_salt: str | None = None) -> int:
        """How many of pages `first_page`, `first_page + 1`, ... of `tokens` (up to `num_pages`)
        the pool holds now, in a row: what the scheduler plans to pull (no copy; `pull` verifies)."""
        if not self._live():
            return 0
        root = chain_root(self.salt, cache_salt)
        keys = chain_keys(tokens, self.page_size, first_page + num_pages, root)
        held = 0
        while held < num_pages and self.pool.holds(keys[first_page + held],
                                                   self._parent(keys, first_page + held, root)):
            held += 1
        return held

    def pull(self, tokens: list[int], first_page: int, num_pages: int, host_blocks: list[int],
             cache_salt: str | None = None) -> int:
        if not self._live():
            return 0
        root = chain_root(self.salt, cache_salt)
        keys = chain_keys(tokens, self.page_size, first_page + num_pages, root)
        ps, got = self.page_size, 0
        for i in range(num_pages):
            page = first_page + i
            data = self.pool.fetch(keys[page], self._parent(keys, page, root), tokens[page * ps : (page + 1) * ps])
            if data is None:  # absent, being rewritten, or failing its checks: a miss
                break
            self.host_pool.write_page(host_blocks[i], data)
            got += 1
        self.num_pulled += got
        return got

    def after_step(self, batch: list) -> None:
        """Publish the prompt pages the step completed."""
        for s in batch:
            request = s.request
            done = min(request.num_computed, len(request.prompt_ids)) // self.page_size
            start = self._published.get(request, 0)
            if done > start:
                self.publish(request.tokens, request.block_ids, start, done, request.cache_salt)
                self._published[request] = done

    def publish(self, tokens: list[int], block_ids: list[int], start: int, stop: int,
                cache_salt: str | None = None) -> None:
        """Pages [start, stop) of `tokens` (of a request with `cache_salt`), held by device pages
        `block_ids[start:stop]`, to the pool (those it holds already are skipped)."""
        if not self._live():
            return
        root = chain_root(self.salt, cache_salt)
        keys = chain_keys(tokens, self.page_size, stop, root)
        todo = [i for i in range(start, stop) if not self.pool.holds(keys[i], self._parent(keys, i, root))]
        if not todo:
            return
        pages = self._device_pages([block_ids[i] for i in todo])
        ps = self.page_size
        for page, i in zip(pages, todo):
            self.num_published += self.pool.store(keys[i], self._parent(keys, i, root), tokens[i * ps : (i + 1) * ps],
                                                  page)

    def _device_pages(self, blocks: list[int]) -> torch.Tensor:
        """[n, page_bytes] uint8 on the host: K and V of every layer for each device page (a
        blocking copy: complete on return)."""
        index = torch.tensor(blocks, device=self.cache.device)
        kv = torch.stack([torch.stack([t.index_select(0, index) for t in self.cache.k]),
                          torch.stack([t.index_select(0, index) for t in self.cache.v])])  # [2, L, n, ...]
        host = kv.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        return host.reshape(len(blocks), -1).view(torch.uint8)


def attach(name: str | None, model: torch.nn.Module, cache: PagedKVCache, host_pool: HostKVPool | None,
           host_pages, prefix_caching: bool) -> NodePoolClient | None:
    """The engine's client of node pool `name` (None: no node pool), wired to its host pool and
    its scheduler's host pages; None when the pool holds other pages. Refuses (ValueError) an
    engine that could never use one, rather than ignoring the setting."""
    if name is None:
        return None
    if host_pool is None:
        raise ValueError(f"node_kv_pool {name!r} needs a host pool to stage pulled pages in: cpu_offload_space "
                         "gave this engine none")
    if not prefix_caching:
        raise ValueError(f"node_kv_pool {name!r} needs prefix caching, which is off for this engine "
                         "(allow_block_sharing=False, or the model has sliding-window layers)")
    client = NodePoolClient(NodeKVPool.attach(name), cache, host_pool, model_fingerprint(model, cache))
    if not client.usable:
        return None
    host_pool.node = host_pages.node = client
    return client
