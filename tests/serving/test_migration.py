"""Stream migration without Ray (`cluster/migration.py` over the replica's request path,
`run_request`, on the tiny model): a choice whose replica fails after some deltas is continued
elsewhere and its client sees exactly the undisturbed choice (text, tokens, logprobs, usage,
finish), whatever the cut point and the way the replica lost it, with stop strings, seeded
sampling and a JSON schema; attempts are bounded; refusals are not retried."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

import cbserve
from cbserve.cluster.migration import MigratingChoice
from cbserve.serving.api_errors import error_event
from cbserve.serving.constraints import Grammars
from cbserve.serving.front.replies import ChoiceResult, fold
from cbserve.serving.protocol import Constraint, Sampling, WorkerEvent, WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, run_request
from tests.support.cluster import running_manager, tiny_model_dir

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "n"],
          "properties": {"answer": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return cbserve.load_model(str(tiny_model_dir(tmp_path_factory)), dtype="float32")


@pytest.fixture(scope="module")
def manager(loaded: tuple[Any, Any]) -> Any:
    with running_manager(loaded[0], num_blocks=256) as mgr:
        yield mgr


@pytest.fixture(scope="module")
def info(loaded: tuple[Any, Any]) -> ModelInfo:
    model, tok = loaded
    eos = model.config.eos_token_id
    return ModelInfo(eos_token_id=eos, max_context=1024, default_max_tokens=16,
                     grammars=Grammars(tok, model.config.vocab_size, eos))


class Replicas:
    """Replicas "r0", "r1", ... over one manager; the first open one loses its choice at the
    first delta after `cut` tokens were sent (or, having sent them all, instead of its end), the
    way `how` says."""

    def __init__(self, manager: Any, tokenizer: Any, info: ModelInfo, cut: int | None = None, how: str = "raise"):
        self.manager, self.tokenizer, self.info = manager, tokenizer, info
        self.cut, self.how = cut, how
        self.opened: list[WorkerRequest] = []

    async def open(self, wreq: WorkerRequest) -> tuple[WorkerEvent, Any]:
        name = f"r{len(self.opened)}"
        self.opened.append(wreq)
        gen = run_request(self.manager, self.tokenizer, self.info, wreq, name)
        first = await gen.__anext__()
        if len(self.opened) == 1 and self.cut is not None:
            gen = self._failing(gen)
        return first, gen

    async def _failing(self, gen: Any) -> Any:
        sent = 0
        async for ev in gen:
            if (ev.kind == "delta" and sent >= self.cut) or ev.kind == "end":
                await gen.aclose()  # the engine request is cancelled, as a dead replica's pages are lost
                if self.how == "raise":
                    raise RuntimeError("ActorDiedError: the actor died unexpectedly")
                if self.how == "error":
                    yield error_event(503, "the engine failed; retry the request")
                elif self.how == "abort":
                    yield WorkerEvent(kind="end", finish_reason="abort", completion_tokens=sent)
                return  # how == "cut": the stream just stops
            sent += len(ev.token_ids)
            yield ev


def _choice(replicas: Replicas, wreq: WorkerRequest, max_attempts: int = 3) -> tuple[ChoiceResult, MigratingChoice]:
    async def run() -> tuple[ChoiceResult, MigratingChoice]:
        first, gen = await replicas.open(wreq)
        choice = MigratingChoice(wreq, first, gen, replicas.open, max_attempts)
        result = ChoiceResult()
        result.add(first)
        return await fold(choice.events(), result), choice
    return asyncio.run(run())


IDS = itertools.count()
CASES = {
    # Prompts whose outputs on the tiny model are varied text (many prompts give one token again and again).
    "greedy": {"prompt": "The sea", "max_tokens": 24},
    "stop-string": {"prompt": "1 2 3 4", "max_tokens": 30},  # stop set from the undisturbed text
    "seeded": {"prompt": "a seeded sample", "max_tokens": 24,
               "sampling": Sampling(temperature=1.0, seed=11, presence_penalty=0.5, top_logprobs=2)},
    "json-schema": {"prompt": "answer as JSON:", "max_tokens": 40,
                    "constraint": Constraint(kind="json_schema", spec=SCHEMA)},
}


def _request(case: str, **extra: Any) -> WorkerRequest:
    body = dict(CASES[case])
    body.setdefault("sampling", Sampling(temperature=0.0))
    # A fresh id each time: a cut choice's engine request may still be live (cancelled) on the manager.
    return WorkerRequest(request_id=f"{case}-{next(IDS)}", logprobs=True, **body, **extra)


def _same(got: ChoiceResult, want: ChoiceResult) -> None:
    assert got.error is None, got.error
    assert got.text == want.text
    assert got.token_ids == want.token_ids
    assert got.token_texts == want.token_texts
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert got.top_logprobs == want.top_logprobs or all(
        [t for t, _, _ in a] == [t for t, _, _ in b] for a, b in zip(got.top_logprobs, want.top_logprobs))
    assert (got.finish_reason, got.completion_tokens) == (want.finish_reason, want.completion_tokens)
    assert got.completion_tokens == len(got.token_ids)


@pytest.mark.parametrize("case", list(CASES))
def test_a_migrated_choice_equals_the_undisturbed_one(case: str, manager: Any, loaded: Any, info: ModelInfo) -> None:
    tok = loaded[1]
    stop: list[str] = []
    if case == "stop-string":  # a stop string the output meets after the cut points
        free = _choice(Replicas(manager, tok, info), _request(case))[0]
        stop = [free.text[len(free.text) // 2 : len(free.text) // 2 + 3]]
    want, _ = _choice(Replicas(manager, tok, info), _request(case, stop=stop))
    assert want.error is None and len(want.token_ids) >= 6 and len(set(want.token_ids)) >= 4, want
    assert not stop or want.finish_reason == "stop", want
    # Cut after the first token, a few, most, and after the last one (before the end event).
    for cut, how in ((1, "raise"), (3, "error"), (len(want.token_ids) - 2, "abort"), (2, "cut"), (10**6, "raise")):
        replicas = Replicas(manager, tok, info, cut=cut, how=how)
        got, choice = _choice(replicas, _request(case, stop=stop))
        _same(got, want)
        assert choice.replicas == ["r0", "r1"] and choice.attempts == 1, (cut, how)
        cont = replicas.opened[1]
        sent = cont.resume.token_ids
        assert len(sent) >= min(cut, len(want.token_ids)) and sent == want.token_ids[: len(sent)], (cut, how)
        assert cont.avoid_replicas == ["r0"]


def test_the_prompt_is_not_echoed_twice(manager: Any, loaded: Any, info: ModelInfo) -> None:
    want, _ = _choice(Replicas(manager, loaded[1], info), _request("greedy", echo=True))
    got, _ = _choice(Replicas(manager, loaded[1], info, cut=2), _request("greedy", echo=True))
    assert got.prompt == want.prompt and got.prompt.text == "The sea"
    _same(got, want)


def test_attempts_are_bounded_and_refusals_not_retried(manager: Any, loaded: Any, info: ModelInfo) -> None:
    tok = loaded[1]

    class NoneLeft(Replicas):
        async def open(self, wreq: WorkerRequest) -> tuple[WorkerEvent, Any]:
            if self.opened:
                self.opened.append(wreq)
                raise RuntimeError("no replica")
            return await super().open(wreq)

    replicas = NoneLeft(manager, tok, info, cut=2)
    got, choice = _choice(replicas, _request("greedy"), max_attempts=2)
    assert got.error is not None and got.error.status == 503 and "2 attempts" in got.error.message
    assert len(replicas.opened) == 3 and choice.attempts == 2

    class Refusing(Replicas):
        async def open(self, wreq: WorkerRequest) -> tuple[WorkerEvent, Any]:
            if self.opened:
                self.opened.append(wreq)
                return error_event(400, "max_tokens: too long", "max_tokens"), None
            return await super().open(wreq)

    replicas = Refusing(manager, tok, info, cut=2)
    got, choice = _choice(replicas, _request("greedy"))
    assert got.error is not None and got.error.status == 400 and len(replicas.opened) == 2


def test_a_choice_that_ends_or_is_refused_does_not_migrate(manager: Any, loaded: Any, info: ModelInfo) -> None:
    replicas = Replicas(manager, loaded[1], info)
    got, choice = _choice(replicas, _request("greedy"))
    assert got.error is None and choice.attempts == 0 and len(replicas.opened) == 1


def test_a_request_opts_out_with_migrate_false() -> None:
    """`"migrate": false` reaches every choice's WorkerRequest (the ingress then opens no
    continuation); a non-boolean is refused naming the field."""
    import json

    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.front.json_body import parse_request
    from cbserve.serving.front.openai_service import OpenAIService
    from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest

    service = OpenAIService(ClusterArgs(served_model_name="tiny"), None)
    body = {"model": "tiny", "prompt": "hi", "n": 2}
    on = service.completion_requests(parse_request(json.dumps(body).encode(), CompletionRequest), "cmpl-1")
    off = service.completion_requests(parse_request(json.dumps({**body, "migrate": False}).encode(),
                                                    CompletionRequest), "cmpl-2")
    assert [w.migrate for w in on] == [True, True] and [w.migrate for w in off] == [False, False]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "migrate": False}
    assert not service.chat_requests(parse_request(json.dumps(chat).encode(), ChatCompletionRequest), "c-1")[0].migrate
    with pytest.raises(Exception) as err:
        parse_request(json.dumps({**body, "migrate": "no"}).encode(), CompletionRequest)
    assert "migrate" in str(err.value)
