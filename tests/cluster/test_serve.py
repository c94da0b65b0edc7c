"""The cluster end to end: a local Ray, Serve on loopback, the tiny model, the official `openai`
client and a gRPC client. One Ray and two applications per module:

- `cbserve` at `/`: one worker replica, an API key;
- `routed` at `/routed`: two worker replicas, no key (routing, spreading, graceful drain).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import free_port, start_local_ray, throttled, tiny_model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

API_KEY = "test-key-123"
MODEL = "tiny"
ENGINE = {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 256}
SERVICER = "cbserve.serving.protos.generate_pb2_grpc.add_GenerateServiceServicer_to_server"


def _args(model_dir: Path, **extra: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": MODEL,
        "engine": ENGINE,
        "generation": {"max_tokens": 16},
        "limits": {"max_tokens": 480, "max_body_bytes": 4096},
        "routing": {"chunk_chars": 16, "stats_period_s": 0.5},
    }
    args.update(extra)
    # Several apps share this Ray's 4 CPUs: not `num_cpus: auto` (the whole node for one replica).
    args["worker"] = {"num_cpus": 1.0, **args.get("worker", {})}
    return args


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import ray
    from ray import serve

    from cbserve.cluster.app import build_app

    model_dir = tiny_model_dir(tmp_path_factory)
    http_port, grpc_port = free_port(), free_port()
    # address="local": a new cluster, never one that `ray start` left on this machine
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER]},
        )
        serve.run(build_app(_args(model_dir, api_key=API_KEY)), name="cbserve", route_prefix="/")
        serve.run(
            build_app(_args(model_dir, worker={"num_replicas": 2, "graceful_shutdown_timeout_s": 60},
                            routing={"chunk_chars": 16, "stats_period_s": 0.5, "imbalance_threshold": 1})),
            name="routed", route_prefix="/routed",
        )
        yield {"http": http_port, "grpc": grpc_port, "model_dir": model_dir, "serve": serve}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> Any:
    """The Python API on the same model in this process: what greedy requests must return."""
    from transformers import GenerationConfig

    import cbserve

    # The cluster's dtype (ClusterArgs.dtype), not load_model's "auto".
    model, tokenizer = cbserve.load_model(str(cluster["model_dir"]), dtype="float32")
    cfg = cbserve.ContinuousBatchingConfig(per_request_processors=True, return_logprobs=True, **ENGINE)
    mgr = cbserve.init_continuous_batching(
        model, generation_config=GenerationConfig(max_new_tokens=16, eos_token_id=model.config.eos_token_id),
        continuous_batching_config=cfg,
    )
    mgr.start()

    def greedy(ids: list[int], n: int) -> list[int]:
        rid = mgr.add_request(ids, max_new_tokens=n, temperature=0.0)
        out = None
        for out in mgr.request_id_iter(rid):
            pass
        return list(out.generated_tokens)

    yield tokenizer, greedy
    mgr.stop(timeout=30)
    mgr.destroy()


def _client(cluster: dict[str, Any], key: str | None = API_KEY, prefix: str = "") -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster['http']}{prefix}/v1", api_key=key or "none",
                         max_retries=0, timeout=120)


def _raw(cluster: dict[str, Any], method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def _worker_stats(cluster: dict[str, Any], app: str = "cbserve") -> dict[str, int]:
    handle = cluster["serve"].get_deployment_handle("LLMWorker", app_name=app)
    return handle.stats.remote().result(timeout_s=30)


# ---- OpenAI API through the official client ---------------------------------------------------


def test_completion_greedy_equals_python_api(cluster: dict[str, Any], reference: Any) -> None:
    tokenizer, greedy = reference
    prompt = "hello world the sea"
    expected_ids = greedy(tokenizer(prompt).input_ids, 12)
    out = _client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected_ids]
    assert len(choice.logprobs.token_logprobs) == len(expected_ids)
    assert out.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert out.usage.completion_tokens == len(expected_ids)


def test_completion_stream_equals_non_stream(cluster: dict[str, Any]) -> None:
    client = _client(cluster)
    # 64 tokens: the tiny model's steps take well under a millisecond, and a consumer that reads
    # after the engine is done gets the missed tokens in one chunk, as it should.
    kwargs = {"model": MODEL, "prompt": "one two three café", "max_tokens": 64, "temperature": 0}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert sum(1 for c in chunks if c.choices[0].text) > 1  # streamed, not sent at the end


def test_chat_greedy_stream_and_not_equal_python_api(cluster: dict[str, Any], reference: Any) -> None:
    tokenizer, greedy = reference
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the capital of france"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = tokenizer.decode(greedy(list(ids), 10), skip_special_tokens=True)
    client = _client(cluster)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_choices_stop_strings_and_seeded_sampling(cluster: dict[str, Any], reference: Any) -> None:
    tokenizer, greedy = reference
    client = _client(cluster)
    full = tokenizer.decode(greedy(tokenizer("the sea").input_ids, 16), skip_special_tokens=True)
    stop = full[5:8]
    out = client.completions.create(model=MODEL, prompt=["the sea", "hello"], n=2, max_tokens=16, temperature=0,
                                    stop=[stop])
    assert len(out.choices) == 4
    assert out.choices[0].text == out.choices[1].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    a = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=1.0, seed=7)
    b = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_models_and_health(cluster: dict[str, Any]) -> None:
    models = _client(cluster).models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, _, body = _raw(cluster, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


# ---- bad requests -----------------------------------------------------------------------------


def test_request_path_runs_at_the_nodes_priority_and_the_rest_below(cluster: dict[str, Any]) -> None:
    """Ray starts its workers at nice 15, below its daemons; the replicas on the request path
    (the worker with the ingress inside, or the engine and the ingress apart) keep the node's
    priority (`settings.MODEL_PROCESS_ENV`), while the stats board keeps Ray's default."""
    node = os.getpriority(os.PRIO_PROCESS, 0)  # this process started the local Ray
    assert _niceness("ServeReplica:cbserve:LLMWorker") == {node}  # ingress inside (one replica)
    assert _niceness("ServeReplica:routed:LLMWorker") == {node}  # engine alone (two replicas)
    assert _niceness("ServeReplica:routed:OpenAIIngress") == {node}
    assert min(_niceness("ServeReplica:routed:StatsBoard")) > node


def _pids(title: str) -> list[int]:
    """The processes whose title (Ray's `ray::<actor class>`) starts with `title`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::{title}".encode()):
                found.append(int(pid))
        except OSError:  # gone meanwhile
            continue
    assert found, f"no process ray::{title}"
    return found


def _niceness(title: str) -> set[int]:
    """The niceness of the processes whose title starts with `title`."""
    return {os.getpriority(os.PRIO_PROCESS, pid) for pid in _pids(title)}



@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        (b'{"model": "tiny", "prompt": ', None, 400, "JSON"),
        (json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), None, 404, "gpt-9"),
        (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": -3}).encode(), None, 400, "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 10_000}).encode(), None, 400, "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": "hi", "temperature": -1}).encode(), None, 400, "temperature"),
        (json.dumps({"model": "tiny", "prompt": "x" * 8000}).encode(), None, 413, "larger than"),
        (json.dumps({"model": "tiny", "prompt": [5, 100000]}).encode(), None, 400, "vocabulary"),
        (json.dumps({"model": "tiny", "prompt": ""}).encode(), None, 400, "empty"),
        (json.dumps({"model": "tiny", "prompt": "hi"}).encode(), {"Content-Type": "application/json"}, 401, "API key"),
        (json.dumps({"model": "tiny", "prompt": "hi"}).encode(), _auth("wrong"), 401, "API key"),
    ],
)
def test_bad_requests_get_openai_errors(cluster: dict[str, Any], body: bytes, headers: dict[str, str] | None,
                                        status: int, needle: str) -> None:
    got, _, raw = _raw(cluster, "POST", "/v1/completions", body, headers if headers is not None else _auth())
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"]


def test_runtime_adapter_updates_are_off_unless_enabled(cluster: dict[str, Any]) -> None:
    body = json.dumps({"lora_name": "x", "lora_path": "/tmp"}).encode()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert _raw(cluster, "POST", path, body, {"Content-Type": "application/json"})[0] == 401
        got, _, raw = _raw(cluster, "POST", path, body, _auth())
        assert got == 404 and "lora_runtime_updates: true" in json.loads(raw)["error"]["message"]


def test_errors_through_the_openai_client_and_server_keeps_serving(cluster: dict[str, Any]) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError):
        _client(cluster, key="nope").models.list()
    with pytest.raises(openai.NotFoundError):
        _client(cluster).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        _client(cluster).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 top_p=0)
    status, _, raw = _raw(cluster, "GET", "/v1/nothing-here", headers=_auth())
    assert status == 404 and "error" in json.loads(raw)
    assert _client(cluster).completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


# ---- metrics ----------------------------------------------------------------------------------


def _metrics(cluster: dict[str, Any]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, _, raw = _raw(cluster, "GET", "/metrics")
    assert status == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_metrics_parse_and_counters_move(cluster: dict[str, Any]) -> None:
    start = time.monotonic()
    before = _metrics(cluster)
    out = _client(cluster).completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    time.sleep(1.5)  # a routing-stats period: the worker pushes its engine stats
    after = _metrics(cluster)
    wall = time.monotonic() - start
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == out.usage.prompt_tokens
    assert (after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
            == out.usage.completion_tokens)
    assert after["vllm:time_to_first_token_seconds_count"] > before.get("vllm:time_to_first_token_seconds_count", 0)
    assert after["vllm:request_success_total"] > before.get("vllm:request_success_total", 0)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:inter_token_latency_seconds_count"):
        assert name in after
    assert after["cbserve:worker_replicas"] == 1
    assert after["cbserve:kv_pages_total"] == ENGINE["num_blocks"]
    assert after["cbserve:http_errors_total"] >= 1  # the bad requests above
    # A step per token at least; busy time within the wall time (+ a stats period: `before` may lag).
    steps = after["cbserve:engine_steps_total"] - before.get("cbserve:engine_steps_total", 0)
    busy = after["cbserve:engine_busy_seconds_total"] - before.get("cbserve:engine_busy_seconds_total", 0)
    assert steps >= out.usage.completion_tokens and 0 < busy <= wall + 0.5


# ---- disconnect -------------------------------------------------------------------------------


def test_client_disconnect_cancels_request_and_frees_pages(cluster: dict[str, Any]) -> None:
    base = _worker_stats(cluster)
    assert base["free_pages"] == base["total_pages"]
    body = json.dumps({"model": MODEL, "prompt": "hello world", "max_tokens": 450, "temperature": 0,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers=_auth())
    resp = conn.getresponse()
    assert resp.status == 200
    received = b""
    while received.count(b"data: ") < 4:  # a few SSE events are streaming
        received += resp.read1(4096)
    assert received.startswith(b"data: {")
    busy = _worker_stats(cluster)
    assert busy["running"] == 1 and busy["free_pages"] < busy["total_pages"]
    # The client goes away mid-stream with a reset (as a killed client does), which the proxy
    # notices at once; a polite FIN may only be seen at its next write, and the tiny model can
    # finish its 450 tokens (~2 s) first on a loaded machine.
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    stats = _worker_stats(cluster)
    while time.monotonic() < deadline and (stats["running"] or stats["free_pages"] != stats["total_pages"]):
        time.sleep(0.2)
        stats = _worker_stats(cluster)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["generated_tokens"] - base["generated_tokens"] < 450  # cancelled, not finished


# ---- gRPC -------------------------------------------------------------------------------------


def _grpc(cluster: dict[str, Any]) -> Any:
    import grpc

    from cbserve.serving.protos import generate_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{cluster['grpc']}")
    return generate_pb2_grpc.GenerateServiceStub(channel)


def test_grpc_generate_streams_python_api_tokens(cluster: dict[str, Any], reference: Any) -> None:
    from cbserve.serving.protos import generate_pb2

    tokenizer, greedy = reference
    ids = tokenizer("one two three").input_ids
    expected = greedy(ids, 10)
    request = generate_pb2.GenerateRequest(
        model=MODEL, token_ids=generate_pb2.TokenIds(ids=ids),
        sampling=generate_pb2.SamplingParams(max_tokens=10, temperature=0.0, logprobs=True),
    )
    metadata = (("application", "cbserve"), ("authorization", f"Bearer {API_KEY}"))
    replies = list(_grpc(cluster).Generate(request, metadata=metadata, timeout=60))
    assert replies[0].prompt_tokens == len(ids) and replies[0].replica
    assert [t for r in replies for t in r.token_ids] == expected
    assert "".join(r.text for r in replies) == tokenizer.decode(expected, skip_special_tokens=True)
    assert len([lp for r in replies for lp in r.logprobs]) == len(expected)
    assert replies[-1].finish_reason in ("stop", "length") and replies[-1].completion_tokens == len(expected)

    text_request = generate_pb2.GenerateRequest(prompt="one two three",
                                                sampling=generate_pb2.SamplingParams(max_tokens=10, temperature=0))
    text_replies = list(_grpc(cluster).Generate(text_request, metadata=metadata, timeout=60))
    assert [t for r in text_replies for t in r.token_ids] == expected


@pytest.mark.parametrize(
    ("request_fields", "key", "code"),
    [
        ({"prompt": "hi"}, None, "UNAUTHENTICATED"),
        ({"prompt": "hi"}, "wrong", "UNAUTHENTICATED"),
        ({"prompt": "hi", "model": "nope"}, API_KEY, "NOT_FOUND"),
        ({}, API_KEY, "INVALID_ARGUMENT"),
        ({"token_ids": {"ids": [1, 10**6]}}, API_KEY, "INVALID_ARGUMENT"),
        ({"prompt": "hi", "sampling": {"temperature": -1.0}}, API_KEY, "INVALID_ARGUMENT"),
    ],
)
def test_grpc_bad_requests(cluster: dict[str, Any], request_fields: dict[str, Any], key: str | None,
                           code: str) -> None:
    import grpc
    from google.protobuf import json_format

    from cbserve.serving.protos import generate_pb2

    request = json_format.ParseDict(request_fields, generate_pb2.GenerateRequest())
    metadata = [("application", "cbserve")] + ([("authorization", f"Bearer {key}")] if key else [])
    with pytest.raises(grpc.RpcError) as info:
        list(_grpc(cluster).Generate(request, metadata=metadata, timeout=60))
    assert info.value.code().name == code


# ---- two replicas: routing, spreading, graceful drain ------------------------------------------


def _replica_of(cluster: dict[str, Any], prompt: str, max_tokens: int = 2) -> str:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    status, headers, raw = _raw(cluster, "POST", "/routed/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    return headers["x-cbserve-replica"]


def _open_stream(cluster: dict[str, Any], prompt: str, max_tokens: int) -> tuple[http.client.HTTPConnection, str]:
    """Start a streaming request on the `routed` app; return once tokens flow."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=60)
    conn.request("POST", "/routed/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    received = b""
    while b"data: " not in received:
        received += resp.read1(4096)
    return conn, resp.getheader("x-cbserve-replica")


# On a fast machine a tiny model's 400-token stream had ended before the next request was routed
# (a CI run): these tests run the worker replicas throttled, so the streams are outstanding throughout.
WORKERS = "ServeReplica:routed:LLMWorker"


def test_shared_prefix_follows_its_replica_while_load_is_within_the_bound(cluster: dict[str, Any]) -> None:
    """The `routed` app: 2 replicas, imbalance_threshold 1, so a prefix's replica takes it while
    its queue is below ceil(1.25 x (all outstanding + 1) / 2) + 1."""
    system = "the capital of france is paris and the sea is wide "  # three 16-char chunks
    owner = _replica_of(cluster, system + "zero")
    with throttled(_pids(WORKERS)):
        # Two long requests sharing the prefix stay on its replica (2 < ceil(1.25 x 3 / 2) + 1 = 3)...
        streams = [_open_stream(cluster, system + tail, 400) for tail in ("one", "two")]
        try:
            assert {replica for _, replica in streams} == {owner}
            # ...so a short one with the prefix still goes there, though the other replica is idle,
            assert {_replica_of(cluster, system + tail) for tail in ("three", "four")} == {owner}
            # while a prompt shorter than one chunk (no key) goes to the less loaded of two replicas.
            assert _replica_of(cluster, "hello world") != owner
        finally:
            for conn, _ in streams:
                conn.close()


def test_unequal_load_spreads_over_replicas(cluster: dict[str, Any]) -> None:
    """Short prompts go to the replica with fewer outstanding requests; a shared prefix stays on
    its replica until that one's queue reaches the bound, then goes to the next on its ring."""
    streams: list[tuple[http.client.HTTPConnection, str]] = []
    with throttled(_pids(WORKERS)):
        try:
            streams += [_open_stream(cluster, f"{i} short", 400) for i in range(2)]  # shorter than a chunk
            assert streams[0][1] != streams[1][1]
            for conn, _ in streams:
                conn.close()
            time.sleep(1.0)  # the cancelled requests leave the replicas' queues
            shared = "a shared prefix that is long enough to hash twice over "
            streams = [_open_stream(cluster, shared + str(i), 400) for i in range(6)]
            owner = streams[0][1]
            # 5 outstanding on the owner: 5 >= ceil(1.25 x 6 / 2) + 1 = 5, the 6th goes to the other.
            assert [replica for _, replica in streams[:5]] == [owner] * 5
            assert streams[5][1] != owner
        finally:
            for conn, _ in streams:
                conn.close()


def test_deleting_the_app_drains_in_flight_requests(cluster: dict[str, Any]) -> None:
    """Scale-down to zero: Serve stops routing to the replicas, lets in-flight requests finish
    (graceful_shutdown_timeout_s), then each worker stops its manager."""
    serve = cluster["serve"]
    client = _client(cluster, key=None, prefix="/routed")
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=200, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    first = next(iter(stream))
    assert first.choices
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(serve.delete, "routed", _blocking=True)
        chunks = [first, *stream]
        deleting.result(timeout=120)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 200
    # With the key: the remaining app (route "/") now gets the path and knows no such route.
    status, _, _ = _raw(cluster, "POST", "/routed/v1/completions", b"{}", _auth())
    assert status == 404


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(cluster: dict[str, Any]) -> None:
    """On the engine's signals: 4 clients are far below target_ongoing_requests (64), but the
    engine runs one request at a time (max_requests_per_batch 1), so 3 wait: more than
    target_waiting_requests (0.5), which asks for (1 running + 3 waiting) / 1 = 4 replicas (max 2)."""
    import threading

    from cbserve.cluster.app import build_app

    serve = cluster["serve"]
    auto = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 64,
            "upscale_delay_s": 0.5, "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 1}
    worker = {"autoscaling": auto, "num_cpus": 0.5, "graceful_shutdown_timeout_s": 30, "target_waiting_requests": 0.5}
    serve.run(build_app(_args(cluster["model_dir"], engine={**ENGINE, "max_requests_per_batch": 1}, worker=worker)),
              name="scaled", route_prefix="/scaled")

    def running() -> int:
        overview = serve.status().applications["scaled"].deployments["LLMWorker"]
        return sum(n for state, n in overview.replica_states.items() if str(state).endswith("RUNNING"))

    def wait_for(replicas: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if running() == replicas:
                return True
            time.sleep(0.5)
        return False

    try:
        assert running() == 1
        scaled_up, finished = threading.Event(), []

        def load(i: int) -> None:
            client = _client(cluster, key=None, prefix="/scaled")
            while not scaled_up.is_set():
                out = client.completions.create(model=MODEL, prompt=f"load {i}", max_tokens=200, temperature=0)
                finished.append(out.choices[0].finish_reason)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(load, i) for i in range(4)]
            try:
                assert wait_for(2, timeout=180), "no second replica under load"
            finally:
                scaled_up.set()
            for w in workers:
                w.result(timeout=120)  # no request failed while the deployment scaled
        assert finished and set(finished) <= {"length", "stop"}
        assert wait_for(1, timeout=120), "the idle replica was not removed"
    finally:
        serve.delete("scaled")


def test_tensor_parallel_replica_equals_tp1_and_releases_its_ranks(cluster: dict[str, Any], reference: Any) -> None:
    """tp_size 2: the replica is rank 0, rank 1 a Ray actor in its placement group (gloo on CPU)."""
    import ray

    from cbserve.cluster.app import build_app

    serve = cluster["serve"]
    tokenizer, greedy = reference
    cpus_before = ray.available_resources().get("CPU", 0)
    serve.run(build_app(_args(cluster["model_dir"], tp_size=2, worker={"num_cpus": 0.5})), name="tp",
              route_prefix="/tp")
    try:
        assert ray.available_resources().get("CPU", 0) <= cpus_before - 1.0  # two bundles of 0.5
        for prompt in ("hello world the sea", "one two three café"):
            expected = tokenizer.decode(greedy(tokenizer(prompt).input_ids, 12), skip_special_tokens=True)
            out = _client(cluster, key=None, prefix="/tp").completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
            assert out.choices[0].text == expected
        stats = _worker_stats(cluster, app="tp")
        assert stats["free_pages"] == stats["total_pages"] and stats["running"] == 0
        assert _niceness("TPRank") == {os.getpriority(os.PRIO_PROCESS, 0)}  # runs the model too
    finally:
        serve.delete("tp")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and ray.available_resources().get("CPU", 0) < cpus_before:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= cpus_before  # the rank actor is gone too
