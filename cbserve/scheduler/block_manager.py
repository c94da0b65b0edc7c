"""KV pages: allocation with reference counts, and prefix caching by chained page hashes.

A "block" here is one page index; the same index addresses that page in every layer's cache.
A full page is identified by a hash chaining its parent's hash with its tokens; a hit also
compares the tokens and the parent. Pages of finished requests keep their hash and stay reusable
until their memory is needed again (least recently freed are reused first).

A request's `cache_salt` (vLLM's) is the parent of its first page (a stable digest of it; no
salt: NO_HASH), so the whole chain differs per salt: its prefix pages are never shared with a
request of another salt or of none, even for the same tokens. A request's LoRA adapter (its
`lora_id`) roots the chain the same way: its pages hold K/V its adapter computed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from cbserve.scheduler.request import Request

NO_HASH = -1
RELEASED = -1  # a block table entry whose page was given back (out of every window)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()
    parent: int = NO_HASH  # the hash this page's hash chains from (the salt root for a first page)


def page_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def salt_root(cache_salt: str | None, lora_id: int | None = None) -> int:
    """The parent hash of a request's first page: NO_HASH without a salt or an adapter, else a
    digest of them (blake2b: stable across processes, and not steerable onto another salt's root;
    an adapter's roots are digested under their own `person`, so no salt can reach one)."""
    if cache_salt is None and lora_id is None:
        return NO_HASH
    if lora_id is None:
        digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"cbserve-salt")
    else:
        salt = b"" if cache_salt is None else b"=" + cache_salt.encode()
        digest = hashlib.blake2b(b"%d" % lora_id + salt, digest_size=8, person=b"cbserve-lora")
    return int.from_bytes(digest.digest(), "little", signed=True)


def chain_root(request: Request) -> int:
    return salt_root(request.cache_salt, request.lora_id)


class BlockManager:
    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is the order pages were freed: the oldest is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation --------------------------------------------------------------------------

    def _take_free(self) -> Block:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:  # its cached content is about to be overwritten
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash, block.token_ids, block.parent = NO_HASH, (), NO_HASH
        block.ref_count = 1
        return block

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def prompt_hashes(self, request: Request) -> list[int]:
        """The hash chain of the request's full prompt pages, computed once."""
        if request.prompt_page_hashes is None:
            chain, parent, ps = [], chain_root(request), self.page_size
            for i in range(len(request.prompt_ids) // ps):
                parent = page_hash(parent, tuple(request.prompt_ids[i * ps : (i + 1) * ps]))
                chain.append(parent)
            request.prompt_page_hashes = chain
        return request.prompt_page_hashes

    def pages_in_flight(self, request: Request) -> list[int]:
        """Hashes of the prompt pages this request has yet to compute."""
        if not self.enable_prefix_caching or request.num_pending <= 1:
            return []
        return self.prompt_hashes(request)[request.num_computed // self.page_size :]

    def waits_for_prefix(self, request: Request, in_flight: set[int]) -> bool:
        """True when the request's next uncached page is being computed by a running request:
        admitting it later serves that page from cache instead of computing it twice."""
        if not self.enable_prefix_caching or not in_flight:
            return False
        next_page = len(request.block_ids)
        if next_page >= (request.num_tokens - 1) // self.page_size:
            return False  # the remaining pages could never be served from cache
        hashes = self.prompt_hashes(request)
        return next_page < len(hashes) and hashes[next_page] in in_flight

    def match_prefix(self, request: Request) -> None:
        """Attach cached full pages of the request's tokens; the last token is always computed."""
        if not self.enable_prefix_caching or request.block_ids:
            return
        parent = chain_root(request)
        max_pages = (request.num_tokens - 1) // self.page_size
        for i in range(max_pages):
            tokens = tuple(request.tokens[i * self.page_size : (i + 1) * self.page_size])
            h = page_hash(parent, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens or self.blocks[block_id].parent != parent:
                break
            self._share(self.blocks[block_id])
            request.block_ids.append(block_id)
            parent = h
        request.num_hashed_blocks = len(request.block_ids)
        request.num_computed = len(request.block_ids) * self.page_size

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Give the request enough pages to hold `num_tokens` tokens; all or nothing."""
        missing = self.pages_needed(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.num_free:
            return False
        request.block_ids.extend(self._take_free().block_id for _ in range(missing))
        self.peak_used = max(self.peak_used, self.num_blocks - self.num_free)
        return True

    def free(self, request: Request) -> None:
        """Release the request's pages; the last pages go to the free list first so that
        a shared prefix outlives its tails."""
        for block_id in reversed(request.block_ids):
            if block_id == RELEASED:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        request.block_ids = []
        request.num_hashed_blocks = 0
        request.num_released_blocks = 0
        request.num_computed = 0

    def release_before(self, request: Request, position: int) -> None:
        """Free the request's pages that hold only positions before `position`: with sliding
        window attention no future query can see them, so a request keeps a ring of about
        window / page_size pages however long it grows."""
        num_dead = min(max(position, 0) // self.page_size, len(request.block_ids))
        for i in range(request.num_released_blocks, num_dead):
            block = self.blocks[request.block_ids[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
            request.block_ids[i] = RELEASED
        request.num_released_blocks = max(request.num_released_blocks, num_dead)

    # -- prefix caching ----------------------------------------------------------------------

    def register_full_pages(self, request: Request) -> None:
        """Hash the pages that the last step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed // self.page_size, len(request.block_ids))
        i = request.num_hashed_blocks
        if i >= num_full:
            return
        parent = self.blocks[request.block_ids[i - 1]].hash if i > 0 else chain_root(request)
        for i in range(request.num_hashed_blocks, num_full):
            block = self.blocks[request.block_ids[i]]
            tokens = tuple(request.tokens[i * self.page_size : (i + 1) * self.page_size])
            block.parent, parent = parent, page_hash(parent, tokens)
            block.hash, block.token_ids = parent, tokens
            self._hash_to_block.setdefault(parent, block.block_id)
        request.num_hashed_blocks = num_full
