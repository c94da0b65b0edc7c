"""Hostile input, property-based (hypothesis): random and malformed bodies, wrong types, huge
numbers, unicode edge cases, deep nesting, oversized prompts, non-JSON content.

- HTTP (`/v1/completions`, `/v1/chat/completions`): every case gets a 4xx in OpenAI's error shape
  or a correct 200, never a 5xx or a hang; after each batch a probe gets the same tokens as
  before and the worker's KV pages are all free.
- gRPC `Generate`: random field values end with a clean stream or INVALID_ARGUMENT / NOT_FOUND,
  never INTERNAL / UNKNOWN.
- `manager.add_request`: random arguments are served correctly or refused with ValueError
  naming the argument; nothing is queued by a refusal; the manager keeps serving.

One module-scoped Serve app; example counts are kept small for a 2-core machine.
"""

from __future__ import annotations

import http.client
import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cluster import serve_app, tiny_model_dir

MODEL = "tiny"
MAX_TOKENS = 6  # limits.max_tokens: any accepted request is short
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Raw:
    """A JSON token written as is: numbers Python's json cannot produce (1e309, -0.0e-999)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text})"


def dump(value: Any) -> str:
    """JSON text; strings are escaped ASCII, so a lone surrogate travels as `\\ud800`."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


# Text: anything, including lone surrogates (category Cs), NUL, RTL overrides, emoji, BOM.
EDGE_CHARS = ["\x00", "\u202e", "\u200f", "\ufeff", "\u200d", "\U0001f642", "\U0001f468\u200d\U0001f469",
              "\ud800", "\udfff", "\uffff", "\U0010ffff", "e\u0301", "\x7f", "\n", "\\", '"']
texts = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=24),
    st.lists(st.sampled_from(EDGE_CHARS), min_size=1, max_size=6).map("".join),
)
huge_numbers = st.sampled_from([
    Raw("1e309"), Raw("-1e309"), Raw("1e-400"), Raw("-0.0"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"),
    2**70, -(2**70), 2**63, 2**64, -(2**63) - 1, 2**31, -1, 0, 10**100, Raw("1" * 5000),
])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=False),
                    huge_numbers, texts)
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(texts, children, max_size=4)), max_leaves=12)

COMPLETION = {"model": MODEL, "prompt": "the sea", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the sea"}], "max_tokens": 3, "temperature": 0}
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                     "stream", "stream_options", "logprobs", "echo", "best_of", "suffix", "presence_penalty",
                     "frequency_penalty", "user", "min_p", "repetition_penalty", "logit_bias", "min_tokens",
                     "ignore_eos", "stop_token_ids", "prompt_logprobs", "skip_special_tokens", "response_format",
                     "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "logprobs", "echo", "best_of", "suffix")] + [
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls"]
# Plausible-looking values too, so that mutations reach the deeper checks (worker, engine).
field_values = st.one_of(
    json_values,
    st.lists(st.integers(-5, 1000), min_size=0, max_size=8),
    st.lists(st.lists(st.integers(-5, 1000), max_size=4), max_size=3),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                                    "content": st.one_of(texts, json_values)}), max_size=3),
    st.floats(min_value=-3, max_value=3), st.integers(-3, 12),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = tiny_model_dir(tmp_path_factory)
    args = {"model": str(model_dir), "served_model_name": MODEL,
            "engine": {"page_size": 8, "num_blocks": 128, "max_batch_tokens": 256},
            "generation": {"max_tokens": 4},
            "limits": {"max_tokens": MAX_TOKENS, "max_body_bytes": 65536, "max_n": 2, "max_prompts": 2}}
    with serve_app(args) as (serve, http_port, grpc_port):
        cluster = {"http": http_port, "grpc": grpc_port, "model_dir": model_dir, "serve": serve}
        cluster["probe"] = _probe(cluster)
        yield cluster


def _post(cluster: dict[str, Any], path: str, body: bytes, content_type: str = "application/json"
          ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=60)  # a hang fails here
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _probe(cluster: dict[str, Any]) -> tuple[str, str]:
    """Greedy answers of both endpoints (compared before and after each batch)."""
    status, _, raw = _post(cluster, "/v1/completions", json.dumps({**COMPLETION, "max_tokens": MAX_TOKENS}).encode())
    assert status == 200, raw
    status, _, raw2 = _post(cluster, "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": MAX_TOKENS}).encode())
    assert status == 200, raw2
    return json.loads(raw)["choices"][0]["text"], json.loads(raw2)["choices"][0]["message"]["content"]


def _check_still_serving(cluster: dict[str, Any]) -> None:
    assert _probe(cluster) == cluster["probe"]
    handle = cluster["serve"].get_deployment_handle("LLMWorker", app_name="cbserve")
    deadline = time.monotonic() + 30
    stats = handle.stats.remote().result(timeout_s=30)
    while time.monotonic() < deadline and (stats["live_requests"] or stats["free_pages"] != stats["total_pages"]):
        time.sleep(0.1)
        stats = handle.stats.remote().result(timeout_s=30)
    assert stats["free_pages"] == stats["total_pages"] and stats["live_requests"] == 0, stats


@pytest.fixture
def still_serving(cluster: dict[str, Any]) -> Any:
    yield cluster
    _check_still_serving(cluster)


def _assert_answer(status: int, raw: bytes, stream: bool = False) -> dict[str, Any] | None:
    """A correct refusal (4xx, OpenAI's error shape) or a well-formed answer; returns the error."""
    assert status < 500, raw
    if status >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        return err
    assert status == 200, raw
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]"), raw
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
    else:
        body = json.loads(raw)
        assert body["choices"] and body["usage"]["completion_tokens"] <= MAX_TOKENS * len(body["choices"])
    return None


def _is_json(text: str) -> bool:
    """Standard JSON, as a strict parser reads it (no NaN / Infinity, no 5000-digit numbers)."""

    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError:
        return False
    return True


def _is_stream(body: Any) -> bool:
    return isinstance(body, dict) and body.get("stream") is True


# ---- HTTP ---------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@EXAMPLES
@given(body=json_values, chat=st.booleans())
def test_http_random_json_bodies(still_serving: dict[str, Any], body: Any, chat: bool) -> None:
    status, _, raw = _post(still_serving, "/v1/chat/completions" if chat else "/v1/completions", dump(body).encode())
    assert _assert_answer(status, raw) is not None  # a random body is never a valid request


@pytest.mark.ray
@pytest.mark.slow
@EXAMPLES
@given(chat=st.booleans(), data=st.data())
def test_http_valid_request_with_hostile_fields(still_serving: dict[str, Any], chat: bool, data: Any) -> None:
    base, fields = (CHAT, CHAT_FIELDS) if chat else (COMPLETION, COMPLETION_FIELDS)
    mutated = data.draw(st.dictionaries(st.sampled_from(fields), field_values, min_size=1, max_size=3))
    body = {**base, **mutated}
    status, _, raw = _post(still_serving, "/v1/chat/completions" if chat else "/v1/completions", dump(body).encode())
    err = _assert_answer(status, raw, stream=_is_stream(body))
    if not _is_json(dump(body)):  # NaN, Infinity, 5000-digit numbers: the body itself is refused
        assert status == 400 and "could not parse the JSON body" in err["message"], err
    elif err is not None and status == 400:  # names one of the fields it was given
        named = (err["param"] or "") + " " + err["message"]
        assert any(f in named for f in mutated), (mutated, err)


@pytest.mark.ray
@pytest.mark.slow
@EXAMPLES
@given(text=texts, where=st.sampled_from(["prompt", "prompt_list", "content", "stop", "model", "user"]))
def test_http_unicode_edge_cases(still_serving: dict[str, Any], text: str, where: str) -> None:
    if where in ("prompt", "prompt_list"):
        body, path = {**COMPLETION, "prompt": text if where == "prompt" else ["the sea", text]}, "/v1/completions"
    elif where == "content":
        body, path = {**CHAT, "messages": [{"role": "user", "content": text}]}, "/v1/chat/completions"
    else:
        body, path = {**COMPLETION, where: text}, "/v1/completions"
    status, _, raw = _post(still_serving, path, dump(body).encode())
    err = _assert_answer(status, raw)
    lone_surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    if lone_surrogate:
        assert status == 400 and "surrogate" in err["message"] and err["param"].startswith(where.split("_")[0]
                                                                                            .replace("content", "messages"))
    elif where in ("prompt", "prompt_list", "content") and text:
        assert status == 200, raw  # any real text is a fine prompt
    elif where == "model":
        assert status == 404 and err["param"] == "model"


@pytest.mark.ray
@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=16).map(lambda b: b'{"model": "tiny", "prompt": "' + b + b'"}'),  # invalid UTF-8 inside
    st.sampled_from([b"", b"{", b"null", b"[]", b'"prompt"', b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00",
                     b'{"prompt": "a", "prompt": 5}', b"prompt=hello&max_tokens=3", b"<xml/>"]),
    st.integers(65, 3000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(20_000, 32_000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"),
    st.integers(65, 400).map(lambda d: (b'{"model": "tiny", "prompt": "x", "user": ' + b'{"a": ' * d
                                        + b"1" + b"}" * d + b"}")),
), content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
    chat=st.booleans())
def test_http_malformed_bodies(still_serving: dict[str, Any], body: bytes, content_type: str, chat: bool) -> None:
    status, _, raw = _post(still_serving, "/v1/chat/completions" if chat else "/v1/completions", body, content_type)
    assert _assert_answer(status, raw) is not None


@pytest.mark.ray
@pytest.mark.slow
def test_http_oversized_prompts_name_the_field(still_serving: dict[str, Any]) -> None:
    words = " ".join(["the sea"] * 400)  # > the tiny model's 512-token context
    cases = [
        ("/v1/completions", {**COMPLETION, "prompt": words}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [5] * 600}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [5] * 512}, "prompt"),  # fills the context: no room
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": words}]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": "x" * 70_000}, None),  # over max_body_bytes: 413
    ]
    for path, body, field in cases:
        status, _, raw = _post(still_serving, path, dump(body).encode())
        err = _assert_answer(status, raw)
        assert err is not None
        if field is None:
            assert status == 413
        else:
            assert status == 400 and field in err["message"], err
    # A max_tokens past the context is capped to the room left (issue 31, as vLLM), not refused.
    body = {**COMPLETION, "prompt": [5] * 509, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    status, _, raw = _post(still_serving, "/v1/completions", dump(body).encode())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3, raw


# ---- gRPC ---------------------------------------------------------------------------------------

int32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)]))
float32 = st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1.0]))


@st.composite
def grpc_requests(draw: Callable[..., Any]) -> Any:
    from cbserve.serving.protos import generate_pb2 as pb

    valid_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)
    req = pb.GenerateRequest(model=draw(st.one_of(st.just(""), st.just(MODEL), valid_text)))
    which = draw(st.sampled_from(["prompt", "token_ids", "none"]))
    if which == "prompt":
        req.prompt = draw(valid_text)
    elif which == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.one_of(int32, st.integers(0, 300)), max_size=6)))
    s = req.sampling
    if draw(st.booleans()):
        s.max_tokens = draw(st.one_of(int32, st.integers(-2, 8)))
    if draw(st.booleans()):
        s.temperature = draw(float32)
    if draw(st.booleans()):
        s.top_p = draw(float32)
    if draw(st.booleans()):
        s.top_k = draw(int32)
    if draw(st.booleans()):
        s.seed = draw(st.integers(-(2**63), 2**63 - 1))
    s.stop.extend(draw(st.lists(valid_text, max_size=10)))
    s.logprobs = draw(st.booleans())
    return req


@pytest.mark.ray
@pytest.mark.slow
@EXAMPLES
@given(request=grpc_requests())
def test_grpc_random_requests(still_serving: dict[str, Any], request: Any) -> None:
    import grpc

    from cbserve.serving.protos import generate_pb2_grpc

    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{still_serving['grpc']}"))
    try:
        replies = list(stub.Generate(request, metadata=[("application", "cbserve")], timeout=60))
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (exc.code(), exc.details())
        assert exc.details()
        return
    assert replies[-1].finish_reason in ("stop", "length")
    assert sum(len(r.token_ids) for r in replies) == replies[-1].completion_tokens <= MAX_TOKENS


@pytest.mark.ray
@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(payload=st.one_of(
    st.binary(max_size=32),
    st.binary(min_size=1, max_size=8).map(lambda b: b"\x12" + bytes([len(b)]) + b),  # prompt: arbitrary bytes
))
def test_grpc_undecodable_messages(still_serving: dict[str, Any], payload: bytes) -> None:
    """Bytes that are not a GenerateRequest (or hold invalid UTF-8 in a string field)."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{still_serving['grpc']}")
    call = channel.unary_stream("/cbserve.generate.GenerateService/Generate",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        list(call(payload, metadata=[("application", "cbserve")], timeout=60))
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (exc.code(), exc.details())


# ---- the engine's add_request -------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import GenerationConfig

    import cbserve

    model, _ = cbserve.load_model(str(tiny_model_dir(tmp_path_factory)))
    mgr = cbserve.init_continuous_batching(
        model, generation_config=GenerationConfig(max_new_tokens=4, eos_token_id=model.config.eos_token_id),
        continuous_batching_config=cbserve.ContinuousBatchingConfig(
            page_size=8, num_blocks=96, max_batch_tokens=128, per_request_processors=True, return_logprobs=True),
    )
    mgr.start()
    probe_id = mgr.add_request([5, 6, 7], max_new_tokens=6, temperature=0.0)
    expected = list(_final(mgr, probe_id).generated_tokens)
    yield mgr, expected
    mgr.stop(timeout=30)
    mgr.destroy()


def _final(mgr: Any, rid: str) -> Any:
    out = None
    for out in mgr.request_id_iter(rid):
        pass
    return out


ARG_VALUES = {
    "input_ids": st.one_of(st.lists(st.one_of(st.integers(-3, 500), st.integers(), st.floats(), st.booleans(),
                                              st.none(), st.text(max_size=2)), max_size=5),
                           st.text(max_size=4), st.none(), st.integers(), st.dictionaries(st.integers(), st.integers()),
                           st.tuples(st.integers(0, 300))),
    "request_id": st.one_of(st.none(), st.text(max_size=8), st.integers(), st.just("")),
    "max_new_tokens": st.one_of(st.none(), st.integers(-5, 10), st.sampled_from([2**70, 10**6, 1.5, math.nan, "3",
                                                                                True])),
    "temperature": st.one_of(st.none(), st.floats(), st.sampled_from([1e-300, 1e-40, 5e-6, 1e38, 2**70, -0.0, "1",
                                                                      True])),
    "top_k": st.one_of(st.none(), st.integers(-3, 2**70), st.sampled_from([2**63, 2**31, 0, 1, 1.0, "5"])),
    "top_p": st.one_of(st.none(), st.floats(), st.sampled_from([1e-300, 1.0000001, 0.0, -0.0, "0.5"])),
    "seed": st.one_of(st.none(), st.integers(-(2**70), 2**70), st.sampled_from([2**64 - 1, 2**64, -(2**63), 1.0,
                                                                                "7"])),
    "eos_token_id": st.one_of(st.none(), st.integers(-3, 500), st.lists(st.integers(-1, 400), max_size=3),
                              st.sampled_from(["2", 1.5, [None], True, {}])),
}


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(kwargs=st.fixed_dictionaries({}, optional=ARG_VALUES))
def test_add_request_random_arguments(manager: Any, kwargs: dict[str, Any]) -> None:
    mgr, _ = manager
    kwargs.setdefault("input_ids", [5, 6, 7])
    if isinstance(kwargs.get("request_id"), str) and kwargs["request_id"]:
        kwargs["request_id"] = f"h-{time.monotonic_ns()}-{kwargs['request_id']}"  # never a live duplicate
    before = mgr.stats()
    try:
        rid = mgr.add_request(**kwargs)
    except ValueError as exc:
        message = str(exc)
        assert any(name in message for name in kwargs), (kwargs, message)  # names an argument it was given
        after = mgr.stats()
        assert after["live_requests"] == before["live_requests"] == 0 and after["waiting"] == 0
        return
    out = _final(mgr, rid)
    assert out.status.value == "finished", (kwargs, out.error)
    assert 1 <= len(out.generated_tokens) <= (kwargs.get("max_new_tokens") or 4)
    assert all(0 <= t < mgr.engine.shape.vocab_size for t in out.generated_tokens)
    assert all(math.isfinite(lp) for lp in out.logprobs), (kwargs, out.logprobs)


def test_manager_serves_correctly_after_hostile_arguments(manager: Any) -> None:
    """Runs after the property test above (same module manager): same greedy tokens, all pages free."""
    mgr, expected = manager
    rid = mgr.add_request([5, 6, 7], max_new_tokens=6, temperature=0.0)
    assert list(_final(mgr, rid).generated_tokens) == expected
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and mgr.stats()["live_requests"]:
        time.sleep(0.05)
    stats = mgr.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["live_requests"] == 0
