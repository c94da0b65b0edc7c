"""Issue 16: a drop-in for transformers users. Code written for transformers' engine runs
unchanged after `cbserve.attach(model)`; the model stays the user's while a manager exists; the
manager's methods have transformers' semantics (queue before start, graceful destroy,
stop(block, timeout, keep_for_next_session, hard_stop), join, warmup, pause, result handlers,
per-token timestamps, a bounded queue, partial generate_batch results, get_result that cannot
hang on a stopped manager). Tiny random-weight models in float64: token-exact comparisons.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import queue
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig as TransformersConfig
from transformers.generation.continuous_batching import RequestStatus as TransformersStatus

import cbserve
from cbserve import FinishReason, RequestStatus
from cbserve.kernels import packed_linear
from cbserve.manager import ContinuousBatchingManager
from cbserve.workers.compilation import CompiledForward
from cbserve.workers.factory import build_engine
from tests.support.manager import alarm_guard
from tests.support.tiny_models import VOCAB, random_prompts, reference_generate, tiny_model

TIMEOUT = 30.0
ALARM_S = 120


hang_guard = alarm_guard(ALARM_S)


@functools.cache
def ref_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    return tiny_model(arch, seed=seed)  # never touched by an engine


@functools.cache
def ref_tokens(prompt: tuple[int, ...], max_new: int, arch: str = "llama", seed: int = 0) -> list[int]:
    return reference_generate(ref_model(arch, seed), list(prompt), max_new)[0]


def greedy(max_new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)


def small(**overrides) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 128, "max_batch_tokens": 64,
                                               **overrides})


@pytest.fixture
def model() -> Iterator[torch.nn.Module]:
    """A fresh tiny model (its managers are destroyed after the test)."""
    m = tiny_model("llama")
    yield m
    cbserve.destroy_cached_continuous_batching_manager(m)


@pytest.fixture
def managers() -> Iterator[list[ContinuousBatchingManager]]:
    made: list[ContinuousBatchingManager] = []
    yield made
    for manager in reversed(made):
        manager.destroy(timeout=TIMEOUT)


def final(manager: ContinuousBatchingManager, request_id: str) -> cbserve.GenerationOutput:
    while True:
        out = manager.get_result(request_id, timeout=TIMEOUT)
        assert out is not None, f"no output for {request_id}"
        if out.is_finished():
            return out


def packed(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, packed_linear.PackedLinear)]


def forward_and_generate(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded two-row batch: plain forward logits and greedy generate() tokens."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return logits, tokens


# -- transformers code, unchanged ----------------------------------------------------------------


def test_the_seed_examples_run_unchanged_after_attach(model: torch.nn.Module) -> None:
    """The examples of transformers' continuous-batching guide, as written there (transformers'
    config classes and status enum), on an attached model."""
    assert cbserve.attach(model) is model
    prompts = random_prompts([5, 17, 9])
    generation_config = GenerationConfig(max_new_tokens=8, eos_token_id=None, do_sample=False)
    cb_config = TransformersConfig(page_size=16, num_blocks=64, scheduler_type="fifo", return_logprobs=True)

    outputs = model.generate_batch(inputs=prompts, generation_config=generation_config,
                                   continuous_batching_config=cb_config)
    assert list(outputs) == ["req_0", "req_1", "req_2"]
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == ref_tokens(tuple(prompt), 8)
        assert len(list(zip(output.generated_tokens, output.logprobs))) == 8

    with model.continuous_batching_context_manager(generation_config=generation_config) as manager:
        manager.add_request(input_ids=prompts[1], request_id="long", max_new_tokens=30)
        manager.add_request(input_ids=prompts[0], request_id="short_0", max_new_tokens=4)
        manager.add_request(input_ids=prompts[2], request_id="short_1", max_new_tokens=4)
        seen = {}
        for result in manager:
            seen[result.request_id] = result.generated_tokens
            if len(seen) == 3:
                break
    assert seen["long"] == ref_tokens(tuple(prompts[1]), 30)
    assert seen["short_0"] == ref_tokens(tuple(prompts[0]), 4)

    manager = model.init_continuous_batching(generation_config=generation_config)
    manager.start()
    manager.add_request(input_ids=prompts[0], request_id="streamed", streaming=True)
    chunks = []
    for chunk in manager.request_id_iter(request_id="streamed"):
        chunks.append(chunk.generated_tokens[-1:])
        if chunk.status == TransformersStatus.FINISHED:  # transformers' enum compares equal
            break
    assert [t for chunk in chunks for t in chunk] == ref_tokens(tuple(prompts[0]), 8)
    assert manager.add_requests(inputs=prompts) == ["req_0", "req_1", "req_2"]
    manager.stop()
    assert sorted(manager.get_result(timeout=0).request_id for _ in prompts) == ["req_0", "req_1", "req_2"]
    manager.destroy()
    assert model.config._attn_implementation == "sdpa"
    cbserve.detach(model)
    assert "generate_batch" not in model.__dict__


def test_generate_batch_equals_transformers_engine(model: torch.nn.Module) -> None:
    """Same prompts through transformers' own engine and, once attached, through cbserve: the
    same keys and tokens."""
    prompts = random_prompts([5, 17, 9, 30], seed=4)
    gc = greedy(6)
    cb_config = TransformersConfig(page_size=16, num_blocks=64, max_batch_tokens=64)
    theirs = model.generate_batch(prompts, gc, cb_config)  # transformers' engine
    ours = cbserve.attach(model).generate_batch(prompts, gc, cb_config)
    assert list(ours) == list(theirs) == [f"req_{i}" for i in range(len(prompts))]
    for key in theirs:
        assert ours[key].generated_tokens == theirs[key].generated_tokens
        assert ours[key].status == theirs[key].status == TransformersStatus.FINISHED
    assert model.config._attn_implementation == "sdpa"


def test_generate_batch_keeps_a_persistent_manager(model: torch.nn.Module) -> None:
    cbserve.attach(model)
    prompts = random_prompts([6, 11])
    first = model.generate_batch(prompts, greedy(5), small(), persistent_manager=True, max_new_tokens=3)
    manager = model.init_continuous_batching()  # the kept one, as transformers does
    assert isinstance(manager, ContinuousBatchingManager) and not manager.is_running()
    assert [o.generated_tokens for o in first.values()] == [ref_tokens(tuple(p), 3) for p in prompts]
    second = model.generate_batch(prompts, greedy(5))  # goes through the kept manager, 5 new tokens
    assert [o.generated_tokens for o in second.values()] == [ref_tokens(tuple(p), 5) for p in prompts]
    assert not set(first) & set(second)  # its request counter went on, as transformers' does
    assert not hasattr(model, "_cbserve_manager")  # that call was not persistent: destroyed
    model.destroy_cached_continuous_batching_manager()


# -- the model stays the user's ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_plain_forward_and_generate_while_a_manager_runs(arch: str, managers: list) -> None:
    model = tiny_model(arch)
    expected_logits, expected_tokens = forward_and_generate(ref_model(arch))
    manager = cbserve.init_continuous_batching(model, greedy(400), small(num_blocks=200))
    managers.append(manager)
    prompt = random_prompts([9])[0]
    rid = manager.add_request(prompt, streaming=True)  # queued before start: runs once started
    manager.start()
    assert manager.get_result(rid, timeout=TIMEOUT) is not None  # generating in the loop thread meanwhile
    assert model.config._attn_implementation == "cbserve_paged"
    logits, tokens = forward_and_generate(model)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0, equal_nan=True)  # gemma2 pads give NaN
    assert torch.equal(tokens, expected_tokens)
    assert final(manager, rid).generated_tokens == ref_tokens(tuple(prompt), 400, arch)


@pytest.mark.skipif(bool(packed_linear.unavailable_reason(torch.device("cpu"), torch.float32)),
                    reason="no packed linear kernel here")
def test_stop_gives_the_model_back_and_start_takes_it_again(managers: list) -> None:
    model = tiny_model("llama", torch.float32)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    manager = cbserve.init_continuous_batching(model, greedy(4), small(prepack_weights=True))
    managers.append(manager)
    manager.start()
    assert model.config._attn_implementation == "cbserve_paged" and packed(model)
    assert final(manager, manager.add_request([1, 2, 3])).status == RequestStatus.FINISHED
    manager.stop()
    assert model.config._attn_implementation == "sdpa" and not packed(model)
    assert [m for m in model.modules() if type(m) is torch.nn.Linear] == linears
    assert set(dict(model.named_parameters())) == set(dict(tiny_model("llama").named_parameters()))
    manager.start()
    assert model.config._attn_implementation == "cbserve_paged" and packed(model)
    assert final(manager, manager.add_request([1, 2, 3])).status == RequestStatus.FINISHED


def test_an_engine_dropped_without_release_does_not_hold_the_model(managers: list) -> None:
    model = tiny_model("llama")
    build_engine(model, greedy(4), small())  # never released
    gc.collect()
    assert model.config._attn_implementation == "cbserve_paged"  # left switched; plain calls still work
    logits, tokens = forward_and_generate(model)
    expected_logits, expected_tokens = forward_and_generate(ref_model())
    assert torch.equal(logits, expected_logits) and torch.equal(tokens, expected_tokens)
    manager = cbserve.init_continuous_batching(model, greedy(4), small())
    managers.append(manager)
    manager.start()
    manager.stop()  # the last live engine out gives the model its own attention back
    assert model.config._attn_implementation == "sdpa"


# -- pause ---------------------------------------------------------------------------------------


def test_pause_keeps_requests_in_flight_and_takes_new_weights(managers: list) -> None:
    model = tiny_model("llama")
    manager = cbserve.init_continuous_batching(model, greedy(300), small(num_blocks=200))
    managers.append(manager)
    with pytest.raises(RuntimeError, match="no generation loop"), manager.pause():
        pass
    manager.start()
    prompts = random_prompts([12, 7])
    rid = manager.add_request(prompts[0], streaming=True)
    manager.get_result(rid, timeout=TIMEOUT)
    with manager.pause():
        stats = manager.stats()
        assert stats["running"] == 1 and stats["free_pages"] < stats["total_pages"]  # the cache is kept
        assert model.config._attn_implementation == "sdpa"
        before = list(manager.engine.requests[rid].generated)
        time.sleep(0.1)
        assert manager.engine.requests[rid].generated == before  # parked
        with pytest.raises(RuntimeError, match="inside a pause"):
            manager.stop()
        new_weights = ref_model("llama", seed=1).state_dict()
        model.load_state_dict(new_weights)  # as an RL trainer would, in place
    out = final(manager, rid)
    assert out.status == RequestStatus.FINISHED and len(out.generated_tokens) == 300
    assert before and out.generated_tokens[: len(before)] == before == ref_tokens(tuple(prompts[0]), 300)[: len(before)]
    fresh = manager.add_request(prompts[1], max_new_tokens=20)
    assert final(manager, fresh).generated_tokens == ref_tokens(tuple(prompts[1]), 20, seed=1)


def test_pause_from_several_threads_resumes_when_the_last_leaves(managers: list) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(200), small(num_blocks=200))
    managers.append(manager)
    manager.start()
    rid = manager.add_request([5, 6, 7], streaming=True)
    manager.get_result(rid, timeout=TIMEOUT)
    inside, leave = threading.Barrier(3), threading.Event()

    def holder() -> None:
        with manager.pause():
            inside.wait(TIMEOUT)
            leave.wait(TIMEOUT)

    threads = [threading.Thread(target=holder) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait(TIMEOUT)  # both hold the pause at once
    with manager.pause():
        leave.set()
        for t in threads:
            t.join(TIMEOUT)
        count = len(manager.engine.requests[rid].generated)
        time.sleep(0.05)
        assert len(manager.engine.requests[rid].generated) == count  # still parked: this thread holds it
    assert len(final(manager, rid).generated_tokens) == 200


@pytest.mark.skipif(bool(packed_linear.unavailable_reason(torch.device("cpu"), torch.float32)),
                    reason="no packed linear kernel here")
def test_pause_repacks_updated_weights(managers: list) -> None:
    model = tiny_model("llama", torch.float32)
    manager = cbserve.init_continuous_batching(model, greedy(4), small(prepack_weights=True))
    managers.append(manager)
    manager.start()
    with manager.pause():
        assert not packed(model)
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(0.5)  # through .data: no version counter sees it
    assert final(manager, manager.add_request([1, 2, 3])).status == RequestStatus.FINISHED  # the loop took it back
    layer = packed(model)[0]
    x = torch.randn(3, layer.in_features)
    expected = torch.nn.functional.linear(x, layer.original[0].weight, layer.original[0].bias)
    torch.testing.assert_close(layer(x), expected)


# -- lifecycle -----------------------------------------------------------------------------------


def test_requests_queued_before_start_run_once_started(managers: list) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(6), small())
    managers.append(manager)
    prompts = random_prompts([4, 9])
    ids = [manager.add_request(p) for p in prompts]
    assert ids == ["req_0", "req_1"]
    started = time.monotonic()
    assert manager.get_result(timeout=None) is None  # not started: nothing can come yet, no hang
    assert list(manager.request_id_iter(ids[0])) == []
    assert time.monotonic() - started < 5
    manager.start()
    for rid, prompt in zip(ids, prompts):
        assert final(manager, rid).generated_tokens == ref_tokens(tuple(prompt), 6)


def test_stop_block_timeout_keep_for_next_session_and_join(model: torch.nn.Module) -> None:
    manager = cbserve.init_continuous_batching(model, greedy(200), small(num_blocks=200))
    manager.stop()  # not started: a warning, nothing else
    manager.start()
    ids = [manager.add_request(p) for p in random_prompts([5, 8])]
    manager.stop(block=False, keep_for_next_session=True)
    with pytest.raises(RuntimeError, match="stopped"):
        manager.add_request([1, 2])
    manager.join(time.perf_counter(), timeout=TIMEOUT)
    assert not manager.is_running()
    assert all(final(manager, rid).status == RequestStatus.FINISHED for rid in ids)
    assert cbserve.init_continuous_batching(model) is manager  # kept on the model
    with cbserve.continuous_batching(model) as again:  # the kept one, started again, destroyed on exit
        assert again is manager and again.is_running()
    assert not hasattr(model, "_cbserve_manager")
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


def test_get_result_never_blocks_forever_once_nothing_can_come(managers: list) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(4), small())
    managers.append(manager)
    manager.start()
    assert manager.get_result("no-such-request", timeout=None) is None  # not live: at once
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(manager.get_result(timeout=None)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # a running manager may still produce an output
    manager.stop()
    waiter.join(5)
    assert not waiter.is_alive() and got == [None]
    manager.destroy()
    assert manager.get_result(timeout=None) is None
    assert manager.get_result("req_0", timeout=None) is None


def test_max_queue_size_refuses_with_queue_full_error(managers: list) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(5), small(max_queue_size=2))
    managers.append(manager)
    prompts = random_prompts([4, 6, 8])
    first = [manager.add_request(p) for p in prompts[:2]]  # queued before start
    with pytest.raises(cbserve.QueueFullError, match="max_queue_size=2") as info:
        manager.add_request(prompts[2])
    assert isinstance(info.value, queue.Full) and not isinstance(info.value, ValueError)
    assert info.value.waiting == 2 and manager.stats()["live_requests"] == 2
    with pytest.raises(cbserve.QueueFullError):
        manager.add_requests(prompts)
    manager.start()
    for rid, prompt in zip(first, prompts):
        assert final(manager, rid).generated_tokens == ref_tokens(tuple(prompt), 5)
    last = manager.add_request(prompts[2])  # room again
    assert final(manager, last).generated_tokens == ref_tokens(tuple(prompts[2]), 5)


def test_warmup_runs_ahead_only_when_something_compiles(managers: list, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(4), small())
    managers.append(manager)
    manager.warmup()  # eager CPU engine: nothing to capture or compile
    assert manager.warmed_up and manager.stats()["steps"] == 0
    monkeypatch.setattr(CompiledForward, "enabled", property(lambda self: True))
    manager.warmed_up = False
    manager.warmup()
    stats = manager.stats()
    assert manager.warmed_up and stats["steps"] == 2  # a varlen step of max_batch_tokens, a decode step
    assert stats["prompt_tokens_computed"] == manager.engine.max_batch_tokens
    assert stats["free_pages"] == stats["total_pages"] and not manager.engine.has_work


# -- results -------------------------------------------------------------------------------------


def test_register_result_handler_gets_every_output_on_its_loop(managers: list) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(6), small())
    managers.append(manager)
    manager.start()
    prompt = random_prompts([7])[0]

    async def main() -> list:
        received: list = []
        done = asyncio.Event()

        def handler(output) -> None:
            threads.add(threading.get_ident())
            received.append(output)
            if output.is_finished():
                done.set()

        rid = manager.add_request(prompt, streaming=True)
        manager.register_result_handler(rid, handler)
        await asyncio.wait_for(done.wait(), TIMEOUT)
        return received

    threads: set[int] = set()
    received = asyncio.run(main())
    assert threads == {threading.get_ident()}  # called on the event loop's thread
    assert [o.generated_tokens for o in received][-1] == ref_tokens(tuple(prompt), 6)
    assert [t for o in received for t in o.new_tokens] == ref_tokens(tuple(prompt), 6)
    assert manager.get_result(timeout=0.2) is None  # nothing went to the queue


def test_record_timestamps(managers: list, model: torch.nn.Module) -> None:
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(6), small())
    managers.append(manager)
    manager.start()
    timed = manager.add_request([4, 5, 6], streaming=True, record_timestamps=True)
    plain = manager.add_request([4, 5, 7])
    outs = list(manager.request_id_iter(timed))
    for out in outs:
        assert len(out.timestamps) == len(out.generated_tokens)
    last = outs[-1]
    assert last.timestamps == sorted(last.timestamps)
    assert last.created_time <= last.timestamps[0] <= last.timestamps[-1] <= last.finished_time
    assert last.timestamps[0] == pytest.approx(last.first_token_time, abs=0.5)
    assert final(manager, plain).timestamps is None
    outputs = cbserve.generate_batch(model, [[1, 2], [3, 4, 5]], greedy(4), small(), progress_bar=False,
                                     record_timestamps=True)
    assert [len(o.timestamps) for o in outputs.values()] == [4, 4]


def test_generate_batch_returns_the_others_when_some_fail(model: torch.nn.Module) -> None:
    prompts = random_prompts([5, 9])
    inputs = [prompts[0], [], [1, VOCAB + 3], prompts[1]]
    assert list(cbserve.generate_batch(model, inputs, greedy(4), small(), progress_bar=False)) == [
        "req_0", "req_1", "req_2", "req_3"]
    for outputs in (cbserve.generate_batch(model, inputs, greedy(4), small(), progress_bar=False),
                    cbserve.generate_batch(model, inputs, greedy(4), small(), progress_bar=False,
                                           persistent_manager=True)):
        assert len(outputs) == 4
        ok, empty, bad, ok2 = outputs.values()
        assert ok.generated_tokens == ref_tokens(tuple(prompts[0]), 4)
        assert ok2.generated_tokens == ref_tokens(tuple(prompts[1]), 4)
        for failed in (empty, bad):
            assert failed.status == RequestStatus.FAILED and failed.finish_reason == FinishReason.ERROR
            assert "input_ids" in failed.error and isinstance(failed.exception, cbserve.InvalidRequestError)


def test_workload_hints_size_the_cache_as_a_known_workload(managers: list) -> None:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=100, max_generated_length=28, num_requests=4)
    manager = cbserve.init_continuous_batching(tiny_model("llama"), greedy(28),
                                               small(num_blocks=None, max_batch_tokens=None), workload_hints=hints)
    managers.append(manager)
    # 4 requests of 128 tokens in pages of 16, one partly filled page each: 32 + 4 pages.
    assert manager.stats()["total_pages"] == 36
