"""Tool calls in the formats other than Hermes' (issue 31): Mistral's [TOOL_CALLS], Llama 3's JSON,
pythonic lists; the format read off the chat template; whole and streamed alike."""

from __future__ import annotations

import json

import pytest

from cbserve.serving.chat_template import tool_format
from cbserve.serving.front.chat_replies import ChatRendering
from cbserve.serving.front.format_stream import stream_parser
from cbserve.serving.front.replies import ChoiceResult, Piece
from cbserve.serving.front.tool_calls import auto_parser, split_calls

TIME = {"name": "get_time", "arguments": {"zone": "utc"}}
WEATHER = {"name": "get_weather", "arguments": {"city": "paris", "days": 2}}
CASES = [  # (format, output, content, calls)
    ("mistral", "Sure.[TOOL_CALLS]" + json.dumps([TIME, WEATHER]), "Sure.", [TIME, WEATHER]),
    ("mistral", "[TOOL_CALLS]" + json.dumps([TIME]), None, [TIME]),
    ("mistral", "No call here [TOOL", "No call here [TOOL", []),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}', None, [TIME]),
    ("llama3_json", json.dumps(TIME) + "; " + json.dumps(WEATHER), None, [TIME, WEATHER]),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("llama3_json", "The time is noon.", "The time is noon.", []),
    ("pythonic", '[get_time(zone="utc"), get_weather(city="paris", days=2)]', None, [TIME, WEATHER]),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "[get_time(utc)]", "[get_time(utc)]", []),  # positional: not a call
    ("pythonic", "It is noon.", "It is noon.", []),
]


def _as_dicts(calls: list) -> list[dict]:
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), CASES)
def test_whole_and_streamed_outputs_give_the_same_calls(fmt: str, output: str, content: str | None,
                                                        calls: list[dict]) -> None:
    got_content, got_calls = split_calls(output, "auto", fmt)
    assert (got_content, _as_dicts(got_calls)) == (content if calls else output, calls)
    for size in (1, 4):
        parser, text, streamed = auto_parser(fmt), "", []
        for i in range(0, len(output), size):
            t, c = parser.feed(output[i : i + size])
            text, streamed = text + t, streamed + c
        t, c = parser.flush()
        if calls:
            assert _as_dicts(streamed + c) == calls and (text + t).strip() == (content or ""), size
        else:
            assert text + t == output and not streamed + c, size


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), [c for c in CASES if c[0] != "pythonic"] + [
    ("mistral", "[TOOL_CALLS] " + json.dumps(TIME), None, [TIME]),  # one object, no list
    ("llama3_json", "  <|python_tag|> " + json.dumps(TIME) + "\n" + json.dumps(WEATHER), None, [TIME, WEATHER]),
])
def test_json_formats_stream_each_calls_arguments_as_they_come(fmt: str, output: str, content: str | None,
                                                               calls: list[dict]) -> None:
    """Mistral and Llama 3 JSON calls in OpenAI's deltas: id and name first, then the arguments'
    text in pieces as the output comes; the same calls and content at every chunking."""
    for size in (1, 4, len(output)):
        parser, text, deltas = stream_parser(fmt), "", []
        for i in range(0, len(output), size):
            t, d = parser.feed_deltas(output[i : i + size])
            text, deltas = text + t, deltas + d
        t, d = parser.flush_deltas()
        text, deltas = text + t, deltas + d
        got: dict[int, dict] = {}
        for d in deltas:
            if d.id is not None:  # a call's first delta: its id and name, no arguments yet
                assert d.index == len(got) and d.function.name and d.function.arguments == ""
                got[d.index] = {"name": d.function.name, "arguments": ""}
            got[d.index]["arguments"] += d.function.arguments or ""
        assert [{**c, "arguments": json.loads(c["arguments"])} for c in got.values()] == calls, size
        assert (text.strip() or None) == (content if calls else output), size
        if calls and size == 1:  # incremental: more argument pieces than calls
            assert sum(1 for d in deltas if d.id is None) > len(calls)
        assert _as_dicts(parser.calls) == calls


def test_content_that_is_no_call_streams_at_once() -> None:
    for fmt in ("llama3_json", "pythonic", "mistral"):
        parser = auto_parser(fmt)
        assert parser.feed("Hello") == ("Hello", [])  # not held to the end
        assert parser.feed(", world") == (", world", [])
    assert auto_parser("pythonic").feed("[get_") == ("", [])  # may be a call: held


def test_the_rendering_takes_the_choice_format() -> None:
    output = '[get_time(zone="utc")]'
    choice = ChatRendering(tool_mode="auto").choice(
        0, ChoiceResult(text=output, finish_reason="stop", tool_format="pythonic")).model_dump()
    assert choice["finish_reason"] == "tool_calls" and _as_dicts_raw(choice["message"]["tool_calls"]) == [TIME]
    stream = ChatRendering(tool_mode="auto").stream(0, tool_format="pythonic")
    chunks = [c.model_dump() for ch in output for c in stream.chunks(Piece(text=ch, token_ids=[1]))]
    chunks += [c.model_dump() for c in stream.chunks(Piece(finish_reason="stop"))]
    assert not any(c["delta"].get("content") for c in chunks)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    hermes = ChatRendering(tool_mode="auto").choice(0, ChoiceResult(text=output, finish_reason="stop")).model_dump()
    assert hermes["message"]["content"] == output  # the same text is no Hermes call


def test_a_mistral_stream_sends_content_then_call_deltas() -> None:
    output = "Sure.[TOOL_CALLS]" + json.dumps([TIME, WEATHER])
    stream = ChatRendering(tool_mode="auto").stream(0, tool_format="mistral")
    chunks = [c.model_dump() for ch in output for c in stream.chunks(Piece(text=ch, token_ids=[1]))]
    chunks += [c.model_dump() for c in stream.chunks(Piece(finish_reason="stop"))]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Sure."
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls") or []]
    assert [d["index"] for d in deltas if d.get("id")] == [0, 1] and len(deltas) > 4  # arguments in pieces
    args = ["".join(d["function"].get("arguments") or "" for d in deltas if d["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [TIME["arguments"], WEATHER["arguments"]]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def _as_dicts_raw(calls: list[dict]) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


class Tok:
    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize(("template", "fmt"), [
    ("{{ tools }}<tool_call>", "hermes"),
    ("{{ tools }}[AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("{{ tools }}[func_name1(params_name1=params_value1)]", "pythonic"),
    ("{{ tools }}<|python_tag|>", "llama3_json"),
    ("{{ tools }}Given the following functions, please respond with a JSON for a function call", "llama3_json"),
    ("{{ messages }}", "hermes"),  # no tools in the template: cbserve's Hermes prompt teaches them
])
def test_the_format_is_read_off_the_template(template: str, fmt: str) -> None:
    assert tool_format(Tok(template), [{"type": "function", "function": {"name": "f"}}]) == fmt
    assert tool_format(Tok(template), None) == "hermes"


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_hermes_calls_stream_their_arguments_as_they_come(chunk: int) -> None:
    """OpenAI's deltas: a call's id and name first, then its arguments' text in pieces, however the
    text is cut; a call of another head comes whole; a tag that is no call stays content."""
    import json

    from cbserve.serving.front.tool_calls import HermesStreamParser

    text = ('hi <tool_call>\n{"name": "get_time", "arguments": {"zone": "u}tc", "n": [1, 2]}}\n</tool_call> and '
            '<tool_call>{"arguments": {}, "name": "x"}</tool_call><tool_call>not json</tool_call> bye')
    parser, content, deltas = HermesStreamParser(), "", []
    for at in range(0, len(text), chunk):
        shown, out = parser.feed_deltas(text[at:at + chunk])
        content, deltas = content + shown, deltas + out
    shown, out = parser.flush_deltas()
    content, deltas = content + shown, deltas + out
    assert content == "hi  and <tool_call>not json</tool_call> bye"
    heads = [(d.index, d.function.name) for d in deltas if d.id]
    assert heads == [(0, "get_time"), (1, "x")]
    first = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert json.loads(first) == {"zone": "u}tc", "n": [1, 2]} and "<" not in first
    assert chunk > len(text) or sum(1 for d in deltas if d.index == 0) > 2  # in pieces
    assert [d.function.arguments for d in deltas if d.index == 1] == ["{}"]  # whole
    assert [c.function.name for c in parser.calls] == ["get_time", "x"]
