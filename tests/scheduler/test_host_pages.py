"""Host pages alone: offload, restore and node pool pulls are planned as `KVTransfer`s, nothing
copied while planning; host pages freed by a plan are reused from the next plan on."""

from __future__ import annotations

import pytest

from cbserve.scheduler.host_pages import HostPages
from cbserve.scheduler.request import Request

PAGE = 4


def request(rid: str, num_tokens: int, computed: int = 0, blocks: list[int] | None = None) -> Request:
    r = Request(rid, list(range(num_tokens)), 4, frozenset())
    r.num_computed, r.block_ids = computed, list(blocks or [])
    return r


class AskOnly:
    """A node pool that says which pages it holds and has no way to copy one."""

    def __init__(self, held: int) -> None:
        self.held, self.asked = held, []

    def holds(self, tokens, first_page, num_pages, cache_salt=None) -> int:
        self.asked.append((first_page, num_pages, cache_salt))
        return min(max(self.held - first_page, 0), num_pages)


def test_offload_plans_the_computed_pages_when_there_is_room() -> None:
    hp = HostPages(3, PAGE)
    r = request("r", 10, computed=9, blocks=[7, 8, 9])
    t = hp.offload(r)
    assert (t.kind, t.device_blocks, len(t.host_blocks)) == ("offload", (7, 8, 9), 3)
    assert r.host_block_ids == list(t.host_blocks) and r.num_offloaded_tokens == 9 and hp.num_free == 0
    assert hp.offload(request("s", 5, computed=5, blocks=[1, 2])) is None  # no room: recomputed instead


def test_restore_plans_the_copy_back_and_frees_the_host_pages_from_the_next_plan() -> None:
    hp = HostPages(2, PAGE)
    r = request("r", 8, computed=8, blocks=[3, 4])
    offload = hp.offload(r)
    r.block_ids, r.num_computed = [5, 6], 0  # readmitted into other device pages
    t = hp.restore(r)
    assert (t.kind, t.device_blocks, t.host_blocks) == ("restore", (5, 6), offload.host_blocks)
    assert r.num_computed == 8 and r.host_block_ids == [] and r.num_offloaded_tokens == 0
    assert hp.offload(request("s", 4, computed=4, blocks=[1])) is None  # not in this plan: the restore reads them
    hp.begin_step()
    assert hp.offload(request("s", 4, computed=4, blocks=[1])) is not None


@pytest.mark.parametrize("held, pulled", [(1, 0), (3, 2), (9, 3)])
def test_a_pull_is_planned_after_the_local_prefix_never_with_the_last_token(held: int, pulled: int) -> None:
    node = AskOnly(held)
    hp = HostPages(8, PAGE, node)
    r = request("r", 17, blocks=[11])  # one page matched locally; 17 tokens: pages 1-3 may come from the pool
    r.cache_salt = "salt"
    t = hp.pull(r)
    assert node.asked == [(1, 3, "salt")]
    if not pulled:
        assert t is None and r.host_block_ids == [] and hp.num_free == 8
        return
    assert (t.kind, t.first_page, t.request_id, t.cache_salt, t.device_blocks) == ("pull", 1, "r", "salt", ())
    assert len(t.host_blocks) == pulled and t.tokens == tuple(r.tokens[: (1 + pulled) * PAGE])
    assert r.num_offloaded_tokens == (1 + pulled) * PAGE and hp.num_node_hit_tokens == pulled * PAGE
    assert hp.pulled(r) and hp.num_free == 8 - pulled
    r.block_ids += [20, 21, 22, 23]
    restore = hp.restore(r)  # into the pages after the local prefix
    assert restore.device_blocks == (20, 21, 22)[:pulled] and restore.host_blocks == t.host_blocks
    assert r.num_computed == (1 + pulled) * PAGE


def test_a_pull_needs_host_room() -> None:
    node = AskOnly(9)
    hp = HostPages(1, PAGE, node)
    t = hp.pull(request("r", 17))
    assert len(t.host_blocks) == 1 and node.asked == [(0, 1, None)]
