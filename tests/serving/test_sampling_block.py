"""One typed sampling block from the fronts to the manager (issue 27): every front builds the same
`Sampling` for the same values, a `WorkerRequest` carries it as is, and the replica hands its
fields to `add_request` unchanged, each one a keyword the engine takes."""

from __future__ import annotations

import asyncio
from typing import Any

from cbserve.batch.requests import RequestDefaults, to_worker_request
from cbserve.cluster.settings import ClusterArgs
from cbserve.serving.front import grpc_service
from cbserve.serving.front.openai_service import OpenAIService
from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest
from cbserve.serving.protocol import Sampling, WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, run_request
from cbserve.workers import validation

# Every sampling value a client can set, as the engine takes it; floats exact in float32 (gRPC's).
VALUES: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.75, "top_k": 5, "seed": 7, "min_p": 0.125, "repetition_penalty": 1.25,
    "presence_penalty": 0.25, "frequency_penalty": 0.375, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [3],
    "prompt_logprobs": 1, "cache_salt": "salt",
}
EXPECTED = Sampling(**VALUES, logit_bias={5: 1.5}, top_logprobs=2, priority=-1, speculative=False)


def _service() -> OpenAIService:
    return OpenAIService(ClusterArgs(), open_choice=None)


def _own(block: Sampling) -> Sampling:
    """The block without what the server sets per call (parent request, tenant)."""
    return block.model_copy(update={"parent_id": None, "tenant": None})


def test_the_block_holds_only_add_request_keywords() -> None:
    engine = (set(validation.SAMPLING_FIELDS) | set(validation.OPTIONS) | set(validation.SCHEDULING_FIELDS)
              | {"cache_salt", "speculative", "lora"})
    assert set(Sampling.model_fields) <= engine, set(Sampling.model_fields) - engine


def test_every_front_builds_the_same_block() -> None:
    from cbserve.batch.schema import BatchLine
    from cbserve.serving.protos import generate_pb2

    client = {**VALUES, "logit_bias": {"5": 1.5}, "priority": -1, "speculative": False}
    chat = _service().chat_requests(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, n=2, **client), "chat-1")
    completion = _service().completion_requests(CompletionRequest(prompt="hi", logprobs=2, **client), "cmpl-1")
    line = to_worker_request(BatchLine.model_validate({"id": 1, "prompt": "hi", "logprobs": True, "top_logprobs": 2,
                                                       **client}), "batch-1", RequestDefaults(), chat_template=False)
    sampling = generate_pb2.SamplingParams(**{**VALUES, "logit_bias": {5: 1.5}}, top_logprobs=2, logprobs=True)
    grpc = grpc_service.to_worker_request(generate_pb2.GenerateRequest(prompt="hi", sampling=sampling), _service())
    assert [_own(w.sampling) for w in (chat[0], completion[0], line)] == [EXPECTED] * 3
    # Neither priority nor speculative in the proto.
    assert _own(grpc.sampling) == EXPECTED.model_copy(update={"priority": None, "speculative": None})
    assert chat[1].sampling.seed == 8  # each choice its own seed: the call's + its index
    assert [w.sampling.parent_id for w in (chat[0], completion[0], line, grpc)] == [
        "chat-1", "cmpl-1", "batch-1", grpc.request_id]


def test_a_left_out_value_takes_the_deployment_default_and_the_rest_stay_off() -> None:
    args = ClusterArgs(generation={"temperature": 0.25, "top_p": 0.5, "top_k": 3})
    (wreq,) = OpenAIService(args, open_choice=None).completion_requests(CompletionRequest(prompt="hi"), "cmpl-2")
    assert wreq.sampling.engine_kwargs() == {"temperature": 0.25, "top_p": 0.5, "top_k": 3, "parent_id": "cmpl-2"}


def test_the_replica_hands_the_block_to_the_manager_as_is() -> None:
    calls: list[dict[str, Any]] = []

    class Recording:  # refuses after recording: no stream to run
        def add_request(self, input_ids: list[int], **kwargs: Any) -> str:
            calls.append(kwargs)
            raise RuntimeError("recorded")

    class Tok:
        def __call__(self, text: str) -> Any:
            return type("Enc", (), {"input_ids": [1, 2, 3]})()

    block = EXPECTED.model_copy(update={"parent_id": "p", "tenant": "t"})
    wreq = WorkerRequest(request_id="r", prompt="x", max_tokens=4, sampling=block)
    info = ModelInfo(eos_token_id=0, max_context=64, default_max_tokens=4)
    asyncio.run(run_request(Recording(), Tok(), info, wreq, "local").__anext__())
    fixed = {"request_id": "r", "max_new_tokens": 4, "streaming": True, "eos_token_id": 0, "grammar": None,
             "logprobs": False}
    assert calls == [{**fixed, **block.engine_kwargs()}]
    # Every field set (none dropped on the way) but `lora`, which a front sets from the request's
    # `model` (tests/serving/test_lora_front.py).
    assert set(block.engine_kwargs()) == set(Sampling.model_fields) - {"lora"}


def test_the_manager_protocol_names_what_the_request_path_uses() -> None:
    import ast
    import inspect

    import cbserve
    from cbserve.serving.replica import generation

    tree = ast.parse(inspect.getsource(generation))
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "manager"}
    declared = {name for name in vars(generation.Manager) if not name.startswith("_")}
    assert used == declared, (used, declared)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for name in declared:  # the real manager takes every call the protocol allows (bind raises TypeError)
        named = {p.name: None for p in inspect.signature(getattr(generation.Manager, name)).parameters.values()
                 if p.kind in kinds}
        inspect.signature(getattr(cbserve.ContinuousBatchingManager, name)).bind(**named)
