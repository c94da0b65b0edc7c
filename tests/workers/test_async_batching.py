"""Async batching's logic on a CPU: the next pass is scheduled and prepared before the previous
pass's tokens are read, decode inputs come from the device, and the result is exactly that of
synchronous steps (tokens, logprobs, EOS, preemption, cancellation, sampled requests).

The config refuses `use_async_batching=True` without CUDA (tests/test_config.py); these tests
switch the engine's `async_batching` on after construction, which runs the same code path."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.workers import async_batching
from cbserve.workers.factory import build_engine
from cbserve.workers.input_staging import InputStaging
from tests.support.exactness import assert_matches_reference, run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

LENGTHS = [1, 9, 40, 70, 130]
MAX_NEW = 8


def async_on(engine) -> None:
    engine.async_batching = True


def config(**overrides) -> cbserve.ContinuousBatchingConfig:
    base = {"page_size": 16, "num_blocks": 80, "max_batch_tokens": 96, "return_logprobs": True}
    return cbserve.ContinuousBatchingConfig(**{**base, **overrides})


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_async_equals_generate(arch: str) -> None:
    model = tiny_model(arch)
    prompts = random_prompts(LENGTHS)
    requests, _engine = run_engine(model, prompts, config(), MAX_NEW, async_on)
    assert_matches_reference(requests, [reference_generate(model, p, MAX_NEW) for p in prompts])
    assert all(r.num_inflight == 0 for r in requests)


EVENT_LOG: list[tuple[str, int]] = []


class RecordingEvent:
    """Stands in for torch.cuda.Event: logs when a staging buffer's copy is recorded and awaited."""

    def record(self) -> None:
        EVENT_LOG.append(("record", id(self)))

    def synchronize(self) -> None:
        EVENT_LOG.append(("wait", id(self)))


def staged(engine) -> None:
    """Inputs through double-buffered staging (CUDA's path), unpinned on a CPU."""
    engine.runner.staging = InputStaging(engine.device, pin=False, event_factory=RecordingEvent)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_async_with_staged_inputs_equals_generate(backend: str) -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts(LENGTHS)
    requests, engine = run_engine(model, prompts, config(attention_backend=backend), MAX_NEW,
                                  lambda e: (async_on(e), staged(e)))
    assert_matches_reference(requests, [reference_generate(model, p, MAX_NEW) for p in prompts])
    assert engine.runner.staging.buffers[1].numel() > 0  # both buffers were used


def test_staging_alternates_buffers_and_waits_for_each_buffers_last_copy() -> None:
    EVENT_LOG.clear()
    staging = InputStaging(torch.device("cpu"), pin=False, event_factory=RecordingEvent)
    first, second = staging.events
    a = staging.send([torch.arange(5), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)])
    b = staging.send([torch.arange(3) + 10])
    c = staging.send([torch.arange(40)])  # buffer 0 again, grown
    assert EVENT_LOG == [("wait", id(first)), ("record", id(first)), ("wait", id(second)),
                         ("record", id(second)), ("wait", id(first)), ("record", id(first))]
    assert a[0].tolist() == list(range(5)) and a[1].dtype == torch.int32 and a[1].tolist() == [[1, 2], [3, 4]]
    assert b[0].tolist() == [10, 11, 12] and c[0].tolist() == list(range(40))
    assert staging.buffers[0].numel() >= 40 and staging.buffers[1].numel() == 3
    assert a[0].data_ptr() != staging.buffers[0].data_ptr()  # results never alias a staging buffer


def test_async_under_preemption_and_chunked_prefill() -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts(LENGTHS)
    cfg = config(num_blocks=14, max_batch_tokens=40, allow_block_sharing=False)
    requests, engine = run_engine(model, prompts, cfg, MAX_NEW, async_on)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_reference(requests, [reference_generate(model, p, MAX_NEW) for p in prompts])


def test_next_pass_is_prepared_before_the_previous_tokens_are_read(monkeypatch) -> None:
    events = []
    results = async_batching.InFlightStep.results
    monkeypatch.setattr(async_batching.InFlightStep, "results",
                        lambda self: events.append("read") or results(self))
    model = tiny_model("llama")

    def setup(engine):
        async_on(engine)
        prepare = engine.runner.prepare
        engine.runner.prepare = lambda batch, in_flight=None: events.append(
            "prepare+device" if in_flight is not None and any(
                s.request.num_computed == len(s.request.tokens) for s in batch) else "prepare") or prepare(
            batch, in_flight)

    run_engine(model, random_prompts([5, 7]), config(), 4, setup)
    # Pass 1 prepared, then pass 2 prepared with inputs from the device before pass 1 is read...
    assert events[:3] == ["prepare", "prepare+device", "read"]
    assert events.count("prepare+device") >= 2 and events[-1] == "read"


def test_eos_one_step_late_is_dropped_and_frees_everything() -> None:
    model = tiny_model("llama")
    prompts = random_prompts([5, 40, 12])
    refs = [reference_generate(model, p, 8) for p in prompts]
    eos = refs[1][0][3]
    requests, engine = run_engine(model, prompts, config(), 8, async_on, eos_token_id=eos)
    for (tokens, _), request in zip(refs, requests):
        expected = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        assert request.generated == expected  # the row computed after EOS left no token
        assert request.finish_reason == (cbserve.FinishReason.EOS if eos in tokens else cbserve.FinishReason.LENGTH)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_cancel_while_in_flight() -> None:
    model = tiny_model("llama")
    gc = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None)
    engine = build_engine(model, gc, config())
    try:
        async_on(engine)
        a, b = engine.make_request([1, 2, 3], "a"), engine.make_request([4, 5], "b")
        engine.add_request(a)
        engine.add_request(b)
        engine.step()
        engine.step()  # a and b each have a token on the device now
        assert a.num_inflight == 1
        engine.cancel_request("a")
        seen = len(a.generated)
        while engine.has_work:
            assert a not in engine.step()
        assert len(a.generated) == seen and a.status == cbserve.RequestStatus.CANCELLED
        assert len(b.generated) == 20
    finally:
        engine.release_model()


def test_steps_with_sampled_requests_run_synchronously_and_match() -> None:
    """A sampled request's sampler uses host generators: its steps fall back to sync; a seeded
    request's tokens are those of a fully synchronous engine."""
    model = tiny_model("llama", dtype=torch.float32)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    outputs = []
    for use_async in (False, True):
        engine = build_engine(model, gc, config(per_request_processors=True, return_logprobs=False))
        try:
            engine.async_batching = use_async
            greedy = engine.make_request([1, 2, 3, 4], "greedy")
            sampled = engine.make_request([5, 6, 7], "sampled", sampling=cbserve.scheduler.request.SamplingParams(
                do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=7))
            engine.add_request(greedy)
            engine.step()
            engine.step()  # greedy alone: async, a token in flight
            assert greedy.num_inflight == int(use_async)
            engine.add_request(sampled)
            while engine.has_work:
                engine.step()
            outputs.append((greedy.generated, sampled.generated))
        finally:
            engine.release_model()
    assert outputs[0] == outputs[1]


def test_async_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="use_async_batching=True works with tp_size=1 only"):
        cbserve.ContinuousBatchingConfig(use_async_batching=True, tp_size=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the pass really overlaps the host work")
def test_real_async_batching_on_cuda_equals_generate() -> None:
    model = tiny_model("llama", dtype=torch.float32)
    prompts = random_prompts(LENGTHS)
    refs = [reference_generate(model, p, MAX_NEW) for p in prompts]
    cfg = config(use_async_batching=True, use_cuda_graph=True, max_blocks_per_request=16)
    requests, engine = run_engine(model.cuda(), prompts, cfg, MAX_NEW)
    assert engine.async_batching and engine.runner.graphs is not None and engine.runner.staging is not None
    assert_matches_reference(requests, refs, tol=1e-3)


def test_default_is_on_with_graphs_unless_the_host_needs_each_step() -> None:
    """None follows transformers' rule: on with CUDA graphs; off with speculation or tensor parallelism
    (their steps' tokens are needed on the host); an explicit choice is kept."""
    plain = config()
    speculating = config(speculative={"method": "ngram"})
    assert async_batching.wanted(plain, has_graphs=True, tensor_parallel=False)
    assert not async_batching.wanted(plain, has_graphs=False, tensor_parallel=False)
    assert not async_batching.wanted(plain, has_graphs=True, tensor_parallel=True)
    assert not async_batching.wanted(speculating, has_graphs=True, tensor_parallel=False)
    assert not async_batching.wanted(config(use_async_batching=False), has_graphs=True, tensor_parallel=False)
