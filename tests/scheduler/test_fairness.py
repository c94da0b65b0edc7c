"""Fair share between parent requests and tenants, and vLLM's `priority` (scheduler/fair_share.py).

Scheduler tests drive the scheduler alone with requests of fake tokens (no model): each step's
plan is applied as the engine would (tokens computed, one token sampled where the plan says so,
finished requests removed). The engine test checks that fair scheduling changes no token.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError
from cbserve.outputs import RequestStatus
from cbserve.scheduler.block_manager import BlockManager
from cbserve.scheduler.request import Request
from cbserve.scheduler.scheduler import ScheduledRequest, Scheduler
from cbserve.workers.factory import build_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model


def scheduler(max_batch_tokens: int = 256, max_requests: int = 64, num_blocks: int = 4096, page_size: int = 16,
              parent_share: float = 0.5, policy: str = "fifo") -> Scheduler:
    return Scheduler(BlockManager(num_blocks, page_size, False), max_batch_tokens, max_requests, policy, 0.0,
                     parent_share=parent_share)


def request(rid: str, prompt_len: int = 16, max_new: int = 50, tenant: str = "", parent: str | None = None,
            priority: int = 0) -> Request:
    r = Request(rid, [5] * prompt_len, max_new, frozenset())
    r.tenant, r.parent_id, r.priority = tenant, parent, priority
    return r


def step(s: Scheduler) -> list[ScheduledRequest]:
    """One step as the engine runs it, without a model: every sampled row gets token 7."""
    batch = s.schedule().batch
    for sr in batch:
        r = sr.request
        r.num_computed += sr.num_query_tokens
        if sr.sample:
            r.status = RequestStatus.DECODING
            r.append_token(7, None)
            if len(r.generated) >= r.max_new_tokens:
                s.remove(r)
                r.status = RequestStatus.FINISHED
    return batch


def fan_out(parent: str, n: int, tenant: str = "a", **kw) -> list[Request]:
    return [request(f"{parent}-{i}", tenant=tenant, parent=parent, **kw) for i in range(n)]


@pytest.mark.parametrize("tenant", ["a", "b"])
def test_single_request_admitted_in_the_next_step_behind_a_512_choice_parent(tenant: str) -> None:
    s = scheduler()
    for r in fan_out("big", 512):
        s.add(r)
    for _ in range(5):
        step(s)
    assert len(s.waiting) > 400  # the fan-out still has most of its choices waiting
    single = request("single", tenant=tenant, parent="single")
    s.add(single)
    assert single in [sr.request for sr in step(s)]
    running_big = sum(r.parent_id == "big" for r in s.running)
    assert running_big <= s.max_running_per_parent == 32  # half of max_requests: room for others


def test_single_request_goes_first_once_a_slot_frees_without_a_parent_cap() -> None:
    """parent_share=1.0: the fan-out may fill the running set; the single request takes the
    first slot that frees, ahead of the fan-out's waiting choices."""
    s = scheduler(max_requests=16, parent_share=1.0)
    early = fan_out("big", 16, max_new=3)  # these finish first and free their slots
    for r in early + fan_out("big", 200, max_new=50)[16:]:
        s.add(r)
    step(s)
    assert len(s.running) == 16
    single = request("single", tenant="b", parent="single")
    s.add(single)
    steps = 0
    while single.num_computed == 0:
        step(s)
        steps += 1
    assert steps == 3  # the step the early choices' slots freed: not after the 184 waiting ones


def test_two_tenants_get_equal_token_shares_under_saturation() -> None:
    s = scheduler(max_batch_tokens=64, max_requests=8)
    for i in range(300):
        s.add(request(f"a-{i}", prompt_len=40, max_new=20, tenant="a", parent=f"a-{i}"))
    for _ in range(10):
        step(s)
    for i in range(300):
        s.add(request(f"b-{i}", prompt_len=40, max_new=20, tenant="b", parent=f"b-{i}"))
    tokens = {"a": 0, "b": 0}
    for _ in range(200):
        for sr in step(s):
            tokens[sr.request.tenant] += sr.num_query_tokens
    assert s.waiting  # saturated throughout
    assert abs(tokens["a"] - tokens["b"]) <= 0.05 * sum(tokens.values()), tokens


def test_parents_of_one_tenant_share_it_equally() -> None:
    """Within a tenant, two fan-outs get equal shares whichever came first."""
    s = scheduler(max_batch_tokens=64, max_requests=8, parent_share=1.0)
    for r in fan_out("first", 300, prompt_len=40, max_new=20):
        s.add(r)
    for _ in range(10):
        step(s)
    for r in fan_out("second", 300, prompt_len=40, max_new=20):
        s.add(r)
    tokens = {"first": 0, "second": 0}
    for _ in range(200):
        for sr in step(s):
            tokens[sr.request.parent_id] += sr.num_query_tokens
    assert abs(tokens["first"] - tokens["second"]) <= 0.05 * sum(tokens.values()), tokens


def test_priority_lower_runs_first_before_any_share() -> None:
    s = scheduler(max_requests=1)
    reqs = [request("p3", priority=3), request("p0", priority=0), request("m1", tenant="b", priority=-1),
            request("p0-later", priority=0)]
    for r in reqs:
        s.add(r)
    order = []
    while s.has_work:
        for sr in step(s):
            if sr.request.request_id not in order:
                order.append(sr.request.request_id)
    assert order == ["m1", "p0", "p0-later", "p3"]
    # The Python API's requests (no tenant, no parent) keep arrival order, and no cap applies.
    s = scheduler(max_requests=40, parent_share=0.1)
    reqs = [request(f"r{i}", prompt_len=4, max_new=5) for i in range(40)]
    for r in reqs:
        s.add(r)
    assert [sr.request for sr in step(s)] == reqs


def test_preemption_evicts_the_lowest_priority_first() -> None:
    # 6 pages of 16 tokens; two requests of 40 + 30 new tokens cannot both grow to the end.
    s = scheduler(max_batch_tokens=64, max_requests=4, num_blocks=6)
    low, high = request("low", prompt_len=40, max_new=30, priority=5), request("high", prompt_len=40, max_new=30)
    s.add(low)
    step(s)  # `low` is admitted first: the most recently admitted would be `high`
    s.add(high)
    while s.num_preemptions == 0:
        step(s)
    assert low in s.waiting and high in s.running


# -- through the manager and the engine ---------------------------------------------------------


def test_manager_takes_priority_tenant_and_parent_and_refuses_bad_ones() -> None:
    model = tiny_model("llama")
    gc = GenerationConfig(max_new_tokens=2, do_sample=False)
    plain = cbserve.ContinuousBatchingManager(model, gc, cbserve.ContinuousBatchingConfig(page_size=16))
    with pytest.raises(InvalidRequestError) as info:  # vLLM's rule without its priority policy
        plain.add_request([5, 6, 7], priority=1)
    assert info.value.field == "priority"
    plain.add_request([5, 6, 7], priority=0, tenant="t")
    plain.destroy()
    config = cbserve.ContinuousBatchingConfig(page_size=16, priority_scheduling=True)
    manager = cbserve.ContinuousBatchingManager(model, gc, config)
    rid = manager.add_request([5, 6, 7], priority=-3, tenant="t", parent_id="p")
    queued = manager._live[rid]
    assert (queued.priority, queued.tenant, queued.parent_id) == (-3, "t", "p")
    for kwargs, field in (({"priority": 2**63}, "priority"), ({"priority": 1.5}, "priority"),
                          ({"tenant": ""}, "tenant"), ({"parent_id": 3}, "parent_id")):
        with pytest.raises(InvalidRequestError) as info:
            manager.add_request([5, 6, 7], **kwargs)
        assert info.value.field == field
    manager.start()
    out = manager.get_result(rid, timeout=60)
    manager.stop()
    assert out is not None and out.status == cbserve.RequestStatus.FINISHED


def test_engine_tokens_identical_to_running_alone_and_the_single_request_not_starved() -> None:
    """A 24-choice parent, another tenant's single request arriving later, a cache small enough
    to preempt: every request's greedy tokens equal `generate()` alone; the single request gets
    its first token within two steps of its arrival."""
    model = tiny_model("llama")
    big_prompt, single_prompt = random_prompts([30, 12], seed=3)
    max_new = 12
    cfg = cbserve.ContinuousBatchingConfig(page_size=8, num_blocks=20, max_batch_tokens=64, max_requests_per_batch=16,
                                           return_logprobs=True)
    engine = build_engine(model, GenerationConfig(max_new_tokens=max_new, do_sample=False), cfg)
    try:
        big = [engine.make_request(big_prompt, f"big-{i}") for i in range(24)]
        for r in big:
            r.tenant, r.parent_id = "a", "big"
            engine.add_request(r)
        for _ in range(3):
            engine.step()
        single = engine.make_request(single_prompt, "single")
        single.tenant, single.parent_id = "b", "single"
        engine.add_request(single)
        arrival, first_token_step = engine.num_steps, None
        while engine.has_work:
            engine.step()
            if single.generated and first_token_step is None:
                first_token_step = engine.num_steps
    finally:
        engine.release_model()
    assert first_token_step - arrival <= 2
    assert engine.scheduler.num_preemptions > 0
    ref_big, ref_single = (reference_generate(model, p, max_new) for p in (big_prompt, single_prompt))
    for r in big:
        assert r.generated == ref_big[0], r.request_id
    assert single.generated == ref_single[0]
    assert single.logprobs == pytest.approx(ref_single[1], abs=1e-6)


# -- the fronts: parent, priority and tenant on every choice -------------------------------------


def test_choices_of_one_api_call_share_a_parent_and_carry_priority_and_user_tenant() -> None:
    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.front.openai_service import OpenAIService
    from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest
    from cbserve.serving.front.worker_requests import user_tenant

    service = OpenAIService(ClusterArgs(), open_choice=None)
    wreqs = service.completion_requests(CompletionRequest(prompt=["a", "b"], n=3, priority=-2, user="alice"), "cmpl-1")
    assert len(wreqs) == 6
    assert {(w.sampling.parent_id, w.sampling.priority, w.sampling.tenant) for w in wreqs} == {
        ("cmpl-1", -2, user_tenant("alice"))}
    assert "alice" not in user_tenant("alice")
    chat = service.chat_requests(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=2), "chat-1")
    assert {(w.sampling.parent_id, w.sampling.priority, w.sampling.tenant) for w in chat} == {("chat-1", None, None)}
    with pytest.raises(ValueError, match="priority"):
        CompletionRequest(prompt="a", priority=2**63)
    # A request that is no API call's choice (gRPC, a batch line) is a parent of its own.
    from cbserve.serving.front.worker_requests import worker_request
    from cbserve.serving.protocol import Sampling

    assert worker_request("grpc-1", [], Sampling(), prompt="x").sampling.parent_id == "grpc-1"


def test_the_api_key_is_the_tenant_of_every_choice() -> None:
    import asyncio

    from cbserve.cluster.ingress import OpenAIIngress
    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.front.metrics import ServingMetrics
    from cbserve.serving.front.worker_requests import key_tenant, user_tenant
    from cbserve.serving.protocol import Sampling, WorkerEvent, WorkerRequest

    args = ClusterArgs(api_key="k1", api_keys=["k2", "k1"])
    assert args.resolved_api_keys() == ["k1", "k2"]
    with pytest.raises(ValueError, match="api_keys"):
        ClusterArgs(api_keys=[" "])
    sent: list[WorkerRequest] = []

    class Stream:
        def __init__(self) -> None:
            self.cancel = lambda: None

        async def __anext__(self) -> WorkerEvent:
            return WorkerEvent(kind="start")

    class Handle:
        def remote(self, wreq: WorkerRequest) -> Stream:
            sent.append(wreq)
            return Stream()

    ingress = object.__new__(OpenAIIngress)  # the handler alone: no Serve
    ingress.args, ingress._generate = args, Handle()
    ingress.metrics = ServingMetrics(args.model_name)  # the choices' migration counters
    wreq = WorkerRequest(request_id="r", prompt="x", sampling=Sampling(tenant=user_tenant("bob")))

    async def call(header: str | None) -> bool:
        ok = ingress._authorized(header)
        if ok:
            await ingress._open_choice(wreq)
        return ok

    ingress._api_keys = {k: key_tenant(k) for k in args.resolved_api_keys()}
    assert [asyncio.run(call(h)) for h in ("Bearer k2", "Bearer k3", "Basic k1", None)] == [True, False, False, False]
    assert [w.sampling.tenant for w in sent] == [key_tenant("k2")]  # the key's, not the client's user
    assert "k2" not in key_tenant("k2")
    ingress._api_keys = {}
    assert asyncio.run(call(None))
    assert sent[-1].sampling.tenant == user_tenant("bob")


# -- per-step limits (StepLimits): a newcomer's first step is short ------------------------------


def limited(parent_step_tokens: int | None = None, held_step_tokens: int | None = 4, **kw) -> Scheduler:
    s = scheduler(**kw)
    s.parent_step_tokens, s.held_step_tokens = parent_step_tokens, held_step_tokens
    return s


def tokens_of(batch: list[ScheduledRequest], parent: str) -> int:
    return sum(sr.num_query_tokens for sr in batch if sr.request.parent_id == parent)


@pytest.mark.parametrize("tenant", ["a", "b"])
def test_a_newcomer_holds_a_decoding_fan_out_to_held_step_tokens_for_its_first_step(tenant: str) -> None:
    s = limited(max_requests=64)
    for r in fan_out("big", 512):
        s.add(r)
    for _ in range(3):
        step(s)
    assert tokens_of(step(s), "big") == 32  # decoding alone: its whole running share
    single = request("single", tenant=tenant, parent="single")
    s.add(single)
    first = step(s)
    assert single in [sr.request for sr in first] and single.generated  # its first token, in this step
    assert tokens_of(first, "big") == 4
    assert tokens_of(step(s), "big") == 32  # the newcomer has its token: nothing held


def test_held_step_tokens_none_holds_nothing() -> None:
    s = limited(held_step_tokens=None, max_requests=64)
    for r in fan_out("big", 512):
        s.add(r)
    for _ in range(3):
        step(s)
    s.add(request("single", tenant="b", parent="single"))
    assert tokens_of(step(s), "big") == 32


def test_a_newcomer_owed_less_holds_nothing() -> None:
    """A newcomer of a lower priority, or one already charged more, is not owed the others' rows."""
    s = limited(max_requests=64)
    for r in fan_out("big", 512):
        s.add(r)
    for _ in range(3):
        step(s)
    s.add(request("late", tenant="b", parent="late", priority=1))
    assert tokens_of(step(s), "big") == 32


def test_two_started_fan_outs_do_not_hold_each_other() -> None:
    s = limited(parent_step_tokens=16, max_requests=64)
    for r in fan_out("x", 100, tenant="a") + fan_out("y", 100, tenant="b"):
        s.add(r)
    for _ in range(4):
        step(s)
    batch = step(s)
    assert tokens_of(batch, "x") == tokens_of(batch, "y") == 16


def test_parent_step_tokens_caps_a_fan_out_alone_but_not_a_lone_request() -> None:
    s = limited(parent_step_tokens=16, held_step_tokens=None, max_batch_tokens=512, max_requests=64)
    for r in fan_out("big", 100):
        s.add(r)
    for _ in range(5):
        assert 0 < tokens_of(step(s), "big") <= 16 + 16  # its first row (a whole 16-token prompt) and 16 more
    lone = limited(parent_step_tokens=16, held_step_tokens=None, max_batch_tokens=512)
    long_prompt = request("long", prompt_len=300, parent="long")
    lone.add(long_prompt)
    assert tokens_of(step(lone), "long") == 300  # one request's prefill chunk is never cut


def test_a_fan_out_beside_others_takes_short_steps_until_the_window_passes() -> None:
    """shared_parent_step_tokens: alone a fan-out decodes its whole running share per step; while
    another tenant's request is live, and for shared_window_s after it ends, 16 tokens."""
    now = [0.0]
    s = limited(held_step_tokens=None, max_requests=64)
    s.shared_parent_step_tokens, s.shared_window_s, s.clock = 16, 5.0, lambda: now[0]
    for r in fan_out("big", 512):
        s.add(r)
    for _ in range(3):
        step(s)
    assert tokens_of(step(s), "big") == 32  # alone: its whole running share
    single = request("single", tenant="b", parent="single", max_new=2)
    s.add(single)
    while single.status != RequestStatus.FINISHED:
        assert tokens_of(step(s), "big") == 16
        now[0] += 1.0
    assert tokens_of(step(s), "big") == 16  # 1 s after: still shared
    now[0] += 5.0
    assert tokens_of(step(s), "big") == 32  # the window has passed


def test_fifo_order_unchanged_for_one_tenant_without_parent_ids() -> None:
    """The Python API (one tenant, no parent ids): the same plans, step for step, as with no limits."""
    def plans(s: Scheduler) -> list[list[tuple[str, int]]]:
        for i in range(60):
            s.add(request(f"r{i}", prompt_len=5 + (i * 7) % 40, max_new=3 + i % 11))
        out = []
        while s.has_work:
            out.append([(sr.request.request_id, sr.num_query_tokens) for sr in step(s)])
        return out

    assert plans(limited(parent_step_tokens=8, held_step_tokens=1, max_batch_tokens=64, max_requests=8)) == \
        plans(scheduler(max_batch_tokens=64, max_requests=8))


def test_step_limits_config_defaults() -> None:
    config = cbserve.ContinuousBatchingConfig()
    assert config.resolved_parent_step_tokens("cpu") is None and config.resolved_parent_step_tokens("cuda") is None
    assert cbserve.ContinuousBatchingConfig(parent_step_tokens=0).resolved_parent_step_tokens("cpu") is None
    assert cbserve.ContinuousBatchingConfig(parent_step_tokens=64).resolved_parent_step_tokens("cpu") == 64
    assert config.held_step_tokens == 4
    assert config.resolved_shared_parent_step_tokens("cpu") == 16
    assert config.resolved_shared_parent_step_tokens("cuda") is None
    assert cbserve.ContinuousBatchingConfig(shared_parent_step_tokens=0).resolved_shared_parent_step_tokens("cpu") is None
    with pytest.raises(ValueError, match="shared_window_s=2.0 has no effect with shared_parent_step_tokens=0"):
        cbserve.ContinuousBatchingConfig(shared_parent_step_tokens=0, shared_window_s=2.0)
    with pytest.raises(ValueError, match="held_step_tokens"):
        cbserve.ContinuousBatchingConfig(held_step_tokens=0)


def test_a_newcomer_that_cannot_be_admitted_for_pages_holds_nothing() -> None:
    """Below the safety margin of free pages nothing is admitted: holding the fan-out then would
    only slow the release of the pages the newcomer waits for."""
    s = Scheduler(BlockManager(40, 16, False), 256, 64, "fifo", 0.5)
    s.held_step_tokens = 4
    for r in fan_out("big", 32, max_new=200):
        s.add(r)
    for _ in range(20):
        step(s)
    assert s.block_manager.num_free < 0.5 * 40
    running = len(s.running)
    s.add(request("single", tenant="b", parent="single"))
    batch = step(s)
    assert tokens_of(batch, "big") == running > 4 and tokens_of(batch, "single") == 0


def test_newcomers_arriving_together_do_not_hold_each_other() -> None:
    """32 parents (clients) arriving at once: whole prompts go in as the budget allows, in arrival
    order, the first ones get their first token in the first step; held, each would take
    held_step_tokens of prompt a step and all would wait for the last prefill."""
    s = limited(max_batch_tokens=256, max_requests=64)
    clients = [request(f"c{i}", prompt_len=64, tenant="a", parent=f"c{i}") for i in range(32)]
    for r in clients:
        s.add(r)
    first = step(s)
    assert [sr.request for sr in first] == clients[:4] and all(r.generated for r in clients[:4])
    second = step(s)
    assert tokens_of(second, "c0") == 1  # started: held to held_step_tokens while newcomers wait
    assert [r for r in clients if r.generated] == clients[:7]  # 256 - 4 decode rows = 3 more prompts + a chunk
