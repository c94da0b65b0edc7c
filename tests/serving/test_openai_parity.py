"""OpenAI / vLLM API parity of the serving layer without Ray (issue 17): the OpenAI service on a
manager in this process (the replica's request path, `run_request`), on the tiny model.

Echo and prompt logprobs (lm-eval's loglikelihood shape), top-k logprobs, per-request sampling
controls, `n` sharing its prefill, structured outputs, tool calls (auto, required, named,
streaming), strict schemas, the overload answer and the tokenizer endpoints' logic.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import cbserve
from cbserve.cluster.settings import ClusterArgs
from cbserve.errors import QueueFullError
from cbserve.serving import tokenization
from cbserve.serving.api_errors import APIError, refusal
from cbserve.serving.constraints import Grammars
from cbserve.serving.front.json_body import parse_request
from cbserve.serving.front.openai_service import OpenAIService
from cbserve.serving.front.replies import ChoiceStream
from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest
from cbserve.serving.front.tool_calls import HermesParser, split_calls
from cbserve.serving.protocol import WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, run_request
from tests.support.cluster import running_manager, tiny_model_dir

CONTEXT = 4096  # room for a Hermes tool prompt in the tiny model's small-vocabulary tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                          "properties": {"city": {"enum": ["paris", "tokyo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"], "properties": {"zone": {"enum": ["utc"]}}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-long")
    for f in tiny_model_dir(tmp_path_factory).iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return folder


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    return cbserve.load_model(str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def manager(loaded: tuple[Any, Any]) -> Any:
    with running_manager(loaded[0], num_blocks=512) as mgr:
        yield mgr


@pytest.fixture(scope="module")
def info(loaded: tuple[Any, Any]) -> ModelInfo:
    model, tok = loaded
    eos = model.config.eos_token_id
    return ModelInfo(eos_token_id=eos, max_context=CONTEXT, default_max_tokens=16,
                     grammars=Grammars(tok, model.config.vocab_size, eos))


def _opener(manager: Any, tokenizer: Any, info: ModelInfo) -> Any:
    async def open_choice(wreq: WorkerRequest) -> ChoiceStream:
        gen = run_request(manager, tokenizer, info, wreq, "local")
        first = await gen.__anext__()
        if first.kind == "error":
            raise refusal(first)
        return ChoiceStream(start=first, events=gen, cancel=lambda: asyncio.ensure_future(gen.aclose()))
    return open_choice


@pytest.fixture(scope="module")
def service(manager: Any, loaded: tuple[Any, Any], info: ModelInfo, model_dir: Path) -> OpenAIService:
    args = ClusterArgs(model=str(model_dir), served_model_name="tiny", limits={"max_tokens": 512, "max_n": 4})
    return OpenAIService(args, _opener(manager, loaded[1], info))


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def complete(service: OpenAIService, **body: Any) -> dict[str, Any]:
    """A completions request as a client sends it (JSON, strict parsing), its JSON answer."""
    req = parse_request(json.dumps({"model": "tiny", **body}).encode(), CompletionRequest)
    return _run(service.complete(req)).body.model_dump()


def chat(service: OpenAIService, **body: Any) -> dict[str, Any]:
    req = parse_request(json.dumps({"model": "tiny", **body}).encode(), ChatCompletionRequest)
    return _run(service.chat(req)).body.model_dump()


def chat_stream(service: OpenAIService, **body: Any) -> list[dict[str, Any]]:
    req = parse_request(json.dumps({"model": "tiny", "stream": True, **body}).encode(), ChatCompletionRequest)

    async def drain() -> list[dict[str, Any]]:
        reply = await service.chat(req)
        return [json.loads(line[6:]) async for line in reply.stream if line != "data: [DONE]\n\n"]
    return _run(drain())


def refused(call: Any, *args: Any, **body: Any) -> APIError:
    with pytest.raises(APIError) as err:
        call(*args, **body)
    return err.value


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from the model's own forward (float32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


# ---- echo and prompt logprobs -------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_in_lm_eval_loglikelihood_shape(service: OpenAIService, loaded: tuple[Any, Any],
                                                      max_tokens: int) -> None:
    """lm-eval's local-completions: token-id prompts in a list, echo, logprobs 1, max_tokens 1 (or 0)."""
    model, tok = loaded
    prompts = [tok("the capital of france is paris").input_ids, tok("hello world").input_ids]
    body = complete(service, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0, seed=1234)
    for choice, ids in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference_logprobs(model, ids)
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), ref, atol=1e-4)
        for tok_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert max(top.values()) >= tok_lp - 1e-6 and 1 <= len(top) <= 2  # top-1 and the token itself
        assert choice["text"].startswith(tok.decode(ids, skip_special_tokens=True))
        assert lp["text_offset"][0] == 0
        assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)


def test_max_tokens_zero_echoes_the_prompt_alone(service: OpenAIService) -> None:
    body = complete(service, prompt="the sea is a wave", echo=True, max_tokens=0)
    assert body["choices"][0]["text"] == "the sea is a wave"
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 0
    assert refused(complete, service, prompt="the sea", max_tokens=0).param == "max_tokens"


def test_prompt_logprobs_in_vllm_shape(service: OpenAIService, loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    ids = tok("one two three four five").input_ids
    body = complete(service, prompt=ids, max_tokens=2, temperature=0, prompt_logprobs=3)
    pl = body["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    ref = reference_logprobs(model, ids)
    for i, at in enumerate(pl[1:], start=1):
        assert abs(at[str(ids[i])]["logprob"] - ref[i - 1].item()) < 1e-4
        ranked = sorted((e for e in at.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2, 3]
        assert all(a["logprob"] >= b["logprob"] for a, b in itertools.pairwise(ranked))
    chat_body = chat(service, messages=[{"role": "user", "content": "hello"}], max_tokens=1, prompt_logprobs=0)
    assert chat_body["prompt_logprobs"][0] is None and len(chat_body["prompt_logprobs"]) > 3


def test_echo_streams_the_prompt_in_the_first_chunk(service: OpenAIService) -> None:
    req = CompletionRequest(model="tiny", prompt="hello world", echo=True, max_tokens=3, temperature=0, stream=True)

    async def drain() -> list[Any]:
        reply = await service.complete(req)
        return [json.loads(x[6:]) async for x in reply.stream if x != "data: [DONE]\n\n"]
    chunks = _run(drain())
    whole = complete(service, prompt="hello world", echo=True, max_tokens=3, temperature=0)
    assert chunks[0]["choices"][0]["text"].startswith("hello world")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]


# ---- top logprobs -------------------------------------------------------------------------------


def test_top_logprobs_are_the_real_distribution(service: OpenAIService, loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    body = chat(service, messages=[{"role": "user", "content": "the sea"}], max_tokens=4, temperature=0,
                logprobs=True, top_logprobs=20)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 20 and top[0]["logprob"] == entry["logprob"]  # greedy: the sampled token is top-1
        assert all(a["logprob"] >= b["logprob"] for a, b in itertools.pairwise(top))
    ids = tok("hello world").input_ids
    body = complete(service, prompt=ids, max_tokens=1, temperature=0, logprobs=5)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1).topk(5).values
    got = sorted(body["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
    assert len(got) >= 4  # distinct token texts (two tokens may decode alike)
    assert all(any(abs(g - r) < 1e-4 for r in ref.tolist()) for g in got)


# ---- sampling controls --------------------------------------------------------------------------


def _manager_sample(manager: Any, ids: list[int], n: int, **options: Any) -> list[int]:
    rid = manager.add_request(ids, max_new_tokens=n, temperature=1.0, seed=5, **options)
    out = None
    for out in manager.request_id_iter(rid):
        pass
    return list(out.generated_tokens)


@pytest.mark.parametrize("options", [
    {"presence_penalty": 2.0}, {"frequency_penalty": -2.0}, {"repetition_penalty": 1.8}, {"min_p": 0.5},
    {"top_k": 3}, {"logit_bias": {"40": 7.5, "41": -100}}, {"min_tokens": 12, "ignore_eos": True},
])
def test_sampling_controls_reach_the_engine(service: OpenAIService, manager: Any, loaded: tuple[Any, Any],
                                            options: dict[str, Any]) -> None:
    """Each control gives the engine's own result for it, which differs from the plain sample."""
    tok = loaded[1]
    ids = tok("the the the sea sea").input_ids
    body = complete(service, prompt=ids, max_tokens=12, temperature=1.0, seed=5, **options)
    engine = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in options.items()}
    expected = _manager_sample(manager, ids, 12, **engine)
    assert body["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
    assert expected != _manager_sample(manager, ids, 12), "the control changed nothing here: a weak test"


def test_logit_bias_ignore_eos_and_stop_token_ids_do_what_they_say(service: OpenAIService,
                                                                  loaded: tuple[Any, Any]) -> None:
    tok = loaded[1]
    forced = tok("wave").input_ids[0]
    body = complete(service, prompt="hello", max_tokens=5, temperature=0, logit_bias={str(forced): 100})
    assert body["choices"][0]["text"] == tok.decode([forced]) * 5 != ""
    eos = tok.eos_token_id
    body = complete(service, prompt="hello", max_tokens=6, temperature=0, logit_bias={str(eos): 100}, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    body = complete(service, prompt="hello", max_tokens=6, temperature=0, logit_bias={str(forced): 100},
                    stop_token_ids=[forced])
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "stop"
    body = complete(service, prompt="hello", max_tokens=6, temperature=0, logit_bias={str(eos): 100}, min_tokens=3)
    assert body["usage"]["completion_tokens"] == 4  # 3 tokens, then EOS


def test_n_choices_share_their_prefill(service: OpenAIService, manager: Any, loaded: tuple[Any, Any]) -> None:
    tok = loaded[1]
    ids = tok(" ".join(["seven eight nine ten"] * 12)).input_ids  # several pages
    before = manager.stats()
    body = complete(service, prompt=ids, n=4, max_tokens=3, temperature=1.0, seed=7)
    after = manager.stats()
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert len(body["choices"]) == 4 and body["usage"]["prompt_tokens"] == len(ids)
    assert computed < 2 * len(ids), f"{computed} prompt tokens computed for 4 choices of {len(ids)}"
    again = complete(service, prompt=ids, n=4, max_tokens=3, temperature=1.0, seed=7)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]  # seed + choice index


# ---- structured outputs -------------------------------------------------------------------------


@pytest.mark.parametrize("form", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
    {"guided_json": SCHEMA},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_json_schema_output_validates(service: OpenAIService, form: dict[str, Any]) -> None:
    for temperature in (0, 1.0):
        body = chat(service, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=64,
                    temperature=temperature, seed=3, **form)
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
        assert body["choices"][0]["finish_reason"] == "stop"


def test_json_object_regex_choice_and_grammar(service: OpenAIService) -> None:
    body = complete(service, prompt="hello", max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(body["choices"][0]["text"]), dict)
    body = complete(service, prompt="hello", max_tokens=32, temperature=1.0, seed=5, n=3,
                    guided_choice=["paris", "tokyo", "café"])
    assert {c["text"] for c in body["choices"]} <= {"paris", "tokyo", "café"}
    body = complete(service, prompt="hello", max_tokens=32, temperature=0, guided_regex=r"[a-c]{3}-[0-9]{2}")
    assert __import__("re").fullmatch(r"[a-c]{3}-[0-9]{2}", body["choices"][0]["text"])
    body = complete(service, prompt="hello", max_tokens=32, temperature=0,
                    structured_outputs={"grammar": 'root ::= "x" ("y" | "z") "!"'})
    assert body["choices"][0]["text"] in ("xy!", "xz!")
    body = complete(service, prompt="hello", max_tokens=4, temperature=0, response_format={"type": "text"})
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(("form", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(service: OpenAIService, form: dict[str, Any], param: str) -> None:
    err = refused(complete, service, prompt="hello", max_tokens=4, **form)
    assert err.status == 400 and err.param == param, err.message


# ---- tool calls ---------------------------------------------------------------------------------


def test_named_and_required_tool_calls_always_validate(service: OpenAIService) -> None:
    messages = [{"role": "user", "content": "weather in paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0, 1.0):
        body = chat(service, messages=messages, tools=[WEATHER, TIME], tool_choice=named, max_tokens=64,
                    temperature=temperature, seed=11)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    body = chat(service, messages=messages, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                max_tokens=64, temperature=1.0, seed=2)
    [call] = body["choices"][0]["message"]["tool_calls"]
    fn = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["function"]["parameters"])


def test_required_calls_cut_short_keep_their_complete_calls() -> None:
    from cbserve.serving.front.chat_replies import ChatRendering
    from cbserve.serving.front.replies import ChoiceResult

    whole = '{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}'
    cut = f'[{whole}, \n {whole}, {{"name": "get_time", "argu'
    content, calls = split_calls(cut, "required")
    assert content is None and [c.function.name for c in calls] == ["get_weather"] * 2
    assert json.loads(calls[1].function.arguments) == {"city": "paris", "days": 2}
    assert split_calls(whole[:30], "named") == (whole[:30], [])  # one call cut short: nothing to give
    assert split_calls("[", "required") == ("[", [])
    rendering = ChatRendering(tool_mode="required")
    for finish, expected in (("length", "length"), ("stop", "tool_calls")):  # cut short: still said
        choice = rendering.choice(0, ChoiceResult(text=cut if finish == "length" else f"[{whole}]",
                                                  finish_reason=finish))
        assert choice.finish_reason == expected and len(choice.message.tool_calls) >= 1


def test_required_calls_close_within_a_bound() -> None:
    """A model that repeats its call must still close the list (max_tokens defaults to the context)."""
    from cbserve.serving.constraints import MAX_PARALLEL_CALLS, tool_constraint

    call = {"name": "get_weather", "arguments": {"city": "paris", "days": 1}}
    for parallel, most in ((True, MAX_PARALLEL_CALLS), (False, 1)):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=parallel)
        spec = tool_constraint(req, "required").spec
        jsonschema.validate([call] * most, spec)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([call] * (most + 1), spec)


def test_named_tool_call_streams(service: OpenAIService) -> None:
    chunks = chat_stream(service, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                         tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64,
                         temperature=0)
    calls = [tc for c in chunks if c["choices"] for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
    first, rest = calls[0], calls[1:]  # OpenAI's deltas: the id and name, then the arguments in pieces
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    assert len(rest) > 1 and all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}
                                 and d["index"] == 0 for d in rest)  # no null id, type or name, as OpenAI
    arguments = "".join(d["function"]["arguments"] for d in rest)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    whole = chat(service, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], max_tokens=64,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    assert json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == json.loads(arguments)


def test_hermes_parser_cuts_calls_out_of_streamed_text() -> None:
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}'  # the second one left unclosed
    for size in (1, 3, 7, len(text)):
        parser, shown = HermesParser(), ""
        for i in range(0, len(text), size):
            out, _ = parser.feed(text[i:i + size])
            shown += out
            assert "<" not in shown
        rest, _ = parser.flush()
        assert shown + rest == "Let me check."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in parser.calls] == [
            ("get_weather", {"city": "paris"}), ("get_time", {"zone": "utc"})]
    content, calls = split_calls("no call here <tool_call>not json</tool_call>", "auto")
    assert content == "no call here <tool_call>not json</tool_call>" and calls == []
    assert split_calls('{"name": "f", "arguments": {}}', "none") == ('{"name": "f", "arguments": {}}', [])


def test_tool_messages_reach_the_chat_template(service: OpenAIService, loaded: tuple[Any, Any]) -> None:
    """The tiny template knows no tools: they are written into the prompt Hermes-style."""
    from cbserve.serving.chat_template import chat_token_ids, template_messages
    from cbserve.serving.front.schemas import ChatMessage

    tok = loaded[1]
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "paris", "days": 2}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]
    text = tok.decode(chat_token_ids(tok, template_messages(messages), [WEATHER]))
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    body = chat(service, messages=[m.model_dump(exclude_none=True) for m in messages], tools=[WEATHER], max_tokens=4,
                temperature=0)
    assert body["usage"]["prompt_tokens"] == len(tok(text).input_ids)


def test_tool_choice_is_checked(service: OpenAIService) -> None:
    messages = [{"role": "user", "content": "hi"}]
    err = refused(chat, service, messages=messages, tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.param == "tool_choice"
    assert refused(chat, service, messages=messages, tool_choice="required").param == "tool_choice"
    # A forced call and a response_format: the call wins, as in OpenAI's API (the format shapes a
    # text answer; the Agents SDK sends both for an agent with an output type that must call a tool).
    out = chat(service, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=400,
               parallel_tool_calls=False,
               response_format={"type": "json_object"}, temperature=0)
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# ---- strictness, overload, tokenizer endpoints -------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "bogus": True}},
     "stream_options.bogus"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),  # only with stream: true
    ({"prompt": "hi", "response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_unknown_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    err = refused(parse_request, json.dumps({"model": "tiny", **body}).encode(), CompletionRequest)
    assert err.status == 400 and err.param == param, err.message


def test_chat_unknown_fields_and_the_ignored_ones(service: OpenAIService) -> None:
    for body, param in (({"messages": [{"role": "user", "content": "x", "frobnicate": None}]}, "messages.0.frobnicate"),
                        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                         "messages.0.content")):
        err = refused(parse_request, json.dumps({"model": "tiny", **body}).encode(), ChatCompletionRequest)
        assert err.param is not None and err.param.startswith(param), (err.param, err.message)
    body = chat(service, messages=[{"role": "user", "content": "x"}], user="someone", max_tokens=2,
                tools=[{**WEATHER, "function": {**WEATHER["function"], "strict": True}}], tool_choice="none")
    assert "tool_calls" not in body["choices"][0]["message"] and body["choices"][0]["finish_reason"] == "length"


# -- what today's OpenAI clients send (issue 31) ------------------------------------------------------


def test_fields_current_sdks_send_are_accepted(service: OpenAIService) -> None:
    body = chat(service, messages=[{"role": "user", "content": "x"}], max_tokens=2, ignore_eos=True, store=False,
                metadata={"run": "a"},
                service_tier="auto", prompt_cache_key="conversation-1", user="someone", parallel_tool_calls=False)
    assert body["choices"][0]["finish_reason"] == "length"
    body = complete(service, prompt="x", max_tokens=2, ignore_eos=True, store=None, service_tier="default",
                    prompt_cache_key="k")
    assert body["usage"]["completion_tokens"] == 2
    for extra, param in (({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier"),
                         ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                         ({"metadata": {"k" * 65: "v"}}, "metadata"), ({"metadata": {"k": 1}}, "metadata.k"),
                         ({"prompt_cache_key": ""}, "prompt_cache_key")):
        err = refused(parse_request, json.dumps({"model": "tiny", "prompt": "x", **extra}).encode(), CompletionRequest)
        assert err.status == 400 and err.param == param, (extra, err.param, err.message)


def test_replayed_assistant_turns_are_accepted(service: OpenAIService) -> None:
    from cbserve.serving.chat_template import template_messages

    turn = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None,
            "reasoning_content": "the user greets"}
    messages = [{"role": "user", "content": "hello"}, turn, {"role": "user", "content": "and?"}]
    assert chat(service, messages=messages, max_tokens=2, ignore_eos=True)["choices"][0]["finish_reason"] == "length"
    req = parse_request(json.dumps({"model": "tiny", "messages": messages}).encode(), ChatCompletionRequest)
    assert template_messages(req.messages)[1] == {"role": "assistant", "content": "hi",
                                                  "reasoning_content": "the user greets"}
    err = refused(parse_request, json.dumps({"model": "tiny", "messages": [
        {"role": "user", "content": "x", "refusal": "no"}]}).encode(), ChatCompletionRequest)
    assert err.status == 400 and err.param == "messages.0" and "refusal" in err.message


def test_prompt_cache_key_is_the_routing_key(service: OpenAIService) -> None:
    def hashes(prompt: str, **extra: Any) -> list[int]:
        req = parse_request(json.dumps({"model": "tiny", "prompt": prompt, **extra}).encode(), CompletionRequest)
        return service.completion_requests(req, "cmpl-x")[0].prefix_hashes

    long_a, long_b = "a" * 400, "b" * 400
    assert hashes(long_a) != hashes(long_b)  # by prefix without a key
    assert hashes(long_a, prompt_cache_key="k") == hashes(long_b, prompt_cache_key="k") != []
    assert hashes(long_a, prompt_cache_key="k") != hashes(long_a, prompt_cache_key="other")
    assert hashes("short", prompt_cache_key="k") == hashes(long_a, prompt_cache_key="k")


def test_chat_template_kwargs_and_reasoning_effort(service: OpenAIService, loaded: tuple[Any, Any]) -> None:
    import copy

    from cbserve.serving.chat_template import chat_token_ids
    from cbserve.serving.front.openai_service import template_kwargs
    from cbserve.serving.replica.generation import tokenize

    tok = copy.deepcopy(loaded[1])  # a Qwen3-like thinking switch
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    msgs = [{"role": "user", "content": "hello"}]
    on, off = chat_token_ids(tok, msgs, None), chat_token_ids(tok, msgs, None, template_kwargs={"enable_thinking": False})
    assert tok.decode(off).endswith("/no_think") and not tok.decode(on).endswith("/no_think")

    def kwargs(**body: Any) -> dict[str, Any] | None:
        return template_kwargs(ChatCompletionRequest(messages=msgs, **body))
    assert kwargs(reasoning_effort="minimal") == {"enable_thinking": False} == kwargs(reasoning_effort="none")
    assert kwargs(reasoning_effort="high") == {"enable_thinking": True}
    assert kwargs(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == {"enable_thinking": False}
    assert kwargs() is None
    wreq = service.chat_requests(ChatCompletionRequest(messages=msgs, reasoning_effort="none"), "c")[0]
    assert tokenize(tok, wreq) == off  # the replica renders with the switch off
    # The tiny model's template has no switch: reasoning_effort is refused by name; variables pass.
    err = refused(chat, service, messages=msgs, max_tokens=2, reasoning_effort="low")
    assert err.status == 400 and err.param == "reasoning_effort", err.message
    assert chat(service, messages=msgs, max_tokens=2, chat_template_kwargs={"custom": 1})["choices"][0]["finish_reason"]
    err = refused(parse_request, json.dumps({"model": "tiny", "messages": msgs, "chat_template_kwargs": {
        "tokenize": True}}).encode(), ChatCompletionRequest)
    assert err.status == 400 and err.param == "chat_template_kwargs" and "tokenize" in err.message


def test_x_request_id_is_the_response_id(service: OpenAIService) -> None:
    from cbserve.serving.front.openai_service import call_ids

    req = parse_request(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                    "max_tokens": 2}).encode(), ChatCompletionRequest)
    assert _run(service.chat(req, client_id="trace-42")).body.id == "chatcmpl-trace-42"
    creq = parse_request(json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode(), CompletionRequest)
    assert _run(service.complete(creq, client_id="a.b:c_d-e")).body.id == "cmpl-a.b:c_d-e"
    assert _run(service.complete(creq)).body.id.startswith("cmpl-")
    # Two clients with one id: one response id, two engine calls (choices and fair share apart).
    (first, call_a), (second, call_b) = call_ids("cmpl", "same"), call_ids("cmpl", "same")
    assert first == second == "cmpl-same" and call_a != call_b and call_a.startswith("cmpl-same-")
    for bad in ("", "x" * 129, "a b", "é", "a\nb"):
        err = refused(lambda bad=bad: _run(service.complete(creq, client_id=bad)))
        assert err.status == 400 and err.param == "x-request-id"


def test_max_tokens_defaults_to_and_is_capped_by_the_context_left(service: OpenAIService, manager: Any,
                                                                  loaded: tuple[Any, Any], model_dir: Path) -> None:
    from cbserve.errors import InvalidRequestError
    from cbserve.serving.replica.generation import max_new_tokens

    info = ModelInfo(eos_token_id=None, max_context=64, default_max_tokens=None)
    assert max_new_tokens(WorkerRequest(request_id="r", prompt="x"), 10, info) == 54  # the context left
    assert max_new_tokens(WorkerRequest(request_id="r", prompt="x", max_tokens=8192), 10, info) == 54
    assert max_new_tokens(WorkerRequest(request_id="r", prompt="x", max_tokens=5), 10, info) == 5
    with_default = ModelInfo(eos_token_id=None, max_context=64, default_max_tokens=16)
    assert max_new_tokens(WorkerRequest(request_id="r", prompt="x"), 10, with_default) == 16
    assert max_new_tokens(WorkerRequest(request_id="r", prompt="x"), 60, with_default) == 4
    with pytest.raises(InvalidRequestError) as err:
        max_new_tokens(WorkerRequest(request_id="r", prompt="x", max_tokens=5), 64, info)
    assert err.value.field == "input_ids"
    # Served: no server limit by default, a large fixed max_tokens ends where the context does.
    args = ClusterArgs(model=str(model_dir), served_model_name="tiny")
    assert args.limits.max_tokens is None and args.generation.max_tokens is None
    small = ModelInfo(eos_token_id=None, max_context=24, default_max_tokens=None)
    open_service = OpenAIService(args, _opener(manager, loaded[1], small))
    for body in ({"max_tokens": 8192}, {}):
        out = complete(open_service, prompt=[5, 6, 7, 8], ignore_eos=True, **body)
        assert out["usage"]["completion_tokens"] == 20 and out["choices"][0]["finish_reason"] == "length", body
    err = refused(complete, service, prompt="x", max_tokens=8192)  # the module's service sets limits.max_tokens
    assert err.status == 400 and err.param == "max_tokens"


def test_a_full_engine_queue_is_the_overload_answer() -> None:
    class FullManager:
        def add_request(self, *args: Any, **kwargs: Any) -> str:
            raise QueueFullError(4, 4)

    class Tok:
        def __call__(self, text: str) -> Any:
            return type("Enc", (), {"input_ids": [1, 2, 3]})()

    async def first() -> Any:
        info = ModelInfo(eos_token_id=0, max_context=64, default_max_tokens=4)
        return await run_request(FullManager(), Tok(), info, WorkerRequest(request_id="r", prompt="x"), "r").__anext__()
    ev = _run(first())
    assert ev.kind == "error" and ev.code == "overloaded"
    err = refusal(ev, 429, 2.5)
    assert isinstance(err, APIError) and err.status == 429 and err.response().headers["retry-after"] == "3"


def test_tokenize_and_detokenize_in_vllm_shape(loaded: tuple[Any, Any]) -> None:
    tok = loaded[1]
    req = tokenization.parse_tokenize(json.dumps({"prompt": "hello café", "return_token_strs": True}).encode())
    out = tokenization.tokenize(tok, CONTEXT, tokenization.tokenize_work(req))
    assert out.tokens == tok("hello café").input_ids and out.count == len(out.tokens) and out.max_model_len == CONTEXT
    assert out.token_strs == tok.convert_ids_to_tokens(out.tokens)
    assert tokenization.detokenize(tok, len(tok), out.tokens).prompt == "hello café"
    req = tokenization.parse_tokenize(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    chat_ids = tokenization.tokenize(tok, CONTEXT, tokenization.tokenize_work(req)).tokens
    assert chat_ids == list(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    with pytest.raises(cbserve.InvalidRequestError) as err:
        tokenization.detokenize(tok, len(tok), [10**6])
    assert err.value.field == "tokens"
    assert refused(tokenization.parse_tokenize, b'{"prompt": "x", "bogus": 1}').param == "bogus"
    info = tokenization.tokenizer_info(tok, CONTEXT)
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_guidellm_request_shapes(service: OpenAIService) -> None:
    """What GuideLLM sends (`stream_options.continuous_usage_stats`, `stop: null`, `ignore_eos`):
    usage in every chunk, exactly the asked-for tokens."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    req = parse_request(json.dumps({"model": "tiny", "prompt": "the sea", "stream": True, "stream_options": options,
                                    "max_tokens": 8, "stop": None, "ignore_eos": True}).encode(), CompletionRequest)

    async def drain() -> list[Any]:
        reply = await service.complete(req)
        return [json.loads(x[6:]) async for x in reply.stream if x != "data: [DONE]\n\n"]
    chunks = _run(drain())
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts)
    messages = [{"role": "user", "content": [{"type": "text", "text": "the sea"}]}]
    chunks = chat_stream(service, messages=messages, stream_options=options, max_completion_tokens=6, stop=None,
                         ignore_eos=True)
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and all("tool_calls" not in c["choices"][0]["delta"]
                                                                 for c in chunks if c["choices"])


def test_batch_lines_take_the_same_controls(manager: Any, loaded: tuple[Any, Any], info: ModelInfo) -> None:
    """A batch job's line with sampling controls, a constraint and logprobs, through the replica's
    request path and the fold every front uses, to its output record."""
    from cbserve.batch.requests import RequestDefaults, to_result, to_worker_request
    from cbserve.batch.schema import BatchLine, parse_line
    from cbserve.serving.front.replies import fold

    tok = loaded[1]
    raw = {"id": "a", "prompt": "hello", "raw": True, "max_tokens": 12, "temperature": 0, "presence_penalty": 0.5,
           "logit_bias": {"5": -10}, "guided_choice": ["paris", "tokyo"], "logprobs": True, "top_logprobs": 2,
           "prompt_logprobs": 1}
    line = parse_line(json.dumps(raw), 1)
    assert isinstance(line, BatchLine)
    wreq = to_worker_request(line, "batch-1", RequestDefaults(), chat_template=True)
    result = _run(fold(run_request(manager, tok, info, wreq, "local")))
    record = json.loads(to_result(line, 1, result).to_json())
    assert record["text"] in ("paris", "tokyo") and record["finish_reason"] == "stop"
    assert len(record["logprobs"]) == len(record["token_ids"]) == len(record["top_logprobs"])
    assert all(len(top) == 2 for top in record["top_logprobs"])
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == len(tok("hello").input_ids)
    bad = parse_line(json.dumps({**raw, "guided_regex": "(unclosed", "guided_choice": None}), 2)
    result = _run(fold(run_request(manager, tok, info, to_worker_request(bad, "batch-2", RequestDefaults(), True),
                                   "local")))
    record = json.loads(to_result(bad, 2, result).to_json())
    assert record["error_type"] == "invalid_request" and "guided_regex" in record["error"]
    assert parse_line(json.dumps({**raw, "frobnicate": 1}), 3).error_type == "invalid_line"
