"""The scheduler alone, without a model (as vLLM's tests/v1/core): requests of fake tokens, each
step's plan taken back with a fake `StepResult` through `Scheduler.update`, which does all the
bookkeeping (tokens computed, status, pages registered, released and freed, finishing)."""

from __future__ import annotations

from cbserve.errors import RequestFault
from cbserve.outputs import FinishReason, RequestStatus
from cbserve.scheduler.block_manager import RELEASED, BlockManager
from cbserve.scheduler.host_pages import HostPages
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import Scheduler, StepPlan, StepResult

PAGE = 4


def scheduler(max_batch_tokens: int = 64, max_requests: int = 8, num_blocks: int = 64, prefix_caching: bool = False,
              policy: str = "fifo", host_blocks: int = 0, release_window: int | None = None,
              node=None) -> Scheduler:
    host = HostPages(host_blocks, PAGE, node) if host_blocks else None
    return Scheduler(BlockManager(num_blocks, PAGE, prefix_caching), max_batch_tokens, max_requests, policy, 0.0,
                     host, release_window=release_window)


def request(rid: str, prompt_len: int = 6, max_new: int = 4, eos: tuple[int, ...] = (), first: int = 10,
            **sampling) -> Request:
    return Request(rid, list(range(first, first + prompt_len)), max_new, frozenset(eos), SamplingParams(**sampling))


def entries(plan: StepPlan) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_query_tokens, s.sample) for s in plan.batch]


def result(plan: StepPlan, token: int = 7) -> StepResult:
    """The fake sampler: `token` for every sampled row."""
    sampled = [s.request for s in plan.batch if s.sample]
    return StepResult([token] * len(sampled), requests=sampled)


def step(s: Scheduler, token: int = 7) -> StepPlan:
    plan = s.schedule()
    s.update(plan, result(plan, token))
    return plan


def test_admission_within_the_token_and_request_budgets() -> None:
    s = scheduler(max_batch_tokens=10, max_requests=2)
    a, b, c = (request(r, prompt_len=6) for r in "abc")
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    assert entries(plan) == [("a", 6, True), ("b", 4, False)]  # b's prompt is chunked; c is over max_requests
    assert s.running == [a, b] and list(s.waiting) == [c]
    assert a.status == b.status == RequestStatus.PREFILLING and c.status == RequestStatus.PENDING
    assert len(a.block_ids) == 2 and len(b.block_ids) == 1  # pages for the tokens computed this step only


def test_update_moves_a_chunked_prefill_on_until_its_first_token() -> None:
    s = scheduler(max_batch_tokens=4)
    r = request("r", prompt_len=10)
    s.add(r)
    seen = []
    for _ in range(3):
        plan = step(s)
        seen.append((entries(plan), r.num_computed, r.status, list(r.generated)))
    assert seen == [
        ([("r", 4, False)], 4, RequestStatus.PREFILLING, []),
        ([("r", 4, False)], 8, RequestStatus.PREFILLING, []),
        ([("r", 2, True)], 10, RequestStatus.DECODING, [7]),
    ]
    plan = step(s, token=8)  # a decode: the sampled token goes in, one more computed
    assert entries(plan) == [("r", 1, True)] and r.num_computed == 11 and r.generated == [7, 8]
    assert s.num_prompt_tokens == 10 and s.num_generated_tokens == 2 and s.num_steps == 4


def test_decodes_go_first_unless_prefill_first() -> None:
    for policy, order in (("fifo", ["old", "new"]), ("prefill_first", ["new", "old"])):
        s = scheduler(policy=policy)
        old = request("old", prompt_len=3)
        s.add(old)
        step(s)  # old now decodes
        s.add(request("new", prompt_len=5))
        assert [rid for rid, _, _ in entries(s.schedule())] == order, policy


def test_finishing_on_eos_stop_token_and_max_tokens_frees_the_pages() -> None:
    s = scheduler()
    eos, stop, length = request("eos", eos=(3,)), request("stop", stop_token_ids=(3,)), request("len", max_new=1)
    ignored = request("ignored", eos=(3,), ignore_eos=True)
    for r in (eos, stop, length, ignored):
        s.add(r)
    plan = s.schedule()
    updated = s.update(plan, result(plan, token=3))
    assert updated == [eos, stop, length, ignored]
    assert [(r.status, r.finish_reason) for r in (eos, stop, length)] == [
        (RequestStatus.FINISHED, FinishReason.EOS), (RequestStatus.FINISHED, FinishReason.STOP),
        (RequestStatus.FINISHED, FinishReason.LENGTH)]
    assert ignored.live and s.running == [ignored]
    assert all(r.block_ids == [] for r in (eos, stop, length))
    assert s.block_manager.num_free == s.block_manager.num_blocks - len(ignored.block_ids)


def test_faults_fail_their_request_alone() -> None:
    s = scheduler()
    none_drawn, refused, fine = request("none"), request("refused"), request("fine")
    for r in (none_drawn, refused, fine):
        s.add(r)
    plan = s.schedule()
    f1, f2 = RequestFault("suppress_tokens", "no token left"), RequestFault("grammar", "refused")
    updated = s.update(plan, StepResult([5, 6], requests=[refused, fine], faults=[(none_drawn, f1), (refused, f2)]))
    assert updated == [none_drawn, refused, fine]
    assert (none_drawn.status, none_drawn.exception, none_drawn.generated) == (RequestStatus.FAILED, f1, [])
    assert (refused.status, refused.exception, refused.generated) == (RequestStatus.FAILED, f2, [5])  # kept
    assert fine.generated == [6] and s.running == [fine]
    assert s.block_manager.num_free == s.block_manager.num_blocks - len(fine.block_ids)


def test_tokens_in_flight_are_counted_then_handed_over() -> None:
    s = scheduler()
    r = request("r", prompt_len=5)
    s.add(r)
    plan = s.schedule()
    assert s.update(plan, None) == []  # async batching: the token is still on the device
    assert r.num_computed == 5 and r.num_inflight == 1 and r.num_pending == 1 and r.generated == []
    nxt = s.schedule()  # the next pass decodes the token the host has not seen yet
    assert entries(nxt) == [("r", 1, True)]
    assert s.update(None, result(plan, token=9)) == [r]
    assert r.num_inflight == 0 and r.generated == [9]
    s.update(nxt, None)
    assert r.num_computed == 6 and r.num_inflight == 1


def test_a_row_of_a_request_that_ended_meanwhile_is_dropped() -> None:
    s = scheduler()
    r = request("r")
    s.add(r)
    plan = s.schedule()
    s.finish(r, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    assert s.update(plan, result(plan)) == []
    assert r.generated == [] and r.num_computed == 0 and s.block_manager.num_free == s.block_manager.num_blocks


def until_preempted(s: Scheduler) -> StepPlan:
    """Steps until one preempts; that step's plan, not yet taken back."""
    while True:
        plan = s.schedule()
        if s.num_preemptions:
            return plan
        s.update(plan, result(plan))


def test_preemption_recomputes_the_latest_admitted() -> None:
    s = scheduler(num_blocks=4)  # 16 tokens of cache: two 6-token prompts, then they grow past 8
    a, b = request("a", max_new=8), request("b", max_new=8)
    s.add(a)
    s.add(b)
    plan = until_preempted(s)
    assert entries(plan) == [("a", 1, True)] and plan.transfers == [] and s.num_recomputes == 1
    assert s.running == [a] and list(s.waiting) == [b]
    assert (b.status, b.num_computed, b.block_ids, b.generated) == (RequestStatus.PENDING, 0, [], [7, 7, 7])
    s.update(plan, result(plan))
    while s.has_work:
        step(s)
    assert a.generated == b.generated == [7] * 8
    assert s.block_manager.num_free == 4


def test_preemption_offloads_to_host_pages_and_restores() -> None:
    s = scheduler(num_blocks=4, host_blocks=8)
    a, b = request("a", max_new=8), request("b", max_new=8)
    s.add(a)
    s.add(b)
    plan = until_preempted(s)
    [offload] = plan.transfers
    assert offload.kind == "offload" and len(offload.device_blocks) == len(offload.host_blocks) == 2
    assert s.num_recomputes == 0 and b.num_offloaded_tokens == 8
    assert b.status == RequestStatus.PENDING and b.block_ids == [] and len(b.host_block_ids) == 2
    s.update(plan, result(plan))
    while b.status == RequestStatus.PENDING:
        plan = step(s)
    [restore] = plan.transfers
    assert restore.kind == "restore" and restore.host_blocks == offload.host_blocks
    assert b.num_computed == 9 and b.host_block_ids == [] and s.host_pages.num_restores == 1  # 8 restored, 1 computed


def test_full_pages_are_registered_and_shared_with_a_later_prompt() -> None:
    s = scheduler(prefix_caching=True)
    first = request("first", prompt_len=9, max_new=1)
    s.add(first)
    plan = s.schedule()
    pages = list(first.block_ids)
    s.update(plan, result(plan))  # 9 tokens computed: pages 0 and 1 full, hashed; finished, pages kept cached
    assert first.status == RequestStatus.FINISHED and s.block_manager.num_free == s.block_manager.num_blocks
    second = request("second", prompt_len=10)
    s.add(second)
    plan = s.schedule()
    assert entries(plan) == [("second", 2, True)] and second.num_computed == 8 and s.prefix_hit_tokens == 8
    assert second.block_ids[:2] == pages[:2]


def test_sliding_window_pages_are_released_as_the_request_grows() -> None:
    s = scheduler(max_batch_tokens=4, release_window=4)
    r = request("r", prompt_len=12, max_new=2)
    s.add(r)
    for _ in range(3):
        step(s)
    assert r.num_computed == 12 and r.block_ids[:2] == [RELEASED, RELEASED]  # positions 0-7: out of the window
    assert s.block_manager.num_free == s.block_manager.num_blocks - 1  # page 2 (positions 8-11) only


class FakeNode:
    """A node pool holding the first `held` pages of any prompt; no copy when asked."""

    def __init__(self, held: int) -> None:
        self.held = held

    def holds(self, tokens: list[int], first_page: int, num_pages: int, cache_salt: str | None = None) -> int:
        return max(0, min(self.held - first_page, num_pages))


def test_a_node_pool_pull_is_planned_as_transfers_and_a_short_one_computes_from_its_last_page() -> None:
    s = scheduler(host_blocks=8, prefix_caching=True, node=FakeNode(held=3))
    r = request("r", prompt_len=18)
    s.add(r)
    plan = s.schedule()
    pull, restore = plan.transfers
    assert (pull.kind, pull.first_page, pull.request_id, len(pull.host_blocks)) == ("pull", 0, "r", 3)
    assert pull.tokens == tuple(r.tokens[:12])
    assert (restore.kind, restore.host_blocks, restore.device_blocks) == ("restore", pull.host_blocks,
                                                                         tuple(r.block_ids[:3]))
    assert entries(plan) == [("r", 6, True)] and r.num_computed == 12
    s.pulled_short(plan, [(pull, 1)])  # one page only was still there when the pull ran
    assert entries(plan) == [("r", 6, False)] and r.num_computed == 4
    assert s.host_pages.num_node_hit_tokens == 4 and s.prefix_hit_tokens == 4
    s.update(plan, result(plan))
    assert r.num_computed == 10 and r.generated == []
    plan = step(s)
    assert entries(plan) == [("r", 8, True)] and r.generated == [7]



def test_running_requests_use_at_most_max_loras_adapters() -> None:
    """LoRA: a request of a third adapter waits while two adapters run (max_loras=2), whatever room
    there is; requests of the base model and of running adapters are admitted meanwhile."""
    s = Scheduler(BlockManager(64, PAGE, False), 64, 8, "fifo", 0.0, max_loras=2)
    reqs = [request(f"r{i}", max_new=2) for i in range(5)]
    for r, lora_id in zip(reqs, [1, 2, 3, None, 1]):
        r.lora_id = lora_id
        s.add(r)
    plan = step(s)
    assert [e[0] for e in entries(plan)] == ["r0", "r1", "r3", "r4"]
    while "r2" not in [e[0] for e in entries(plan)]:  # once adapter 1 or 2 has no running request
        assert len({r.lora_id for r in s.running if r.lora_id is not None}) <= 2
        plan = step(s)
    assert not {"r0", "r1"} <= {r.request_id for r in s.running}
