"""A fault stays with the request that caused it (issue 26): a request whose own constraints
leave no token to draw, or whose logits processing or grammar raises, fails alone with a
`RequestFault` naming its fields, while the same step's other requests go on with exactly the
tokens and logprobs they get alone. A fault of no request (the forward pass) fails the live
requests, marks the manager unhealthy for good, and after MAX_FAILED_STEPS in a row ends the loop;
a step running past `step_timeout_s` makes the health check fail while it runs."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve import FinishReason, RequestStatus
from cbserve.errors import RequestFault
from cbserve.manager import MAX_FAILED_STEPS
from cbserve.workers import validation
from cbserve.workers.engine import EngineCore
from cbserve.workers.factory import build_engine
from cbserve.workers.logits_processors import LogitsProcessing
from cbserve.workers.structured import GrammarState, StructuredOutputs
from tests.support.manager import TIMEOUT, get, get_final, hang_guard, make_manager, ref_tokens  # noqa: F401
from tests.support.tiny_models import random_prompts, tiny_model

MAX_NEW = 12


@functools.cache
def tokenizer():
    return cbserve.load_model(dtype="float32")[1]


@functools.cache
def real_vocab_model():
    """Random weights over the default model's vocabulary, float64: grammars need its tokenizer."""
    return tiny_model("llama", vocab_size=len(tokenizer()))


def run(specs: list[dict], config: dict | None = None) -> tuple[list, EngineCore]:
    """One engine stepping requests together; `specs`: each request's sampling options, and
    `grammar`, `prompt` (an index; default the request's own) and `min_new_tokens_after_admission`
    (set after admission: a combination that admission cannot prove infeasible)."""
    model = real_vocab_model()
    eos = tokenizer().eos_token_id
    structured = StructuredOutputs(tokenizer(), model.config.vocab_size, [eos])
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, return_logprobs=True,
                                           per_request_processors=True, **(config or {}))
    engine = build_engine(model, gc, cfg)
    prompts = random_prompts([7, 19, 11, 25, 9, 14], vocab=len(tokenizer()))
    try:
        requests = []
        for i, spec in enumerate(specs):
            spec = dict(spec)
            grammar = spec.pop("grammar", None)
            late_min = spec.pop("min_new_tokens_after_admission", None)
            prompt = prompts[spec.pop("prompt", i) % len(prompts)]
            sampling = validation.sampling(engine.default_sampling(), True, model.config.vocab_size, **spec)
            request = engine.make_request(prompt, f"req_{i}", sampling=sampling,
                                          grammar=None if grammar is None else structured.compile(*grammar))
            if late_min is not None:
                request.sampling = dataclasses.replace(request.sampling, min_new_tokens=late_min)
            requests.append(request)
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return requests, engine


BENIGN = [{}, {"repetition_penalty": 1.3}, {"temperature": 1.0, "seed": 7}, {"grammar": ("regex", "[a-z ]{4,30}")}]


def alone(index: int) -> tuple[list[int], list[float]]:
    """The benign request `index` of BENIGN run with nothing else, on the same prompt."""
    (request,), _ = run([{**BENIGN[index], "prompt": index}])
    return request.generated, request.logprobs


def assert_benign_as_alone(requests: list) -> None:
    for i in range(len(BENIGN)):
        tokens, logprobs = alone(i)
        assert requests[i].status == RequestStatus.FINISHED, (i, requests[i].error)
        assert requests[i].generated == tokens, i
        assert requests[i].logprobs == pytest.approx(logprobs, abs=1e-9), i


@pytest.mark.default_model
def test_a_grammar_that_can_only_end_under_min_tokens_fails_alone() -> None:
    """The issue's case: a choice that is complete while min_tokens bars EOS leaves no token; the
    request fails naming both fields, the others get exactly their tokens alone."""
    hostile = {"grammar": ("choice", ["yes"]), "min_new_tokens_after_admission": 8}
    requests, engine = run([*BENIGN, hostile])
    bad = requests[-1]
    assert bad.status == RequestStatus.FAILED and bad.finish_reason == FinishReason.ERROR
    assert isinstance(bad.exception, RequestFault) and bad.exception.field == "grammar"
    assert "grammar and min_new_tokens" in bad.exception.message
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert_benign_as_alone(requests)


@pytest.mark.default_model
def test_logits_processing_that_raises_fails_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    original = LogitsProcessing._barred

    def barred(logits, requests, rows):
        if any(requests[i].request_id == "req_4" for i in rows):
            raise IndexError("index 99999 is out of bounds")
        return original(logits, requests, rows)

    monkeypatch.setattr(LogitsProcessing, "_barred", staticmethod(barred))
    requests, _ = run([*BENIGN, {"repetition_penalty": 1.1}])
    bad = requests[-1]
    assert bad.status == RequestStatus.FAILED and isinstance(bad.exception, RequestFault)
    assert bad.exception.field == "logits_processors" and "IndexError" in bad.exception.message
    assert "99999" not in bad.exception.message  # our words reach the client, not the exception's
    monkeypatch.setattr(LogitsProcessing, "_barred", staticmethod(original))
    assert_benign_as_alone(requests)


@pytest.mark.default_model
def test_a_grammar_refusing_its_token_fails_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    original = GrammarState.accept
    refusing: list[GrammarState] = []

    def accept(self, token):
        if self in refusing:
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")
        return original(self, token)

    init = GrammarState.__init__

    def tracked_init(self, grammar):
        init(self, grammar)
        if grammar.source == "(maybe)":
            refusing.append(self)

    monkeypatch.setattr(GrammarState, "accept", accept)
    monkeypatch.setattr(GrammarState, "__init__", tracked_init)
    requests, _ = run([*BENIGN, {"grammar": ("choice", ["maybe"])}])
    bad = requests[-1]
    assert bad.status == RequestStatus.FAILED and isinstance(bad.exception, RequestFault)
    assert bad.exception.field == "grammar" and len(bad.generated) == 1
    monkeypatch.undo()
    assert_benign_as_alone(requests)


# -- the manager: faults of no request -----------------------------------------------------------


def test_a_failed_admission_fails_that_request_alone(make_manager) -> None:  # noqa: F811
    manager = make_manager(num_blocks=200)
    prompts = random_prompts([7, 12, 5])
    running = manager.add_request(prompts[0], max_new_tokens=900, streaming=True)
    get(manager, running)
    engine, original = manager.engine, manager.engine.add_request

    def broken_add(request) -> None:
        engine.add_request = original  # once
        raise RuntimeError("boom in add")

    engine.add_request = broken_add
    bad = manager.add_request(prompts[1], max_new_tokens=5)
    out = get_final(manager, bad)
    assert out.status == RequestStatus.FAILED and "boom in add" in out.error
    manager.check_health()  # one request's admission is no engine fault
    manager.cancel_request(running)
    out = get_final(manager, running)
    assert out.status == RequestStatus.CANCELLED
    assert out.generated_tokens == ref_tokens(prompts[0], len(out.generated_tokens))
    assert get(manager, manager.add_request(prompts[2])).generated_tokens == ref_tokens(prompts[2], 8)


def failing_forward(manager, fail: threading.Event) -> None:
    runner, original = manager.engine.runner, manager.engine.runner.run

    def run(kwargs):
        if fail.is_set():
            raise RuntimeError("kernel fault")
        return original(kwargs)

    runner.run = run


def test_an_engine_fault_marks_the_manager_unhealthy(make_manager) -> None:  # noqa: F811
    manager = make_manager(num_blocks=200)
    fail = threading.Event()
    failing_forward(manager, fail)
    prompt = random_prompts([9])[0]
    manager.check_health()
    fail.set()
    out = get_final(manager, manager.add_request(prompt, max_new_tokens=4))
    assert out.status == RequestStatus.FAILED and "kernel fault" in out.error
    with pytest.raises(RuntimeError, match="the engine failed a step.*kernel fault"):
        manager.check_health()
    fail.clear()  # transient: the loop still serves, but the replica stays marked for replacement
    assert get(manager, manager.add_request(prompt)).generated_tokens == ref_tokens(prompt, 8)
    with pytest.raises(RuntimeError, match="the engine failed a step"):
        manager.check_health()


def test_an_engine_failing_every_step_stops_its_loop(make_manager) -> None:  # noqa: F811
    manager = make_manager(num_blocks=200)
    fail = threading.Event()
    failing_forward(manager, fail)
    fail.set()
    prompt = random_prompts([9])[0]
    for _ in range(MAX_FAILED_STEPS):
        assert get_final(manager, manager.add_request(prompt, max_new_tokens=4)).status == RequestStatus.FAILED
    deadline = time.monotonic() + TIMEOUT
    while manager.is_running():
        assert time.monotonic() < deadline, "the loop of an engine failing every step still runs"
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=f"failed {MAX_FAILED_STEPS} steps in a row"):
        manager.add_request(prompt)
    with pytest.raises(RuntimeError, match="not running"):
        manager.check_health()


def test_the_step_watchdog_fails_health_while_a_step_is_stuck(make_manager) -> None:  # noqa: F811
    manager = make_manager(num_blocks=200, step_timeout_s=0.3)
    runner, original = manager.engine.runner, manager.engine.runner.run
    stuck, release = threading.Event(), threading.Event()

    def run(kwargs):
        if not stuck.is_set():
            stuck.set()
            release.wait(TIMEOUT)
        return original(kwargs)

    runner.run = run
    prompt = random_prompts([9])[0]
    rid = manager.add_request(prompt, max_new_tokens=3)
    assert stuck.wait(TIMEOUT)
    manager.check_health()  # under the limit
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match="step has run for .* beyond step_timeout_s=0.3"):
        manager.check_health()
    release.set()
    assert get_final(manager, rid).generated_tokens == ref_tokens(prompt, 3)
    manager.check_health()  # a slow step is not a fault once it ends
