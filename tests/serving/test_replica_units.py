"""Serving and cluster logic without a Ray cluster: detokenizer, stop strings, prefix hashes, the
replica's request path on a real manager, the OpenAI service, the router's choices, offload
shares, settings."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

import cbserve
from cbserve.cluster.offload import node_budget_gib, replicas_fitting
from cbserve.cluster.settings import ClusterArgs, CpuOffloadConfig
from cbserve.serving.api_errors import APIError, openai_error, refusal
from cbserve.serving.front.openai_service import OpenAIService
from cbserve.serving.front.prefix import chat_routing_text, prefix_hashes
from cbserve.serving.front.replies import ChoiceStream
from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest
from cbserve.serving.protocol import Sampling, WorkerRequest
from cbserve.serving.replica.detokenizer import IncrementalDetokenizer, StopStringMatcher
from cbserve.serving.replica.generation import ModelInfo, run_request
from tests.support.cluster import FakeReplica, running_manager, tiny_model_dir

# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, str]:
    path = str(tiny_model_dir(tmp_path_factory))
    model, tokenizer = cbserve.load_model(path)
    return model, tokenizer, path


@pytest.fixture(scope="module")
def tokenizer(loaded: tuple[Any, Any, str]) -> Any:
    return loaded[1]


@pytest.fixture(scope="module")
def manager(loaded: tuple[Any, Any, str]) -> Any:
    with running_manager(loaded[0]) as mgr:
        yield mgr


@pytest.fixture(scope="module")
def info(loaded: tuple[Any, Any, str]) -> ModelInfo:
    model = loaded[0]
    return ModelInfo(eos_token_id=model.config.eos_token_id, max_context=512, default_max_tokens=16)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _events(mgr: Any, tok: Any, info: ModelInfo, req: WorkerRequest) -> list[Any]:
    return [ev async for ev in run_request(mgr, tok, info, req, "local")]


async def _pages_back(mgr: Any, timeout: float = 10.0) -> dict[str, int]:
    for _ in range(int(timeout / 0.05)):
        s = mgr.stats()
        if s["free_pages"] == s["total_pages"] and s["running"] == 0 and s["waiting"] == 0:
            return s
        await asyncio.sleep(0.05)
    return mgr.stats()


def _direct_greedy(mgr: Any, ids: list[int], n: int) -> list[int]:
    rid = mgr.add_request(ids, max_new_tokens=n, temperature=0.0)
    out = None
    for out in mgr.request_id_iter(rid):
        pass
    return list(out.generated_tokens)


# ---- detokenizer and stop strings -------------------------------------------------------------


def test_detokenizer_streams_multibyte_text_without_broken_characters(tokenizer: Any) -> None:
    text = "hello café 日本 東京 🙂 ünïcödé ½ — über naïve"
    ids = tokenizer(text).input_ids
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert deltas[0] != ""  # the first token's text is flushed at once


def test_detokenizer_deltas_concatenate_to_full_decode(tokenizer: Any) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tokenizer)
        pieces, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 3)
            pieces.append(detok.step(ids[i : i + k]))
            i += k
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_stop_matcher_catches_stop_split_across_deltas() -> None:
    m = StopStringMatcher(["END", "xyz"])
    emitted = m.feed("abc E") + m.feed("N") + m.feed("D tail")
    assert m.stopped and emitted == "abc "
    assert m.flush() == ""


def test_a_stop_string_cuts_the_tokens_however_outputs_are_batched(tokenizer: Any) -> None:
    """Tokens after the one that completes a stop string are not sent, whether the engine's
    outputs come one token at a time or several together (their usage must not depend on it)."""
    from cbserve.outputs import GenerationOutput, RequestStatus
    from cbserve.serving.replica.generation import _Decoder

    ids = tokenizer("one two three STOP four five six").input_ids
    req = WorkerRequest(request_id="r", prompt="x", stop=["STOP"])
    results = []
    for size in (1, 2, 3, len(ids)):
        decoder, tokens, text = _Decoder(tokenizer, req), [], ""
        for i in range(0, len(ids), size):
            out = GenerationOutput(request_id="r", prompt_ids=[1], status=RequestStatus.DECODING,
                                   new_tokens=ids[i : i + size])
            ev = decoder.delta(out)
            tokens, text = tokens + (ev.token_ids if ev else []), text + (ev.text if ev else "")
            if decoder.stopped:
                break
        results.append((tokens, text.strip(), decoder.num_tokens))
    assert results[0][1] == "one two three" and results[0][0] == ids[: results[0][2]]
    assert all(r == results[0] for r in results), results


def test_stop_matcher_holds_back_only_a_possible_stop_prefix() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello") == "he"  # "llo" could start "STOP"? no, but 3 chars are held back
    assert m.feed(" world") == "llo wo"
    assert not m.stopped
    assert m.flush() == "rld"
    assert StopStringMatcher([]).feed("abc") == "abc"


# ---- prefix hashes ----------------------------------------------------------------------------


def test_prefix_hashes_share_exactly_the_common_chunks() -> None:
    a = prefix_hashes("x" * 40 + "a" * 40, chunk=20, max_chunks=10)
    b = prefix_hashes("x" * 40 + "b" * 40, chunk=20, max_chunks=10)
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert prefix_hashes("short", chunk=20, max_chunks=10) == []
    assert len(prefix_hashes(list(range(100)), chunk=16, max_chunks=3)) == 3
    assert prefix_hashes([1, 2, 3, 4], 2, 8)[0] != prefix_hashes("1,2,3,4", 2, 8)[0]
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_routing_text(conv).startswith(chat_routing_text(conv[:1]))


# ---- the worker's request path on a real manager ----------------------------------------------


def test_run_request_greedy_matches_the_manager(manager: Any, tokenizer: Any, info: ModelInfo) -> None:
    prompt = "hello world the sea"
    req = WorkerRequest(request_id="u-greedy", prompt=prompt, max_tokens=12, sampling=Sampling(temperature=0.0), logprobs=True)
    evs = _run(_events(manager, tokenizer, info, req))
    assert evs[0].kind == "start" and evs[0].prompt_tokens == len(tokenizer(prompt).input_ids)
    assert evs[-1].kind == "end"
    tokens = [t for ev in evs for t in ev.token_ids]
    expected = _direct_greedy(manager, tokenizer(prompt).input_ids, 12)
    assert tokens == expected
    assert "".join(ev.text for ev in evs) == tokenizer.decode(expected, skip_special_tokens=True)
    assert len([lp for ev in evs for lp in (ev.logprobs or [])]) == len(tokens)
    assert evs[-1].completion_tokens == len(tokens)
    assert evs[-1].finish_reason == ("stop" if tokens[-1] == info.eos_token_id else "length")


def test_only_a_request_that_returns_logprobs_has_the_engine_compute_them(
        manager: Any, tokenizer: Any, info: ModelInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica's engine returns logprobs by default (`return_logprobs`); each request tells it
    whether it wants them, so a step of requests without `logprobs` skips computing them."""
    asked: list[Any] = []
    add = manager.add_request

    def spy(*args: Any, **kwargs: Any) -> str:
        asked.append(kwargs.get("logprobs"))
        return add(*args, **kwargs)

    monkeypatch.setattr(manager, "add_request", spy)
    for want in (False, True):
        req = WorkerRequest(request_id=f"u-lp-{want}", prompt="hello world", max_tokens=3,
                            sampling=Sampling(temperature=0.0), logprobs=want)
        evs = _run(_events(manager, tokenizer, info, req))
        got = [lp for ev in evs for lp in (ev.logprobs or [])]
        assert len(got) == (3 if want else 0)
    assert asked == [False, True]


def test_run_request_cuts_at_stop_string_and_frees_pages(manager: Any, tokenizer: Any, info: ModelInfo) -> None:
    ids = tokenizer("one two three").input_ids
    full = tokenizer.decode(_direct_greedy(manager, ids, 16), skip_special_tokens=True)
    stop = full[4:7]
    assert len(stop) == 3 and stop not in full[:4]
    req = WorkerRequest(request_id="u-stop", prompt_ids=ids, max_tokens=16, sampling=Sampling(temperature=0.0), stop=[stop])
    evs = _run(_events(manager, tokenizer, info, req))
    text = "".join(ev.text for ev in evs)
    assert text == full[: full.index(stop)]
    assert evs[-1].kind == "end" and evs[-1].finish_reason == "stop"
    s = _run(_pages_back(manager))
    assert s["free_pages"] == s["total_pages"]


def test_closing_the_stream_cancels_the_request(manager: Any, tokenizer: Any, info: ModelInfo) -> None:
    async def scenario() -> dict[str, int]:
        req = WorkerRequest(request_id="u-close", prompt="hello world", max_tokens=400, sampling=Sampling(temperature=0.0))
        gen = run_request(manager, tokenizer, info, req, "local")
        async for ev in gen:
            if ev.kind == "delta":
                break
        assert manager.stats()["free_pages"] < manager.stats()["total_pages"]
        await gen.aclose()
        return await _pages_back(manager)

    s = _run(scenario())
    assert s["free_pages"] == s["total_pages"] and s["running"] == 0


@pytest.mark.parametrize(
    ("fields", "needle", "param"),
    [
        ({"prompt_ids": [1, 99999]}, "vocabulary", "prompt"),
        ({"prompt_ids": [-1, 2]}, "vocabulary", "prompt"),
        ({"prompt_ids": [5] * 600}, "context", "prompt"),
        ({"messages": [{"role": "user", "content": "hi " * 600}]}, "context", "messages"),
    ],
)
def test_run_request_refuses_bad_input(
    manager: Any, tokenizer: Any, info: ModelInfo, fields: dict[str, Any], needle: str, param: str
) -> None:
    """The error carries the refused field, which the HTTP front maps to OpenAI's `param`; its
    message says why and names the API field."""
    evs = _run(_events(manager, tokenizer, info, WorkerRequest(request_id="u-bad", **fields)))
    assert [ev.kind for ev in evs] == ["error"]
    api = openai_error(refusal(evs[0]), "messages" if "messages" in fields else "prompt")
    assert evs[0].status == 400 and needle in api.message and api.param == param


# ---- the OpenAI service on a local manager ----------------------------------------------------


@dataclass
class LocalWorker:
    """`open_choice` backed by `run_request` on a manager in this process."""

    manager: Any
    tokenizer: Any
    info: ModelInfo
    opened: list[WorkerRequest] = field(default_factory=list)

    async def open_choice(self, wreq: WorkerRequest) -> ChoiceStream:
        self.opened.append(wreq)
        gen = run_request(self.manager, self.tokenizer, self.info, wreq, "local")
        first = await gen.__anext__()
        if first.kind == "error":
            raise refusal(first)
        return ChoiceStream(start=first, events=gen, cancel=lambda: asyncio.ensure_future(gen.aclose()))


@pytest.fixture()
def service(manager: Any, tokenizer: Any, info: ModelInfo, loaded: tuple[Any, Any, str]) -> OpenAIService:
    args = ClusterArgs(model=loaded[2], served_model_name="tiny", limits={"max_tokens": 64, "max_n": 4})
    svc = OpenAIService(args, LocalWorker(manager, tokenizer, info).open_choice)
    return svc


async def _drain_sse(stream: Any) -> list[Any]:
    out = []
    async for line in stream:
        assert line.startswith("data: ") and line.endswith("\n\n")
        payload = line[len("data: ") : -2]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_service_completions_batch_and_n(service: OpenAIService, manager: Any, tokenizer: Any) -> None:
    req = CompletionRequest(model="tiny", prompt=["hello world", "the sea"], n=2, max_tokens=6, temperature=0)
    reply = _run(service.complete(req))
    body = reply.body
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    for p_idx, prompt in enumerate(["hello world", "the sea"]):
        expected = tokenizer.decode(_direct_greedy(manager, tokenizer(prompt).input_ids, 6), skip_special_tokens=True)
        assert body.choices[2 * p_idx].text == body.choices[2 * p_idx + 1].text == expected
    prompt_tokens = len(tokenizer("hello world").input_ids) + len(tokenizer("the sea").input_ids)
    assert body.usage.prompt_tokens == prompt_tokens
    assert body.usage.total_tokens == prompt_tokens + body.usage.completion_tokens


def test_service_chat_stream_equals_non_stream(service: OpenAIService) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello café"}]
    whole = _run(service.chat(ChatCompletionRequest(model="tiny", messages=messages, max_tokens=10, temperature=0)))

    async def stream() -> list[Any]:
        reply = await service.chat(ChatCompletionRequest(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        return await _drain_sse(reply.stream)

    chunks = _run(stream())
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])
    assert text == whole.body.choices[0].message.content
    finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
    assert finish[-1] == whole.body.choices[0].finish_reason and set(finish[:-1]) == {None}
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"] == whole.body.usage.model_dump()


@pytest.mark.parametrize(
    ("req", "status", "param"),
    [
        (CompletionRequest(model="nope", prompt="hi"), 404, "model"),
        (CompletionRequest(model="tiny", prompt="hi", max_tokens=65), 400, "max_tokens"),
        (CompletionRequest(model="tiny", prompt="hi", n=5), 400, "n"),
        (CompletionRequest(model="tiny", prompt="hi", suffix="!"), 400, "suffix"),
        (CompletionRequest(model="tiny", prompt="hi", best_of=2), 400, "best_of"),
        (CompletionRequest(model="tiny", prompt="hi", max_tokens=0), 400, "max_tokens"),
        (CompletionRequest(model="tiny", prompt="hi", logit_bias={"x": 1.0}), 400, "logit_bias"),
        (CompletionRequest(model="tiny", prompt="hi", logit_bias={"3": 101.0}), 400, "logit_bias"),
        (CompletionRequest(model="tiny", prompt="hi", stop_token_ids=[10**6]), 400, "stop_token_ids"),
        (CompletionRequest(model="tiny", prompt=[1, 10**6]), 400, "prompt"),
    ],
)
def test_service_refuses_bad_requests(service: OpenAIService, req: CompletionRequest, status: int,
                                      param: str | None) -> None:
    with pytest.raises(APIError) as info:
        _run(service.complete(req))
    assert info.value.status == status and info.value.param == param


def test_service_metrics_count_tokens_and_latency(manager: Any, tokenizer: Any, info: ModelInfo,
                                                  loaded: tuple[Any, Any, str]) -> None:
    from cbserve.serving.front.metrics import ServingMetrics

    metrics = ServingMetrics("tiny")
    svc = OpenAIService(ClusterArgs(model=loaded[2], served_model_name="tiny"),
                        LocalWorker(manager, tokenizer, info).open_choice, metrics)
    reply = _run(svc.complete(CompletionRequest(model="tiny", prompt="hello world", max_tokens=5, temperature=0)))

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0

    assert value("vllm:prompt_tokens_total") == reply.body.usage.prompt_tokens
    assert value("vllm:generation_tokens_total") == reply.body.usage.completion_tokens
    assert value("vllm:time_to_first_token_seconds_count") == 1
    assert value("vllm:inter_token_latency_seconds_count") == reply.body.usage.completion_tokens - 1
    assert value("vllm:request_success_total", finished_reason=reply.body.choices[0].finish_reason) == 1
    text = metrics.render({"r1": {"running": 1, "waiting": 2, "total_pages": 10, "free_pages": 4,
                                  "prefix_hit_tokens": 6, "prompt_tokens_computed": 4}}).decode()
    assert 'vllm:kv_cache_usage_perc{model_name="tiny",replica="r1"} 0.6' in text
    assert 'vllm:prefix_cache_queries_total{model_name="tiny",replica="r1"} 10.0' in text


def test_schemas_refuse_out_of_range_fields() -> None:
    for bad in ({"max_tokens": -1}, {"temperature": -0.5}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
                {"n": 0}, {"stop": [""]}, {"prompt": []}):
        with pytest.raises(ValidationError):
            CompletionRequest(**{"model": "m", "prompt": "p", **bad})
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])


# ---- router -----------------------------------------------------------------------------------


def test_router_gives_each_sibling_request_its_own_replica() -> None:
    """Handle calls made while serving one request share Serve's internal request id."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from cbserve.cluster.router import PrefixAffinityRouter

    async def scenario() -> None:
        dep = DeploymentID(name="LLMWorker", app_name="app")
        router = PrefixAffinityRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = (FakeReplica(ReplicaID(unique_id=u, deployment_id=dep)) for u in ("a", "b"))
        siblings = [
            PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="same"))
            for _ in range(2)
        ]
        for pr in siblings:
            router._pending_requests_to_fulfill.append(pr)
            router._add_pending_request_to_indices(pr)
        router._fulfill_next_pending_request(b, siblings[1].metadata)
        router._fulfill_next_pending_request(a, siblings[0].metadata)
        assert [pr.future.result() for pr in siblings] == [a, b]

    _run(scenario())


# ---- offload shares and settings --------------------------------------------------------------


def test_offload_budget_is_shared_by_the_replicas_a_node_can_hold() -> None:
    cfg = CpuOffloadConfig(per_node_gib=16, by_node={"10.0.0.2": 64})
    assert node_budget_gib(cfg, "nodeid1", "10.0.0.1") == 16
    assert node_budget_gib(cfg, "nodeid2", "10.0.0.2") == 64
    assert replicas_fitting({"CPU": 16, "GPU": 8}, {"CPU": 2, "GPU": 2}, max_replicas=10) == 4
    assert replicas_fitting({"CPU": 16, "GPU": 8}, {"CPU": 2, "GPU": 0}, max_replicas=3) == 3
    assert replicas_fitting({"CPU": 1}, {"CPU": 2, "GPU": 0}, max_replicas=3) == 1
    with pytest.raises(ValidationError):
        CpuOffloadConfig(by_node={"n": -1})


def test_cluster_args_validate_at_deploy_time() -> None:
    assert ClusterArgs().model_name == "SmolLM2-135M-Instruct"
    assert ClusterArgs(model="/models/my-llama/").model_name == "my-llama"
    with pytest.raises(ValidationError, match="page_size"):
        ClusterArgs(engine={"page_size": 2})
    with pytest.raises(ValidationError, match="tp_size"):
        ClusterArgs(engine={"tp_size": 2})
    with pytest.raises(ValidationError, match="max_replicas"):
        ClusterArgs(worker={"autoscaling": {"min_replicas": 1, "max_replicas": 0}})
    with pytest.raises(ValidationError):
        ClusterArgs(unknown_field=1)


def test_worker_options_map_args_to_serve() -> None:
    from ray.serve.config import RequestRouterConfig

    from cbserve.cluster.app import ROUTER_CLASS, worker_options

    fixed = worker_options(ClusterArgs(worker={"num_replicas": 3, "graceful_shutdown_timeout_s": 30}))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["graceful_shutdown_timeout_s"] == 30 + 1.0 + 30.0  # + the wait loop and the teardown
    router: RequestRouterConfig = fixed["request_router_config"]
    assert router.request_router_class == ROUTER_CLASS
    assert router.request_router_kwargs == {"load_factor": 1.25, "imbalance_threshold": 4, "key_chunks": 1,
                                            "virtual_nodes": 64, "adapter_load_factor": 2.0}
    auto = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    scaled = worker_options(ClusterArgs(worker={"autoscaling": auto}))
    policy = scaled["autoscaling_config"].pop("policy")  # on the engine's signals too (test_autoscaling.py)
    assert scaled["autoscaling_config"] == auto and "num_replicas" not in scaled
    assert policy["policy_function"] == "cbserve.cluster.autoscaling:EngineAutoscalingPolicy"
    tp = worker_options(ClusterArgs(tp_size=2, worker={"num_cpus": 2, "num_gpus": 1}))
    assert tp["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}]
    assert tp["placement_group_strategy"] == "STRICT_PACK"
    off = worker_options(ClusterArgs(routing={"enabled": False}))
    assert "PowerOfTwo" in off["request_router_config"].request_router_class
    from cbserve.cluster.ray_compat import RAY_LLM_PREFIX_ROUTER_CLASS as ray_llm

    other = worker_options(ClusterArgs(routing={"request_router_class": ray_llm,
                                                "request_router_kwargs": {"imbalanced_threshold": 8}}))
    assert other["request_router_config"].request_router_class == ray_llm
    assert other["request_router_config"].request_router_kwargs == {"imbalanced_threshold": 8}


def test_ray_config_yaml_is_a_valid_serve_config() -> None:
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    text = (Path(__file__).resolve().parents[2] / "ray_config.yaml").read_text()
    config = ServeDeploySchema(**yaml.safe_load(text))
    (app,) = config.applications
    assert app.import_path == "cbserve.cluster.app:build_app"
    args = ClusterArgs(**app.args)
    assert args.model is None and args.model_name == "SmolLM2-135M-Instruct"
    servicer = config.grpc_options.grpc_servicer_functions[0]
    module, func = servicer.rsplit(".", 1)
    import importlib

    assert callable(getattr(importlib.import_module(module), func))


def test_http_reaching_an_engine_replica_gets_an_explicit_503() -> None:
    """During a redeploy that moves the ingress into the worker, Serve's proxy routes HTTP to the
    previous version's engine replicas (no routes): they answer a 503 in OpenAI's shape to retry,
    not Serve's plain-text 500 for a missing `__call__`."""
    from cbserve.cluster.engine_replica import EngineDeployment

    replica = EngineDeployment.__new__(EngineDeployment)  # no model: only the refusal is exercised
    replica.args = ClusterArgs(worker={"retry_after_s": 2.0})
    resp = asyncio.run(replica(None))
    body = json.loads(resp.body)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
    assert body["error"]["code"] == "redeploying" and body["error"]["type"] == "service_unavailable"


def test_the_models_generation_config_gives_the_sampling_defaults() -> None:
    """vLLM's default: a request's left-out temperature / top_p / top_k / min_p / repetition_penalty
    come from the model's generation_config.json (only the keys it sets), else OpenAI's values."""
    from transformers import GenerationConfig

    from cbserve.serving.front.service_args import GenerationDefaults
    from cbserve.serving.front.worker_requests import sampling
    from cbserve.serving.replica.generation import manager_generation_config
    from cbserve.workers.generation_config import sampling_params

    class Model:
        generation_config = GenerationConfig(temperature=0.6, top_p=0.9, repetition_penalty=1.1)

    own = sampling_params(manager_generation_config(Model(), 2))
    assert (own.do_sample, own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (True, 0.6, 0.9, 0, 1.1)
    Model.generation_config = GenerationConfig()  # sets nothing: transformers' top_k 50 is not the model's
    none = sampling_params(manager_generation_config(Model(), 2))
    assert (none.do_sample, none.temperature, none.top_p, none.top_k) == (True, 1.0, 1.0, 0)
    # The front leaves them out unless the deployment or the request sets them.
    assert sampling(GenerationDefaults()).engine_kwargs() == {}
    assert sampling(GenerationDefaults(temperature=0.2), top_k=5).engine_kwargs() == {"temperature": 0.2, "top_k": 5}
