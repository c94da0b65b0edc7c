"""No request can hurt another, through the whole served path (issue 26): 32 streams in flight and
20 hostile requests of every kind the issue lists, sent at once to a local Serve app. Every benign
stream ends with the tokens and logprobs it gets alone; every hostile request gets a 4xx naming its
field (or header); afterwards the worker has nothing running or waiting and every KV page free."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.support.cluster import WORDS, serve_app, tiny_model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
MAX_TOKENS = 12


def nested(depth: int, leaf: Any) -> Any:
    schema = leaf
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "the sea", "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


# (body, headers, words of which one must be in the error's param or message)
HOSTILE: list[tuple[dict[str, Any], dict[str, str], tuple[str, ...]]] = [
    (completion(guided_choice=["yes"], min_tokens=8), {}, ("min_tokens",)),
    (completion(guided_grammar='root ::= "yes"', min_tokens=8), {}, ("min_tokens", "guided_grammar")),
    (completion(logit_bias={"²": 1}), {}, ("logit_bias",)),
    (completion(logit_bias={"--5": 1}), {}, ("logit_bias",)),
    (completion(logit_bias={"9" * 5000: 1}), {}, ("logit_bias",)),
    (completion(), {"x-request-disconnect-disabled": "?1"}, ("x-request-disconnect-disabled",)),
    # Longer than the server's own timeout (a shorter one only ends the sender's own request early).
    (completion(), {"x-request-timeout-seconds": "86400"}, ("x-request-timeout-seconds",)),
    (completion(guided_regex="(" * 400 + "a" + ")" * 400), {}, ("guided_regex",)),
    (completion(guided_json=nested(100, {"type": "string"})), {}, ("guided_json",)),
    (completion(guided_grammar="root ::= " + "(" * 400 + '"a"' + ")" * 400), {}, ("guided_grammar",)),
    (completion(guided_grammar="root ::= ("), {}, ("guided_grammar",)),
    (completion(guided_choice=["a"], guided_regex="a"), {}, ("guided",)),
    (completion(cache_salt=12), {}, ("cache_salt",)),
    (completion(priority="high"), {}, ("priority",)),
    (completion(temperature=-1), {}, ("temperature",)),
    (completion(logprobs=1000), {}, ("logprobs",)),
    (completion(n=64), {}, ("n",)),
    (completion(prompt=["the sea"] * 64), {}, ("prompt",)),
    (completion(prompt="the " * 5000), {}, ("prompt", "max_body_bytes", "body")),
    (completion(max_tokens=10**12), {}, ("max_tokens",)),
]


def post(port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)  # a starved request fails here
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def benign(i: int) -> dict[str, Any]:
    prompt = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9))
    return completion(prompt=prompt, stream=True, logprobs=1)


def stream_answer(status: int, raw: bytes) -> tuple[list[str], list[float]]:
    """The streamed tokens and their logprobs; fails on an error event or a missing [DONE]."""
    assert status == 200, raw
    events = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", raw[-300:]
    tokens: list[str] = []
    logprobs: list[float] = []
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            if choice.get("logprobs"):
                tokens += choice["logprobs"]["tokens"]
                logprobs += choice["logprobs"]["token_logprobs"]
    return tokens, logprobs


def refused(status: int, raw: bytes, words: tuple[str, ...]) -> bool:
    """A 4xx in OpenAI's error shape whose param or message names one of `words`."""
    if not (400 <= status < 500 and raw.startswith(b"{")):
        return False
    error = json.loads(raw)["error"]
    return any(w in f"{error.get('param')} {error.get('message')}" for w in words)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    args = {"model": str(tiny_model_dir(tmp_path_factory)), "served_model_name": MODEL,
            "engine": {"page_size": 8, "num_blocks": 512, "max_batch_tokens": 256},
            "limits": {"max_tokens": 64, "max_body_bytes": 16384, "max_n": 4, "max_prompts": 8}}
    with serve_app(args) as (serve, http_port, _grpc_port):
        yield serve, http_port


def worker_stats(serve: Any) -> dict[str, Any]:
    handle = serve.get_deployment_handle("LLMWorker", app_name="cbserve")
    return handle.stats.remote().result(timeout_s=30)


def test_hostile_requests_do_not_touch_streams_in_flight(cluster: Any) -> None:
    serve, port = cluster
    alone = [stream_answer(*post(port, benign(i))) for i in range(32)]
    with ThreadPoolExecutor(len(alone) + len(HOSTILE)) as pool:
        streams = [pool.submit(post, port, benign(i)) for i in range(32)]
        hostile = [pool.submit(post, port, body, headers) for body, headers, _ in HOSTILE]
        for i, future in enumerate(streams):
            tokens, logprobs = stream_answer(*future.result())
            assert tokens == alone[i][0], i
            assert logprobs == pytest.approx(alone[i][1], abs=1e-4), i
        refusals = [(words, *future.result()) for (_, _, words), future in zip(HOSTILE, hostile)]
    wrong = [(words, status, raw[:200]) for words, status, raw in refusals if not refused(status, raw, words)]
    assert not wrong, "\n".join(map(repr, wrong))
    deadline = time.monotonic() + 30
    while (stats := worker_stats(serve))["live_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["live_requests"] == stats["running"] == stats["waiting"] == 0, stats
    assert stats["free_pages"] == stats["total_pages"], stats
