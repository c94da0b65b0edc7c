"""LoRA adapters through the fronts (issue 33): `model` naming an adapter declared in
`lora_modules` runs the request with it (OpenAI HTTP and gRPC), the reply names the adapter, an
undeclared name is a 404; the replica's request path reaches the engine with the adapter (tokens
equal PEFT's merged model's). `/v1/models` lists the adapters with their `parent` (ingress, Ray)."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.cluster.settings import ClusterArgs
from cbserve.serving.api_errors import APIError
from cbserve.serving.front import grpc_service
from cbserve.serving.front.json_body import parse_request
from cbserve.serving.front.openai_service import OpenAIService
from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest
from cbserve.serving.protocol import Sampling, WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, submit
from tests.support.lora_adapters import MAX_NEW, adapter_dir, base_model, reference
from tests.support.tiny_models import random_prompts

pytest.importorskip("peft")


def _args(**fields) -> ClusterArgs:
    return ClusterArgs(served_model_name="tiny", engine={"enable_lora": True},
                       lora_modules={"sql": "/adapters/sql", "chat": "/adapters/chat"}, **fields)


@pytest.mark.parametrize("schema, body", [(CompletionRequest, {"prompt": [1, 2, 3], "n": 2}),
                                          (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
def test_model_naming_an_adapter_runs_it(schema, body) -> None:
    service = OpenAIService(_args(), open_choice=None)

    def loras(model: str) -> list[str | None]:
        req = parse_request(json.dumps({**body, "model": model}).encode(), schema)
        wreqs = service.completion_requests(req, "r") if schema is CompletionRequest else service.chat_requests(req, "r")
        return [w.sampling.engine_kwargs().get("lora") for w in wreqs]

    assert set(loras("sql")) == {"sql"} and set(loras("chat")) == {"chat"} and set(loras("tiny")) == {None}
    assert service.served_name("sql") == "sql" and service.served_name("tiny") == service.served_name(None) == "tiny"
    with pytest.raises(APIError) as err:
        loras("nope")
    assert err.value.status == 404 and err.value.param == "model"


def test_grpc_model_naming_an_adapter_runs_it() -> None:
    from cbserve.serving.protos import generate_pb2

    service = OpenAIService(_args(), open_choice=None)
    ids = generate_pb2.TokenIds(ids=[1, 2, 3])
    assert grpc_service.to_worker_request(generate_pb2.GenerateRequest(token_ids=ids, model="sql"),
                                          service).sampling.lora == "sql"
    assert grpc_service.to_worker_request(generate_pb2.GenerateRequest(token_ids=ids), service).sampling.lora is None


def test_cluster_args_refusals() -> None:
    with pytest.raises(ValueError, match="lora_modules needs engine.enable_lora"):
        ClusterArgs(lora_modules={"sql": "/a"})
    with pytest.raises(ValueError, match="'tiny' is the base model's name"):
        ClusterArgs(served_model_name="tiny", engine={"enable_lora": True}, lora_modules={"tiny": "/a"})


def test_the_replica_request_path_runs_the_adapter() -> None:
    """A `WorkerRequest` whose sampling names an adapter (as the fronts build it) reaches the
    engine with it: `generation.submit`, as the replica calls it, on a manager that loaded it."""
    folder = adapter_dir("llama", "all")  # made before an engine holds the model
    prompt = random_prompts([11], seed=13)[0]
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    cfg = cbserve.ContinuousBatchingConfig(page_size=4, num_blocks=64, enable_lora=True, per_request_processors=True)
    info = ModelInfo(eos_token_id=None, max_context=512, default_max_tokens=MAX_NEW)
    with cbserve.continuous_batching(base_model("llama"), gc, cfg) as manager:
        manager.load_lora("sql", folder)
        outs = {}
        for lora in ("sql", None):
            wreq = WorkerRequest(request_id=f"w-{lora}", prompt_ids=prompt, max_tokens=MAX_NEW,
                                 sampling=Sampling(temperature=0.0, lora=lora))
            _, rid = submit(manager, None, info, wreq)
            outs[lora] = [out for out in manager.request_id_iter(rid)][-1].generated_tokens
    assert outs["sql"] == reference("llama", "all", tuple(prompt))[0]
    assert outs[None] == reference("llama", None, tuple(prompt))[0] != outs["sql"]


def test_batch_lines_carry_their_adapter() -> None:
    from cbserve.batch.requests import RequestDefaults, to_worker_request
    from cbserve.batch.schema import BatchLine

    line = BatchLine.model_validate({"id": 1, "input_ids": [1, 2, 3], "lora": "sql"})
    assert to_worker_request(line, "r", RequestDefaults(), chat_template=False).sampling.lora == "sql"
    plain = BatchLine.model_validate({"id": 2, "input_ids": [1, 2, 3]})
    assert to_worker_request(plain, "r", RequestDefaults(), chat_template=False).sampling.lora is None
    with pytest.raises(ValueError, match="lora"):
        BatchLine.model_validate({"id": 1, "input_ids": [1, 2, 3], "lora": 5})
