"""The block manager alone: pages allocated all or nothing, reference counts of shared prefix
pages, prefix matches of registered full pages only (never the last token, never across salts),
least recently freed pages reused first, and pages released behind a sliding window."""

from __future__ import annotations

from cbserve.scheduler.block_manager import RELEASED, BlockManager
from cbserve.scheduler.request import Request

PAGE = 4


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    r = Request(rid, list(tokens), 4, frozenset())
    r.cache_salt = salt
    return r


def computed(bm: BlockManager, r: Request) -> Request:
    """All its tokens in the cache and its full pages registered (what `Scheduler.update` does)."""
    assert bm.allocate(r, r.num_tokens)
    r.num_computed = r.num_tokens
    bm.register_full_pages(r)
    return r


def test_allocate_is_all_or_nothing_and_free_gives_pages_back() -> None:
    bm = BlockManager(4, PAGE, False)
    a, b = request("a", range(9)), request("b", range(6))
    assert bm.allocate(a, 9) and len(a.block_ids) == 3 and bm.num_free == 1
    assert not bm.allocate(b, 6) and b.block_ids == [] and bm.num_free == 1  # needs 2: none taken
    assert bm.allocate(a, 12) and len(a.block_ids) == 3  # the same pages hold 12 tokens
    bm.free(a)
    assert a.block_ids == [] and a.num_computed == 0 and bm.num_free == 4 and bm.peak_used == 3


def test_a_shared_prefix_is_counted_and_outlives_its_first_owner() -> None:
    bm = BlockManager(8, PAGE, True)
    first = computed(bm, request("first", range(10)))
    second = request("second", list(range(8)) + [50, 51, 52])
    bm.match_prefix(second)
    assert second.block_ids == first.block_ids[:2] and second.num_computed == 8 and second.num_hashed_blocks == 2
    assert [bm.blocks[i].ref_count for i in first.block_ids] == [2, 2, 1]
    bm.free(first)
    assert [bm.blocks[i].ref_count for i in second.block_ids] == [1, 1] and bm.num_free == 6
    third = request("third", range(10))  # matches what is still cached (page 2 of `first` is free, still hashed)
    bm.match_prefix(third)
    assert third.num_computed == 8 and third.block_ids == second.block_ids


def test_the_last_token_and_unregistered_pages_are_never_matched() -> None:
    bm = BlockManager(8, PAGE, True)
    computed(bm, request("a", range(8)))
    same = request("same", range(8))  # its two pages are cached, but its last token must be computed
    bm.match_prefix(same)
    assert same.num_computed == 4
    partial = request("partial", range(6))
    assert bm.allocate(partial, 6)
    partial.num_computed = 3  # page 0 not full yet: nothing registered
    bm.register_full_pages(partial)
    other = request("other", [100, 101, 102, 103, 104])
    bm.match_prefix(other)
    assert other.num_computed == 0 and other.block_ids == []


def test_salts_never_share_pages() -> None:
    bm = BlockManager(8, PAGE, True)
    computed(bm, request("a", range(9), salt="x"))
    for salt, hit in ((None, 0), ("y", 0), ("x", 8)):
        r = request(f"r-{salt}", range(9), salt=salt)
        bm.match_prefix(r)
        assert r.num_computed == hit, salt
        bm.free(r)


def test_least_recently_freed_pages_are_reused_first() -> None:
    bm = BlockManager(4, PAGE, True)
    cached = computed(bm, request("cached", range(5)))  # page 0 hashed, page 1 holds one token
    pages = list(cached.block_ids)
    bm.free(cached)  # the tail goes to the free list first, the shared prefix last
    fresh = request("fresh", [90] * 8)
    assert bm.allocate(fresh, 8)
    assert pages[0] not in fresh.block_ids  # the 2 oldest free pages were the never-used ones
    again = request("again", range(6))
    bm.match_prefix(again)
    assert again.block_ids == [pages[0]]


def test_pages_behind_a_sliding_window_are_released() -> None:
    bm = BlockManager(8, PAGE, False)
    r = request("r", range(14))
    assert bm.allocate(r, 14)
    pages = list(r.block_ids)
    bm.release_before(r, 9)  # positions 0-7 unseen from now on: pages 0 and 1
    assert r.block_ids == [RELEASED, RELEASED, pages[2], pages[3]] and bm.num_free == 6
    bm.release_before(r, 9)  # idempotent
    assert bm.num_free == 6 and r.num_released_blocks == 2
    bm.free(r)  # released entries are skipped
    assert bm.num_free == 8


def test_pages_are_shared_only_within_one_lora_adapter() -> None:
    """A request's LoRA adapter roots its hash chain: the same tokens under another adapter, the
    base model, or a salt are misses; under the same adapter (and salt) hits."""
    from cbserve.scheduler.request import Request

    bm = BlockManager(num_blocks=64, page_size=4, enable_prefix_caching=True)
    tokens = list(range(10, 23))  # three full pages can come from cache

    def computed(lora_id: int | None, salt: str | None = None) -> int:
        r = Request(request_id=f"{lora_id}-{salt}", prompt_ids=list(tokens), max_new_tokens=1,
                    eos_token_ids=frozenset(), cache_salt=salt, lora_id=lora_id)
        bm.match_prefix(r)
        hit = r.num_computed
        assert bm.allocate(r, r.num_tokens)
        r.num_computed = r.num_tokens
        bm.register_full_pages(r)
        bm.free(r)
        return hit

    assert computed(None) == 0
    assert computed(1) == 0 and computed(2) == 0 and computed(1, "a") == 0
    assert computed(1) == 12 and computed(2) == 12 and computed(1, "a") == 12 and computed(None) == 12
    assert computed(None, "a") == 0  # the salt alone is none of the adapter roots
