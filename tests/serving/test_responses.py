"""OpenAI's Responses API (serving/front/responses.py) on the in-process service: requests become
the chat requests they mean, answers and streamed events are what the `openai` SDK's own types
accept, and what is not supported is refused naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import TypeAdapter

from cbserve.serving.api_errors import APIError
from cbserve.serving.front.json_body import parse_request
from cbserve.serving.front.responses import ResponsesRequest, input_messages, to_chat
from cbserve.serving.front.schemas import ChatCompletionRequest
from tests.serving import test_openai_parity as parity

# The in-process service over the tiny model (and the fixtures it needs), as test_openai_parity has it.
model_dir, loaded, manager, info, service = parity.model_dir, parity.loaded, parity.manager, parity.info, parity.service

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["paris", "tokyo"]}}}}


def _req(**body: Any) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "tiny", **body}).encode(), ResponsesRequest)


def _respond(service: Any, **body: Any) -> Any:
    return asyncio.run(service.responses(_req(**body)))


def _events(service: Any, **body: Any) -> list[dict[str, Any]]:
    async def drain() -> list[str]:
        reply = await service.responses(_req(stream=True, **body))
        return [line async for line in reply.stream]
    out = []
    for block in asyncio.run(drain()):
        kind, data = block.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def _chat_of(req: ResponsesRequest) -> ChatCompletionRequest:
    return to_chat(req, input_messages(req))


def test_input_items_become_the_chat_messages_they_mean() -> None:
    req = _req(instructions="be brief", input=[
        {"role": "user", "content": "weather in tokyo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "tokyo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}])
    assert _chat_of(req).messages[0].role == "system" and _chat_of(req).messages[0].content == "be brief"
    assert input_messages(req) == [
        {"role": "user", "content": "weather in tokyo?"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "tokyo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "developer", "content": "ab"}]
    chat = _chat_of(_req(input="hi", max_output_tokens=7, tools=[WEATHER], tool_choice={"type": "function",
                        "name": "get_weather"}, text={"format": {"type": "json_schema", "name": "v", "schema": {
                            "type": "object"}}}, reasoning={"effort": "low"}, parallel_tool_calls=False))
    assert isinstance(chat, ChatCompletionRequest)
    assert chat.max_tokens == 7 and chat.tools[0].function.name == "get_weather" and not chat.parallel_tool_calls
    assert chat.tool_choice.function.name == "get_weather" and chat.reasoning_effort == "low"
    assert chat.response_format.type == "json_schema"
    assert _chat_of(_req(input="hi", safety_identifier="t1")).user == "t1"  # the fair-share tenant, as `user`


@pytest.mark.parametrize(("body", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_is_not_supported_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        _chat_of(_req(**{"input": "hi", **body}))
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_an_answer_is_a_response_the_sdk_reads(service: Any) -> None:
    from openai.types.responses import Response

    body = _respond(service, input="the sea", max_output_tokens=6, temperature=0).body
    response = Response.model_validate(body)
    chat = asyncio.run(service.chat(parse_request(json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "the sea"}], "max_tokens": 6,
        "temperature": 0}).encode(), ChatCompletionRequest))).body
    assert response.output_text == chat.choices[0].message.content  # the same greedy answer
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.id.startswith("resp_") and response.output[0].type == "message"


def test_a_stream_is_the_sdk_events_and_adds_up_to_the_answer(service: Any) -> None:
    from openai.types.responses import Response, ResponseStreamEvent

    events = _events(service, input="the sea", max_output_tokens=6, temperature=0)
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    kinds = [e.type for e in parsed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    final = parsed[-1].response
    whole = Response.model_validate(_respond(service, input="the sea", max_output_tokens=6, temperature=0).body)
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == 6


def test_function_calls_come_back_as_items(service: Any) -> None:
    from openai.types.responses import Response, ResponseStreamEvent

    body = _respond(service, input="weather in tokyo?", tools=[WEATHER], tool_choice="required", temperature=0,
                    max_output_tokens=200).body
    response = Response.model_validate(body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    assert json.loads(calls[0].arguments)["city"] in ("paris", "tokyo") and response.status == "completed"
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in _events(
        service, input="weather in tokyo?", tools=[WEATHER], tool_choice="required", max_output_tokens=200,
        temperature=0)]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == "".join(c.arguments for c in calls)
    assert len(pieces) > len(calls)  # the arguments in pieces, as the model writes them


def test_previous_response_id_continues_the_stored_conversation(service: Any) -> None:
    first = _respond(service, input="the sea", max_output_tokens=4, temperature=0).body
    follow = _respond(service, previous_response_id=first["id"], input="one two", max_output_tokens=4,
                      temperature=0, instructions="be brief").body
    said = first["output"][0]["content"][0]["text"]
    chat = asyncio.run(service.chat(parse_request(json.dumps({"model": "tiny", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sea"},
                     {"role": "assistant", "content": said}, {"role": "user", "content": "one two"}]}).encode(),
        ChatCompletionRequest))).body
    assert follow["usage"]["input_tokens"] == chat.usage.prompt_tokens  # the whole conversation, once
    assert follow["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert follow["previous_response_id"] == first["id"] and follow["store"] is True
    # A streamed response is stored too; store: false keeps nothing; unknown ids are refused.
    streamed = _events(service, input="the sea", max_output_tokens=2, temperature=0)[-1]["response"]["id"]
    assert _respond(service, previous_response_id=streamed, input="one", max_output_tokens=2).body["status"]
    unstored = _respond(service, input="the sea", max_output_tokens=2, store=False).body
    assert unstored["store"] is False
    for rid in (unstored["id"], "resp_unknown"):
        with pytest.raises(APIError) as err:
            _respond(service, previous_response_id=rid, input="hi", max_output_tokens=2)
        assert err.value.param == "previous_response_id"


def test_the_store_keeps_the_last_responses_only() -> None:
    from cbserve.serving.front.responses import ResponseStore

    store = ResponseStore(size=2)
    for i in range(3):
        store.put(f"resp_{i}", [{"role": "user", "content": str(i)}])
    assert store.get("resp_2") and store.get("resp_1")
    with pytest.raises(APIError):
        store.get("resp_0")
