"""OpenAI / vLLM API parity end to end (issue 17): a local Ray, Serve on loopback, the tiny model,
the official `openai` client, raw HTTP for vLLM's tokenizer routes, and gRPC.

Two applications: `cbserve` at `/` (a long-context copy of the tiny model, so a Hermes tool
prompt fits), and `full` at `/full`, whose engine holds one waiting request at most
(`max_queue_size: 1`) and little KV cache, for the overload answer.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import importlib.metadata
import json
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from tests.support.cluster import PROXY_PATIENCE, _start_serve, start_local_ray, tiny_model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["paris", "tokyo"]}}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "tokyo"}}\n</tool_call>'


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    ok: bool


def _long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-long-ctx")
    for f in tiny_model_dir(tmp_path_factory).iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return folder


def _args(model_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model_dir), "served_model_name": MODEL, "generation": {"max_tokens": 16},
            "engine": {"page_size": 8, "num_blocks": 512, "max_batch_tokens": 256},
            "limits": {"max_tokens": 480}, "worker": {"num_cpus": 1}, **extra}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import os

    import ray
    from ray import serve

    from cbserve.cluster.app import build_app

    model_dir = _long_model(tmp_path_factory)
    added = [k for k in PROXY_PATIENCE if k not in os.environ]
    os.environ.update({k: PROXY_PATIENCE[k] for k in added})
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        http_port, grpc_port = _start_serve(serve)
        serve.run(build_app(_args(model_dir)), name="cbserve", route_prefix="/")
        full = {"page_size": 8, "num_blocks": 64, "max_batch_tokens": 256, "max_queue_size": 1}
        serve.run(build_app(_args(model_dir, engine=full)), name="full", route_prefix="/full")
        yield {"http": http_port, "grpc": grpc_port, "model_dir": model_dir}
    finally:
        serve.shutdown()
        ray.shutdown()
        for k in added:
            os.environ.pop(k, None)


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> Any:
    import cbserve

    return cbserve.load_model(str(cluster["model_dir"]), dtype="float32")


def _client(cluster: dict[str, Any], prefix: str = "") -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster['http']}{prefix}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _http(cluster: dict[str, Any], method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read() or b"null")
    finally:
        conn.close()


# ---- logprobs -----------------------------------------------------------------------------------


def test_echo_and_prompt_logprobs_through_the_openai_client(cluster: dict[str, Any], reference: Any) -> None:
    model, tok = reference
    prompts = [tok("the capital of france is paris").input_ids, tok("one two three").input_ids]
    out = _client(cluster).completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                                              temperature=0)
    for choice, ids in zip(sorted(out.choices, key=lambda c: c.index), prompts):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        ref = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), ref, atol=1e-4)
        assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    out = _client(cluster).completions.create(model=MODEL, prompt=prompts[1], max_tokens=1, temperature=0,
                                              extra_body={"prompt_logprobs": 2})
    pl = out.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompts[1])
    assert all(str(t) in at for t, at in zip(prompts[1][1:], pl[1:]))


def test_top_logprobs_through_the_openai_client(cluster: dict[str, Any]) -> None:
    out = _client(cluster).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the sea"}],
                                                   max_tokens=4, temperature=0, logprobs=True, top_logprobs=20)
    for entry in out.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 20 and entry.top_logprobs[0].logprob == entry.logprob
    out = _client(cluster).completions.create(model=MODEL, prompt="hello world", max_tokens=3, temperature=0,
                                              logprobs=5)
    lp = out.choices[0].logprobs  # top entries are keyed by text: tokens that decode alike share one
    assert all(1 <= len(top) <= 6 and max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


# ---- sampling controls --------------------------------------------------------------------------


def test_sampling_controls_through_the_openai_client(cluster: dict[str, Any], reference: Any) -> None:
    tok = reference[1]
    client = _client(cluster)
    wave = tok("wave").input_ids[0]
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                    logit_bias={str(wave): 100})
    assert out.choices[0].text == tok.decode([wave]) * 4
    eos = tok.eos_token_id
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"min_tokens": 2})
    assert out.usage.completion_tokens == 3
    kw = {"model": MODEL, "prompt": "the the the sea", "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3}
    plain = client.completions.create(**kw)
    controls = {"extra_body": {"repetition_penalty": 1.5, "min_p": 0.3, "top_k": 5}, "presence_penalty": 1.0,
                "frequency_penalty": 0.5}
    first, again = client.completions.create(**kw, **controls), client.completions.create(**kw, **controls)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded, choice by choice
    assert [c.text for c in first.choices] != [c.text for c in plain.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice has its own seed


# ---- structured outputs -------------------------------------------------------------------------


def test_structured_outputs_through_the_openai_client(cluster: dict[str, Any]) -> None:
    import openai

    client = _client(cluster)
    messages = [{"role": "user", "content": "yes or no?"}]
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Verdict, max_tokens=64,
                                           temperature=1.0, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "v", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=64, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].text), dict)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=16, temperature=1.0, n=3, seed=2,
                                    extra_body={"guided_choice": ["paris", "tokyo"]})
    assert {c.text for c in out.choices} <= {"paris", "tokyo"}
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=16, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", out.choices[0].text)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "frob"}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"


# ---- tools --------------------------------------------------------------------------------------


def test_tool_calls_through_the_openai_client(cluster: dict[str, Any]) -> None:
    client = _client(cluster)
    messages = [{"role": "user", "content": "weather in tokyo?"}]
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200,
                                              tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"
    # streamed through the SDK's helper: the arguments come in pieces and add up to the same call
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200,
                                        tool_choice="required", parallel_tool_calls=False, temperature=0) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert len(pieces) > 1 and "".join(pieces) == streamed.function.arguments
    assert final.choices[0].finish_reason == "tool_calls" and streamed.function.name == "get_weather"
    whole = required.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(streamed.function.arguments) == json.loads(whole)
    # auto: the model's own Hermes text (forced here, the tiny model would not write it) is parsed
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200,
                                          extra_body={"guided_choice": [CALL_TEXT]})  # ~1 token a character
    [call] = auto.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "tokyo"})
    assert auto.choices[0].message.content is None and auto.choices[0].finish_reason == "tool_calls"
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200,
                                            stream=True, extra_body={"guided_choice": [CALL_TEXT]})
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.id] == ["get_weather"]  # id and name first, once
    assert len(deltas) > 2 and {d.index for d in deltas} == {0}  # then the arguments as they come
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "tokyo"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back through the chat template
    follow = messages + [auto.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens > named.usage.prompt_tokens


def test_responses_api_through_the_openai_client(cluster: dict[str, Any]) -> None:
    import openai

    client = _client(cluster)
    whole = client.responses.create(model=MODEL, input="the sea", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the sea"}],
                                          max_tokens=6, temperature=0)
    assert whole.output_text == chat.choices[0].message.content  # the same greedy answer
    assert whole.status == "incomplete" and whole.usage.output_tokens == 6
    with client.responses.stream(model=MODEL, input="the sea", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"  # as OpenAI ends a stream cut at max_output_tokens
    assert "".join(deltas) == events[-1].response.output_text == whole.output_text
    # A function tool, then its output back in the next turn's input.
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    asked = client.responses.create(model=MODEL, input="weather in tokyo?", tools=[tool], tool_choice="required",
                                    max_output_tokens=200, temperature=0)
    call = next(item for item in asked.output if item.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    with client.responses.stream(model=MODEL, input="weather in tokyo?", tools=[tool], tool_choice="required",
                                 max_output_tokens=200, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output] == [(i.name, i.arguments) for i in asked.output]
    follow = client.responses.create(model=MODEL, tools=[tool], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "weather in tokyo?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > asked.usage.input_tokens
    # A conversation continued from the stored response.
    then = client.responses.create(model=MODEL, previous_response_id=whole.id, input="one two",
                                   max_output_tokens=4, temperature=0)
    assert then.previous_response_id == whole.id and then.usage.input_tokens > whole.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown")
    assert err.value.body["param"] == "previous_response_id"


# ---- embeddings ---------------------------------------------------------------------------------


def test_embeddings_through_the_openai_client(cluster: dict[str, Any], reference: Any) -> None:
    """The SDK asks for base64 unless told otherwise and decodes it; the vectors are the model's
    last hidden state, mean-pooled (the deployment's default) and normalized, also while a chat
    streams beside them on the same engine."""
    import numpy as np
    import openai

    model, tok = reference
    client = _client(cluster)
    texts = ["the sea is calm tonight", "a longer input, " * 40]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat = pool.submit(client.chat.completions.create, model=MODEL, max_tokens=32, temperature=0,
                           messages=[{"role": "user", "content": "the sea"}])
        out = client.embeddings.create(model=MODEL, input=texts)
        floats = client.embeddings.create(model=MODEL, input=[tok(t).input_ids for t in texts], encoding_format="float")
        assert chat.result().choices[0].finish_reason in ("stop", "length")
    assert out.model == MODEL and out.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in texts)
    for a, b, text in zip(out.data, floats.data, texts):
        with torch.no_grad():
            hidden = model.base_model(torch.tensor([tok(text).input_ids])).last_hidden_state[0].double()
        expected = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
        np.testing.assert_allclose(a.embedding, expected, atol=2e-5)
        np.testing.assert_allclose(b.embedding, a.embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert err.value.body["param"] == "dimensions"


CLIENTS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-clients" / "bin" / "python"


@pytest.mark.skipif(not CLIENTS_PYTHON.exists(), reason=f"{CLIENTS_PYTHON} missing: `make install` builds it")
def test_client_libraries_langchain_litellm_and_the_agents_sdk(cluster: dict[str, Any]) -> None:
    """Each library as its docs show it, in its own venv: the same greedy text as the openai client,
    streamed and not, structured output (LangChain's with_structured_output), tool calls
    (LangChain's bind_tools; the Agents SDK calling its function tool, then giving its structured
    output, on the Responses and the chat completions models)."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "support" / "client_libraries.py"
    done = subprocess.run([str(CLIENTS_PYTHON), str(script), f"http://127.0.0.1:{cluster['http']}/v1", MODEL],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    errors = {name: r["error"] for name, r in got.items() if "error" in r}
    assert not errors, errors
    expected = _client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the sea"}], max_tokens=6, temperature=0)
    text = expected.choices[0].message.content
    assert got["langchain"]["text"] == got["langchain"]["streamed"] == text
    assert got["langchain"]["usage"]["output_tokens"] == 6
    assert [c["name"] for c in got["langchain"]["tool_calls"]] == ["get_weather"]
    assert got["langchain"]["tool_calls"][0]["args"]["city"] in ("paris", "tokyo")
    assert got["langchain"]["structured"] in ("yes", "no")  # with_structured_output: a json_schema format
    assert got["litellm"]["text"] == got["litellm"]["streamed"] == text
    assert got["litellm"]["completion_tokens"] == 6
    for backend in ("responses", "chat"):
        run = got["agents"][backend]
        assert run["tool_calls"] and run["tool_calls"][0] in ("paris", "tokyo"), (backend, run)
        assert run["final_output"]["sky"] in ("sunny", "rainy"), (backend, run)


# ---- strictness, tokenizer routes, overload, gRPC ----------------------------------------------


def test_unknown_fields_are_refused_through_the_openai_client(cluster: dict[str, Any]) -> None:
    import openai

    client = _client(cluster)
    for extra, param in (({"frobnicate": 1}, "frobnicate"), ({"guided_decoding_backend": "x"}, "guided_decoding_backend"),
                         ({"stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == param
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="ignored-on-purpose")
    assert out.usage.completion_tokens == 2


def test_tokenize_detokenize_and_tokenizer_info(cluster: dict[str, Any], reference: Any) -> None:
    tok = reference[1]
    status, _, body = _http(cluster, "POST", "/tokenize", {"model": MODEL, "prompt": "hello café",
                                                           "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok("hello café").input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    status, _, chat = _http(cluster, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["tokens"][-1] != body["tokens"][-1]
    status, _, out = _http(cluster, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and out == {"prompt": "hello café"}
    status, _, err = _http(cluster, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, _, info = _http(cluster, "GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tok.eos_token and info["chat_template"]
    status, _, models = _http(cluster, "GET", "/v1/models")  # issue 31: vLLM's max_model_len on the card
    assert status == 200 and models["data"][0]["max_model_len"] == 4096
    status, _, version = _http(cluster, "GET", "/version")
    assert status == 200 and version == {"version": importlib.metadata.version("cbserve")}
    # X-Request-Id: the response's id (vLLM's chatcmpl-<id>), echoed by Serve's proxy.
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}), {"Content-Type": "application/json", "X-Request-Id": "trace-7"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["id"] == "chatcmpl-trace-7"
    assert resp.getheader("x-request-id") == "trace-7"
    assert status == 200 and version == {"version": importlib.metadata.version("cbserve")}


def test_a_full_engine_queue_answers_503_with_retry_after(cluster: dict[str, Any]) -> None:
    """One request runs (its pages fill the KV cache), one waits, the next is refused at once."""
    body = {"model": MODEL, "prompt": "the sea " * 4, "max_tokens": 440, "temperature": 0, "ignore_eos": True}

    def post(_: int) -> tuple[int, dict[str, str], Any]:
        return _http(cluster, "POST", "/full/v1/completions", body)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(post, range(6)))
    refused = [(h, b) for s, h, b in results if s == 503]
    assert refused and all(b["error"]["code"] == "overloaded" and h["retry-after"] == "1" for h, b in refused)
    assert sum(1 for s, _, _ in results if s == 200) >= 2


def test_grpc_sampling_options_constraint_and_logprobs(cluster: dict[str, Any]) -> None:
    import grpc

    from cbserve.serving.protos import generate_pb2, generate_pb2_grpc

    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster['grpc']}"))
    request = generate_pb2.GenerateRequest(
        prompt="the sea", constraint=generate_pb2.Constraint(choice=generate_pb2.Constraint.Choices(
            choices=["paris", "tokyo"])),
        sampling=generate_pb2.SamplingParams(max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
                                             prompt_logprobs=1, presence_penalty=0.5, logit_bias={5: -1.0}))
    replies = list(stub.Generate(request, metadata=[("application", "cbserve")], timeout=60))
    assert "".join(r.text for r in replies) in ("paris", "tokyo")
    assert all(len(t.token_ids) == 3 for r in replies for t in r.top_logprobs)
    prompt_lps = [lp for r in replies for lp in r.prompt_logprobs]
    assert prompt_lps and prompt_lps[0] != prompt_lps[0]  # NaN: the first prompt token has none
    bad = generate_pb2.GenerateRequest(prompt="x", constraint=generate_pb2.Constraint(regex="(unclosed"))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(bad, metadata=[("application", "cbserve")], timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint.regex" in err.value.details()
