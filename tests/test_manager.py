"""The online manager (SPEC sections 2 and 7): lifecycle, submitting, cancelling, streaming,
results, bad input, crashes inside the loop, and a soak test with random cancels.

Every blocking call has a timeout and every test runs under an alarm, so a bug fails a test
instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections import Counter, defaultdict

import pytest
import torch

import cbserve
from cbserve import FinishReason, GenerationOutput, RequestStatus
from cbserve.manager import ContinuousBatchingManager
from tests.support import manager as support
from tests.support.manager import (
    TIMEOUT,
    MakeManager,
    assert_all_pages_free,
    engine_config,
    engine_model,
    get,
    get_final,
    greedy_config,
    paused,
    ref_tokens,
    reference,
    wait_until,
)
from tests.support.tiny_models import VOCAB, random_prompts

# The shared fixtures: a hang guard (autouse) and managers destroyed after each test.
hang_guard = support.hang_guard
make_manager = support.make_manager


def record_statuses(manager: ContinuousBatchingManager) -> dict[str, list[RequestStatus]]:
    """Wrap the engine's step to record each request's distinct statuses, in order."""
    history: dict[str, list[RequestStatus]] = defaultdict(list)
    engine, original = manager.engine, manager.engine.step

    def note(requests) -> None:
        for r in requests:
            seen = history[r.request_id]
            if not seen or seen[-1] != r.status:
                seen.append(r.status)

    def step():
        note(list(engine.requests.values()))
        updated = original()
        note(list(engine.requests.values()) + updated)
        return updated

    engine.step = step
    return history


# -- lifecycle ---------------------------------------------------------------------------------


def test_start_stop_restart_destroy(make_manager: MakeManager, caplog: pytest.LogCaptureFixture) -> None:
    model = engine_model()
    manager = make_manager(max_new=5, start=False)
    assert not manager.is_running()
    prompts = random_prompts([6, 11, 3])

    manager.start()
    manager.start()  # already running: no second thread
    assert manager.is_running()
    assert get(manager, manager.add_request(prompts[0])).generated_tokens == ref_tokens(prompts[0], 5)

    manager.stop(timeout=TIMEOUT)
    assert not manager.is_running()
    with caplog.at_level(logging.WARNING, logger="cbserve.manager"):
        with pytest.raises(RuntimeError):
            manager.add_request(prompts[1])
        with pytest.raises(RuntimeError):
            manager.add_requests([prompts[1]])
    assert any(r.levelno == logging.WARNING and "refused" in r.getMessage() for r in caplog.records)
    assert_all_pages_free(manager)

    manager.start()  # a new session with the same manager
    assert manager.is_running()
    assert get(manager, manager.add_request(prompts[1])).generated_tokens == ref_tokens(prompts[1], 5)

    manager.destroy()
    assert not manager.is_running()
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()
    with pytest.raises(RuntimeError):
        manager.add_request(prompts[2])
    manager.destroy()  # a second destroy is a no-op


def test_destroy_while_running_finishes_live_requests_first(make_manager: MakeManager) -> None:
    """transformers' destroy(): a running manager is stopped gracefully first, so what is queued
    and running finishes; then the cache is freed for good."""
    manager = make_manager(max_requests_per_batch=1, num_blocks=200)
    prompts = random_prompts([8, 9])
    running = manager.add_request(prompts[0], max_new_tokens=40, streaming=True)
    get(manager, running)  # it has started
    queued = manager.add_request(prompts[1], max_new_tokens=40)
    manager.destroy()
    assert not manager.is_running()
    for rid, prompt in ((running, prompts[0]), (queued, prompts[1])):
        out = get_final(manager, rid)
        assert out.status == RequestStatus.FINISHED and out.generated_tokens == ref_tokens(prompt, 40)
    assert manager.engine.block_manager.num_free == manager.engine.block_manager.num_blocks
    assert manager.engine.cache.k == [] and engine_model().config._attn_implementation == "sdpa"


@pytest.mark.parametrize("how", ["destroy(timeout)", "stop(timeout) then destroy()"])
def test_destroy_hard_stops_what_outlives_its_grace_period(make_manager: MakeManager, how: str) -> None:
    manager = make_manager(max_requests_per_batch=1, num_blocks=200)
    running = manager.add_request(random_prompts([8])[0], max_new_tokens=900, streaming=True)
    get(manager, running)  # it has started
    queued = manager.add_request(random_prompts([9])[0], max_new_tokens=900)
    if how == "destroy(timeout)":
        manager.destroy(timeout=0.05)
    else:
        manager.stop(timeout=0.05)  # the grace period a server gives before it goes
        assert manager.is_running()
        manager.destroy()  # does not wait for 1800 more tokens
    assert not manager.is_running()
    for rid in (running, queued):
        out = get_final(manager, rid)
        assert out.status == RequestStatus.FAILED and isinstance(out.exception, RuntimeError)
        assert len(out.generated_tokens) < 900
    assert manager.engine.block_manager.num_free == manager.engine.block_manager.num_blocks


def test_context_manager_finishes_work_then_destroys() -> None:
    model = engine_model()
    prompt = random_prompts([7])[0]
    with cbserve.continuous_batching(model, greedy_config(30), engine_config()) as manager:
        assert manager.is_running()
        rid = manager.add_request(prompt)
    assert not manager.is_running()
    out = manager.get_result(rid, timeout=0)  # stop() on exit finished it
    assert out is not None and out.status == RequestStatus.FINISHED
    assert out.generated_tokens == ref_tokens(prompt, 30)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError):
        manager.start()
    assert_all_pages_free(manager)


def test_persistent_manager_is_reused_by_the_next_context() -> None:
    model = engine_model()
    prompts = random_prompts([5, 9])
    first = None
    try:
        with cbserve.continuous_batching(model, greedy_config(4), engine_config(),
                                         persistent_manager=True) as first:
            assert get(first, first.add_request(prompts[0])).generated_tokens == ref_tokens(prompts[0], 4)
        assert not first.is_running()
        assert getattr(model, "_cbserve_manager", None) is first
        with cbserve.continuous_batching(model, greedy_config(4), engine_config(),
                                         persistent_manager=True) as second:
            assert second is first and second.is_running()
            assert get(second, second.add_request(prompts[1])).generated_tokens == ref_tokens(prompts[1], 4)
        assert_all_pages_free(first)
    finally:
        if first is not None:
            first.destroy()
    assert not hasattr(model, "_cbserve_manager")
    assert model.config._attn_implementation == "sdpa"
    with cbserve.continuous_batching(model, greedy_config(4), engine_config(),
                                     persistent_manager=True) as third:
        assert third is not first
    third.destroy()


def test_status_transitions(make_manager: MakeManager) -> None:
    """PENDING -> PREFILLING (chunks) -> DECODING -> FINISHED; a queued cancel ends PENDING -> CANCELLED."""
    manager = make_manager(max_requests_per_batch=1, max_batch_tokens=8)
    history = record_statuses(manager)
    prompts = random_prompts([20, 20, 5])
    first = manager.add_request(prompts[0], max_new_tokens=4, streaming=True)
    second = manager.add_request(prompts[1], max_new_tokens=4)
    assert get(manager, first).status == RequestStatus.DECODING  # second is still queued
    third = manager.add_request(prompts[2], max_new_tokens=4)
    manager.cancel_request(third)
    for rid in (first, second):
        assert get_final(manager, rid).status == RequestStatus.FINISHED
        assert history[rid] == [RequestStatus.PENDING, RequestStatus.PREFILLING, RequestStatus.DECODING,
                                RequestStatus.FINISHED]
    out = get_final(manager, third)
    assert out.status == RequestStatus.CANCELLED and out.generated_tokens == []
    assert history[third] in ([], [RequestStatus.PENDING])  # never admitted
    assert_all_pages_free(manager)


def test_short_requests_leave_the_batch_while_long_ones_continue(make_manager: MakeManager) -> None:
    manager = make_manager(max_requests_per_batch=2)
    prompts = random_prompts([12, 6, 9])
    with paused(manager):  # the loop picks all three up at once
        long = manager.add_request(prompts[0], max_new_tokens=60, streaming=True)
        short = manager.add_request(prompts[1], max_new_tokens=3)
        # Queued behind the two (two requests per batch): it gets the short one's slot and pages.
        third = manager.add_request(prompts[2], max_new_tokens=3, streaming=True)
    events: list[tuple[str, GenerationOutput]] = []
    finals: dict[str, GenerationOutput] = {}
    while len(finals) < 3:
        out = get(manager)
        events.append((out.request_id, out))
        if out.is_finished():
            finals[out.request_id] = out
    order = [rid for rid, _ in events]
    last = {rid: len(order) - 1 - order[::-1].index(rid) for rid in (long, short, third)}
    assert last[short] < order.index(third)  # the third started after the short one left
    assert last[third] < last[long]  # and finished while the long one kept decoding
    long_after_short = [o for rid, o in events[last[short] + 1:] if rid == long]
    assert len(long_after_short) > 40
    for rid, prompt, n in ((long, prompts[0], 60), (short, prompts[1], 3), (third, prompts[2], 3)):
        assert finals[rid].generated_tokens == ref_tokens(prompt, n)
    assert_all_pages_free(manager)


def test_stop_finishes_queued_work(make_manager: MakeManager) -> None:
    manager = make_manager(max_new=6, max_requests_per_batch=2)
    prompts = random_prompts([3, 8, 13, 2, 21, 5, 17, 9], seed=3)
    ids = [manager.add_request(p) for p in prompts]
    manager.stop(timeout=TIMEOUT)
    assert not manager.is_running()
    for rid, prompt in zip(ids, prompts):
        out = manager.get_result(rid, timeout=0)
        assert out is not None and out.status == RequestStatus.FINISHED
        assert out.finish_reason == FinishReason.LENGTH
        assert out.generated_tokens == ref_tokens(prompt, 6)
    assert_all_pages_free(manager)


def test_hard_stop_fails_every_waiter(make_manager: MakeManager) -> None:
    manager = make_manager(max_requests_per_batch=2, num_blocks=400)
    prompts = random_prompts([10, 4, 7, 12, 3, 9], seed=5)
    ids = [manager.add_request(p, max_new_tokens=900, streaming=i % 2 == 0) for i, p in enumerate(prompts)]
    finals: dict[str, GenerationOutput] = {}
    started = threading.Event()

    def stream_waiter(rid: str) -> None:
        for out in manager.request_id_iter(rid):
            started.set()
            if out.is_finished():
                finals[rid] = out

    def result_waiter(rid: str) -> None:
        out = manager.get_result(rid, timeout=TIMEOUT)
        if out is not None:
            finals[rid] = out

    threads = [threading.Thread(target=stream_waiter if i % 2 == 0 else result_waiter, args=(rid,))
               for i, rid in enumerate(ids)]
    for t in threads:
        t.start()
    assert started.wait(TIMEOUT)
    manager.stop(hard_stop=True, timeout=TIMEOUT)
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a waiter is still blocked after a hard stop"
    assert sorted(finals) == sorted(ids)
    for out in finals.values():
        assert out.status == RequestStatus.FAILED and out.finish_reason == FinishReason.ERROR
        assert isinstance(out.exception, RuntimeError) and out.error
        assert len(out.generated_tokens) < 900
    assert any(out.generated_tokens for out in finals.values())  # running ones were failed too
    assert_all_pages_free(manager)
    manager.start()  # a hard-stopped manager can start a new session
    prompt = random_prompts([5])[0]
    assert get(manager, manager.add_request(prompt)).generated_tokens == ref_tokens(prompt, 8)
    manager.stop(timeout=TIMEOUT)


def test_add_request_after_stop_is_refused_with_a_warning(make_manager: MakeManager,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    manager = make_manager()
    manager.stop(timeout=TIMEOUT)
    caplog.clear()  # the set-up's INFO lines, captured when an earlier test (Ray) set INFO on cbserve's loggers
    with caplog.at_level(logging.WARNING, logger="cbserve.manager"), pytest.raises(RuntimeError, match="stopped"):
        manager.add_request([1, 2, 3], request_id="late")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "late" in caplog.text
    assert manager.get_result(timeout=0.1) is None
    assert_all_pages_free(manager)


# -- cancelling --------------------------------------------------------------------------------


def test_cancel_running_request(make_manager: MakeManager) -> None:
    manager = make_manager(num_blocks=200)
    rid = manager.add_request(random_prompts([10])[0], max_new_tokens=900, streaming=True)
    outs = []
    for out in manager.request_id_iter(rid):
        outs.append(out)
        if len(outs) == 3:
            manager.cancel_request(rid)
    final = outs[-1]
    assert final.status == RequestStatus.CANCELLED and final.finish_reason == FinishReason.CANCELLED
    assert 3 <= len(final.generated_tokens) < 900
    assert [t for o in outs for t in o.new_tokens] == final.generated_tokens
    assert final.finished_time is not None
    assert_all_pages_free(manager)


def test_cancel_queued_request(make_manager: MakeManager) -> None:
    manager = make_manager(max_requests_per_batch=1, num_blocks=200)
    prompts = random_prompts([10, 6])
    running = manager.add_request(prompts[0], max_new_tokens=900, streaming=True)
    get(manager, running)
    queued = manager.add_request(prompts[1], max_new_tokens=5)
    wait_until(lambda: manager.stats()["waiting"] == 1, "the second request to queue")
    manager.cancel_request(queued)
    out = get(manager, queued)
    assert out.status == RequestStatus.CANCELLED and out.finish_reason == FinishReason.CANCELLED
    assert out.generated_tokens == [] and out.first_token_time is None
    assert manager.stats()["waiting"] == 0
    manager.cancel_request(running)
    assert get_final(manager, running).status == RequestStatus.CANCELLED
    assert_all_pages_free(manager)


def test_cancel_of_unknown_or_finished_request_is_a_noop(make_manager: MakeManager) -> None:
    manager = make_manager(max_new=4)
    prompt = random_prompts([7])[0]
    rid = manager.add_request(prompt)
    out = get(manager, rid)
    assert out.status == RequestStatus.FINISHED
    manager.cancel_request(rid)
    manager.cancel_request("no-such-request")
    assert manager.get_result(timeout=0.2) is None  # no second output
    assert list(manager.request_id_iter(rid)) == []
    assert out.status == RequestStatus.FINISHED and out.generated_tokens == ref_tokens(prompt, 4)
    assert get(manager, manager.add_request(prompt)).generated_tokens == ref_tokens(prompt, 4)
    assert_all_pages_free(manager)


# -- results and streaming ---------------------------------------------------------------------


@pytest.mark.parametrize("max_batch_tokens", [128, 8], ids=["one-step-prefill", "chunked-prefill"])
def test_streaming_yields_every_token_once_in_order(make_manager: MakeManager, max_batch_tokens: int) -> None:
    manager = make_manager(max_batch_tokens=max_batch_tokens, return_logprobs=True)
    prompt = random_prompts([30])[0]
    rid = manager.add_request(prompt, max_new_tokens=12, streaming=True)
    outs = list(manager.request_id_iter(rid))
    final = outs[-1]
    tokens, logprobs = reference(tuple(prompt), 12)
    assert len(outs) == 12
    assert [o.status for o in outs] == [RequestStatus.DECODING] * 11 + [RequestStatus.FINISHED]
    assert all(len(o.new_tokens) == 1 for o in outs)
    assert [t for o in outs for t in o.new_tokens] == final.generated_tokens == tokens
    assert [lp for o in outs for lp in o.new_logprobs] == final.logprobs
    assert final.logprobs == pytest.approx(logprobs, abs=1e-6)
    for k, o in enumerate(outs):  # earlier snapshots do not grow with the request
        assert o.generated_tokens == tokens[: k + 1] and len(o.logprobs) == k + 1
    assert final.created_time <= final.first_token_time <= final.finished_time
    assert final.time_to_first_token is not None and final.time_to_first_token >= 0
    assert_all_pages_free(manager)


def _spy_on_steps_logprobs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each sampled step computed logprobs (the sampler's `want_logprobs`)."""
    from cbserve.workers import sampler

    seen: list[bool] = []
    draw = sampler.Sampler._draw

    def spy(self, logits, requests, want_logprobs):
        seen.append(want_logprobs)
        return draw(self, logits, requests, want_logprobs)

    monkeypatch.setattr(sampler.Sampler, "_draw", spy)
    return seen


def test_a_request_can_turn_logprobs_off(make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logprobs=False` on a request of an engine with `return_logprobs=True` (the server's): it
    gets none, and the steps it runs alone compute none (the greedy kernel then skips its
    exponentials); the engine's default still gives the others theirs."""
    manager = make_manager(return_logprobs=True, per_request_processors=True)
    prompt = random_prompts([20])[0]
    tokens, logprobs = reference(tuple(prompt), 6)
    seen = _spy_on_steps_logprobs(monkeypatch)
    off = get(manager, manager.add_request(prompt, max_new_tokens=6, logprobs=False))
    assert off.generated_tokens == tokens and not off.logprobs
    assert seen and not any(seen)
    on = get(manager, manager.add_request(prompt, max_new_tokens=6))
    assert on.generated_tokens == tokens and on.logprobs == pytest.approx(logprobs, abs=1e-6)
    assert seen[-1]
    with pytest.raises(cbserve.InvalidRequestError, match="logprobs must be true or false"):
        manager.add_request(prompt, logprobs="yes")


def test_a_request_can_ask_for_logprobs(make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logprobs=True` on a request of an engine with `return_logprobs=False` (the default): it gets
    the same logprobs as with the config's switch, and a step computes them only while it runs."""
    manager = make_manager(return_logprobs=False, per_request_processors=True)
    prompts = random_prompts([20, 9], seed=3)
    seen = _spy_on_steps_logprobs(monkeypatch)
    plain = get(manager, manager.add_request(prompts[1], max_new_tokens=6))
    assert plain.generated_tokens == ref_tokens(prompts[1], 6) and not plain.logprobs and not any(seen)
    tokens, logprobs = reference(tuple(prompts[0]), 6)
    asked = get(manager, manager.add_request(prompts[0], max_new_tokens=6, logprobs=True))
    assert asked.generated_tokens == tokens and asked.logprobs == pytest.approx(logprobs, abs=1e-6)
    assert seen[-1]


def test_streaming_under_preemption_yields_each_token_once(make_manager: MakeManager) -> None:
    # 12 pages of 16 tokens; four requests of 30 + 40 tokens need 20: some are preempted.
    manager = make_manager(num_blocks=12, max_batch_tokens=64, allow_block_sharing=False)
    prompts = random_prompts([30, 30, 30, 30], seed=7)
    ids = [manager.add_request(p, max_new_tokens=40, streaming=True) for p in prompts]
    streams: dict[str, list[GenerationOutput]] = defaultdict(list)
    done = 0
    while done < len(ids):
        out = get(manager)
        streams[out.request_id].append(out)
        done += out.is_finished()
    for rid, prompt in zip(ids, prompts):
        outs = streams[rid]
        assert [t for o in outs for t in o.new_tokens] == outs[-1].generated_tokens == ref_tokens(prompt, 40)
        assert all(len(o.new_tokens) == 1 for o in outs)
    assert manager.stats()["preemptions"] > 0
    assert_all_pages_free(manager)


def test_get_result_by_id_leaves_other_results_for_others(make_manager: MakeManager) -> None:
    manager = make_manager()
    prompts = random_prompts([5, 8])
    short = manager.add_request(prompts[0], max_new_tokens=2)
    long = manager.add_request(prompts[1], max_new_tokens=30)
    assert get(manager, long).generated_tokens == ref_tokens(prompts[1], 30)
    assert manager.get_result(long, timeout=0.2) is None  # short's output is not handed out
    out = get(manager)
    assert out.request_id == short and out.generated_tokens == ref_tokens(prompts[0], 2)
    assert manager.get_result(timeout=0.2) is None

    # Two threads each waiting for their own request get their own output.
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, (20, 3))]
    got: dict[str, GenerationOutput | None] = {}
    threads = [threading.Thread(target=lambda r=rid: got.__setitem__(r, manager.get_result(r, timeout=TIMEOUT)))
               for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert {rid: o.request_id for rid, o in got.items() if o is not None} == {rid: rid for rid in ids}
    assert_all_pages_free(manager)


def test_iterating_the_manager_yields_outputs_as_requests_finish(make_manager: MakeManager) -> None:
    manager = make_manager()
    prompts = random_prompts([4, 9, 14, 19])
    with paused(manager):
        ids = [manager.add_request(p, max_new_tokens=30) for p in prompts[:3]]
        ids.append(manager.add_request(prompts[3], max_new_tokens=1))
    seen: list[GenerationOutput] = []
    for out in manager:
        seen.append(out)
        if len(seen) == len(ids):
            manager.stop(timeout=TIMEOUT)  # then the iteration ends
    assert seen[0].request_id == ids[3]  # the one-token request finished first
    assert sorted(o.request_id for o in seen) == sorted(ids)
    assert all(o.status == RequestStatus.FINISHED for o in seen)
    # After stop(), iteration drains what is left and ends.
    manager.start()
    more = [manager.add_request(p, max_new_tokens=2) for p in prompts]
    manager.stop(timeout=TIMEOUT)
    assert sorted(o.request_id for o in manager) == sorted(more)
    assert_all_pages_free(manager)


def test_iterators_see_a_final_output_stored_late(make_manager: MakeManager,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A request leaves the live set and its final output is stored in one step: an iterator
    checking in between must not end without the output."""
    manager = make_manager(max_new=3)
    store, original = manager._outputs, manager._outputs.put

    def slow_put(output: GenerationOutput) -> None:
        if output.is_finished():
            time.sleep(0.3)
        original(output)

    monkeypatch.setattr(store, "put", slow_put)
    prompt = random_prompts([5])[0]
    rid = manager.add_request(prompt)
    outs = list(manager.request_id_iter(rid))
    assert [o.generated_tokens for o in outs] == [ref_tokens(prompt, 3)]

    async def consume(rid: str) -> list[GenerationOutput]:
        return [out async for out in manager.async_request_iter(rid)]

    rid = manager.add_request(prompt)
    outs = asyncio.run(asyncio.wait_for(consume(rid), TIMEOUT))
    assert [o.generated_tokens for o in outs] == [ref_tokens(prompt, 3)]
    assert_all_pages_free(manager)


def test_add_requests_keeps_input_order_and_groups_shared_prefixes(make_manager: MakeManager) -> None:
    manager = make_manager(max_new=3)
    a, b, c = random_prompts([32, 32, 10], seed=11)
    inputs = [a + [5], b + [6], c, a + [7], b + [8], a + [9, 10]]
    submitted: list[list[int]] = []
    original = manager.engine.add_request

    def spy(request) -> None:
        submitted.append(request.prompt_ids)
        original(request)

    manager.engine.add_request = spy
    ids = manager.add_requests(inputs)
    assert len(set(ids)) == len(inputs)
    for rid, prompt in zip(ids, inputs):
        out = get(manager, rid)
        assert out.prompt_ids == prompt and out.generated_tokens == ref_tokens(prompt, 3)
    assert sorted(map(tuple, submitted)) == sorted(map(tuple, inputs))
    for prefix in (a, b):
        positions = [i for i, p in enumerate(submitted) if p[:32] == prefix]
        assert positions == list(range(positions[0], positions[0] + len(positions))), submitted
    assert_all_pages_free(manager)


def test_add_requests_refuses_the_whole_batch_on_bad_input(make_manager: MakeManager) -> None:
    manager = make_manager()
    with pytest.raises(ValueError, match="input_ids"):  # the bad prompt sorts last
        manager.add_requests([[1, 2, 3], [VOCAB + 5], [4, 5]])
    assert manager.stats()["waiting"] == 0 and manager.stats()["live_requests"] == 0
    assert manager.get_result(timeout=0.2) is None
    assert_all_pages_free(manager)


def test_async_request_iter_streams_and_cancelling_the_consumer_frees_pages(make_manager: MakeManager) -> None:
    manager = make_manager(num_blocks=200)
    prompts = random_prompts([6, 13, 9])
    generated_before = 0

    async def consume(rid: str) -> list[GenerationOutput]:
        return [out async for out in manager.async_request_iter(rid)]

    async def main() -> None:
        nonlocal generated_before
        ids = [manager.add_request(p, max_new_tokens=6, streaming=True) for p in prompts]
        streams = await asyncio.gather(*(consume(rid) for rid in ids))
        for prompt, outs in zip(prompts, streams):
            assert [t for o in outs for t in o.new_tokens] == ref_tokens(prompt, 6)
            assert outs[-1].status == RequestStatus.FINISHED and len(outs) == 6

        generated_before = manager.stats()["generated_tokens"]
        rid = manager.add_request(prompts[0], max_new_tokens=900, streaming=True)
        first = asyncio.Event()

        async def reader() -> None:
            async for _ in manager.async_request_iter(rid):
                first.set()

        task = asyncio.create_task(reader())
        await asyncio.wait_for(first.wait(), TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        # Leaving an iteration early (closing the generator) cancels too.
        rid2 = manager.add_request(prompts[1], max_new_tokens=900, streaming=True)
        async for _ in manager.async_request_iter(rid2):
            break

    asyncio.run(asyncio.wait_for(main(), 60))
    wait_until(lambda: manager.stats()["live_requests"] == 0, "the cancelled requests to end")
    assert manager.stats()["generated_tokens"] - generated_before < 2 * 900
    assert manager.get_result(timeout=0.2) is None  # a gone consumer's outputs are not kept
    assert_all_pages_free(manager)


# -- bad input ---------------------------------------------------------------------------------

BAD_INPUTS = [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, VOCAB]}, "input_ids"),
    ({"input_ids": [-1, 5]}, "input_ids"),
    ({"input_ids": [1, 2.0]}, "input_ids"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -2}, "max_new_tokens"),
    ({"input_ids": [3] * 1000, "max_new_tokens": 100}, "max_new_tokens.*context"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": "seven"}, "seed"),
]


def assert_nothing_queued(manager: ContinuousBatchingManager) -> None:
    stats = manager.stats()
    assert stats["waiting"] == 0 and stats["live_requests"] == 0, stats
    assert manager.get_result(timeout=0.05) is None


@pytest.mark.parametrize(("kwargs", "names"), BAD_INPUTS, ids=[f"{k}" for k, _ in BAD_INPUTS])
def test_bad_input_is_refused_synchronously(make_manager: MakeManager, kwargs: dict, names: str) -> None:
    # 80 pages of 16 tokens: the cache holds more than the model's context of 1024.
    manager = make_manager(num_blocks=80, per_request_processors=True)
    kwargs = {"input_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=names):
        manager.add_request(**kwargs)
    assert_nothing_queued(manager)


def test_request_beyond_the_cache_is_refused(make_manager: MakeManager) -> None:
    manager = make_manager(num_blocks=8)  # 128 tokens
    with pytest.raises(ValueError, match="max_new_tokens.*cache"):
        manager.add_request([3] * 100, max_new_tokens=50)
    assert_nothing_queued(manager)
    assert get(manager, manager.add_request([3] * 100, max_new_tokens=28)).status == RequestStatus.FINISHED


@pytest.mark.parametrize("kwargs", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}, {"seed": 1}])
def test_sampling_arguments_need_per_request_processors(make_manager: MakeManager, kwargs: dict) -> None:
    manager = make_manager()
    with pytest.raises(ValueError, match="per_request_processors"):
        manager.add_request([1, 2, 3], **kwargs)
    assert_nothing_queued(manager)


def test_duplicate_live_request_id_is_refused(make_manager: MakeManager) -> None:
    manager = make_manager(num_blocks=200)
    prompt = random_prompts([6])[0]
    manager.add_request(prompt, request_id="dup", max_new_tokens=900, streaming=True)
    get(manager, "dup")
    with pytest.raises(ValueError, match="request_id"):
        manager.add_request(prompt, request_id="dup")
    assert manager.stats()["live_requests"] == 1
    manager.cancel_request("dup")
    assert get_final(manager, "dup").status == RequestStatus.CANCELLED
    # Once finished, the id may be used again.
    assert manager.add_request(prompt, request_id="dup", max_new_tokens=3) == "dup"
    assert get(manager, "dup").generated_tokens == ref_tokens(prompt, 3)
    assert_all_pages_free(manager)


def test_bad_input_leaves_other_requests_unaffected(make_manager: MakeManager) -> None:
    manager = make_manager(max_new=10)
    prompts = random_prompts([9, 14])
    ids = [manager.add_request(p) for p in prompts]
    for bad in ([], [VOCAB + 1]):
        with pytest.raises(ValueError):
            manager.add_request(bad)
    for rid, prompt in zip(ids, prompts):
        assert get(manager, rid).generated_tokens == ref_tokens(prompt, 10)
    assert_all_pages_free(manager)


# -- faults ------------------------------------------------------------------------------------


def test_crash_in_the_step_fails_live_requests_and_the_manager_keeps_serving(
        make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    manager = make_manager(max_requests_per_batch=2, num_blocks=200)
    runner, original = manager.engine.runner, manager.engine.runner.run
    armed = threading.Event()

    def flaky_run(kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("boom in forward")
        return original(kwargs)

    monkeypatch.setattr(runner, "run", flaky_run)
    prompts = random_prompts([7, 12, 5, 9])
    ids = [manager.add_request(p, max_new_tokens=900, streaming=True) for p in prompts[:3]]
    get(manager, ids[0])  # running; the third is queued
    with caplog.at_level(logging.ERROR, logger="cbserve.manager"):
        armed.set()
        finals = [get_final(manager, rid) for rid in ids]
    for out in finals:
        assert out.status == RequestStatus.FAILED and out.finish_reason == FinishReason.ERROR
        assert isinstance(out.exception, RuntimeError) and "boom in forward" in out.error
    assert "boom in forward" in caplog.text
    assert isinstance(manager.error, RuntimeError)
    assert_all_pages_free(manager)
    assert manager.is_running()
    assert get(manager, manager.add_request(prompts[3])).generated_tokens == ref_tokens(prompts[3], 8)
    manager.stop(timeout=TIMEOUT)
    assert not manager.is_running()


# -- soak --------------------------------------------------------------------------------------


def test_soak_random_lengths_and_cancels(make_manager: MakeManager) -> None:
    """500 requests of random lengths, some streaming, with random cancels: each ends with
    exactly one final output, and every page comes back."""
    rng = random.Random(0)
    n = 500
    # 64 pages of 16 tokens, admitted to the last page: decodes preempt others.
    manager = make_manager(model=engine_model("llama", torch.float32), num_blocks=64, safety_margin=0.0,
                           max_batch_tokens=256, max_requests_per_batch=48)
    prompts = random_prompts([rng.randint(1, 80) for _ in range(n)], seed=1)
    max_new = [rng.randint(1, 24) for _ in range(n)]
    ids: list[str] = []
    streaming: dict[str, bool] = {}
    outputs: dict[str, list[GenerationOutput]] = defaultdict(list)
    finals: Counter[str] = Counter()

    def drain(timeout: float) -> bool:
        out = manager.get_result(timeout=timeout)
        if out is None:
            return False
        outputs[out.request_id].append(out)
        finals[out.request_id] += out.is_finished()
        return True

    for i in range(n):
        stream = rng.random() < 0.3
        ids.append(manager.add_request(prompts[i], max_new_tokens=max_new[i], streaming=stream))
        streaming[ids[-1]] = stream
        if rng.random() < 0.25:  # cancel a recent request: queued, running or already done
            manager.cancel_request(rng.choice(ids[-20:]))
        if rng.random() < 0.1:
            time.sleep(0.005)
        while drain(0):
            pass
    deadline = time.monotonic() + 100  # a few seconds normally; generous for a loaded machine
    while sum(finals.values()) < n:
        assert time.monotonic() < deadline, f"only {sum(finals.values())} of {n} ended: {manager.stats()}"
        drain(1.0)
    assert manager.get_result(timeout=0.3) is None  # nothing after the final outputs

    statuses = Counter()
    for rid, length in zip(ids, max_new):
        outs = outputs[rid]
        assert finals[rid] == 1 and outs[-1].is_finished(), rid
        final = outs[-1]
        statuses[final.status] += 1
        assert [t for o in outs for t in o.new_tokens] == final.generated_tokens
        assert streaming[rid] or len(outs) == 1
        if final.status == RequestStatus.FINISHED:
            assert final.finish_reason == FinishReason.LENGTH and len(final.generated_tokens) == length
        else:
            assert final.status == RequestStatus.CANCELLED and final.finish_reason == FinishReason.CANCELLED
            assert len(final.generated_tokens) < length
    assert statuses[RequestStatus.FINISHED] > 0 and statuses[RequestStatus.CANCELLED] > 0
    assert set(statuses) <= {RequestStatus.FINISHED, RequestStatus.CANCELLED}
    assert manager.stats()["preemptions"] > 0  # the small cache was exercised too
    manager.stop(timeout=TIMEOUT)
    assert_all_pages_free(manager)
