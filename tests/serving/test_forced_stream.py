"""Forced tool calls (`tool_choice` required / named, issue 31) streamed as OpenAI streams them:
the call's id and name first, then its arguments' text in pieces, the same calls however the
constrained output is cut into chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cbserve.serving.front.chat_replies import ChatRendering
from cbserve.serving.front.forced_stream import ForcedCallStream
from cbserve.serving.front.replies import Piece
from cbserve.serving.front.tool_calls import split_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "pa}r\\"is", "days": 2, "tags": ["a", {"b": []}]}}'
TIME = '{"name": "get_time", "arguments": {}}'
OUTPUTS = {
    "named": WEATHER,
    "required": f"[{WEATHER}, {TIME},\n  {WEATHER}]",
}


def _stream(mode: str, text: str, size: int) -> tuple[str, list[Any], ForcedCallStream]:
    parser, content, deltas = ForcedCallStream(mode), "", []
    for at in range(0, len(text), size):
        shown, out = parser.feed_deltas(text[at:at + size])
        content, deltas = content + shown, deltas + out
    shown, out = parser.flush_deltas()
    return content + shown, deltas + out, parser


def _assembled(deltas: list[Any]) -> list[tuple[str, str, str]]:
    """What a client builds from the deltas: (id, name, arguments) per index."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.function.name and d.function.arguments == ""
            calls[d.index] = [d.id, d.function.name, ""]
        else:  # every later delta carries arguments only
            assert d.type is None and d.function.name is None and d.function.arguments
            calls[d.index][2] += d.function.arguments
    return [tuple(c) for c in calls.values()]  # type: ignore[misc]


@pytest.mark.parametrize("mode", ["named", "required"])
def test_every_chunking_gives_the_same_calls(mode: str) -> None:
    text = OUTPUTS[mode]
    _, whole = split_calls(text, mode)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    for size in range(1, len(text) + 1):
        content, deltas, parser = _stream(mode, text, size)
        assert content == ""
        calls = _assembled(deltas)
        assert [(name, json.loads(args)) for _, name, args in calls] == expected
        assert [(c.id, c.function.name, c.function.arguments) for c in parser.calls] == calls
        if size == 1:  # arguments come in pieces, as they are written
            assert len([d for d in deltas if d.index == 0]) > 10
    assert [name for name, _ in expected] == (["get_weather"] if mode == "named" else
                                               ["get_weather", "get_time", "get_weather"])


def test_arguments_are_the_written_text_without_the_call_objects_own_brackets() -> None:
    _, deltas, _ = _stream("required", OUTPUTS["required"], 1)
    args = [a for _, _, a in _assembled(deltas)]
    assert args == [WEATHER[WEATHER.index('{"city"'):-1], "{}", WEATHER[WEATHER.index('{"city"'):-1]]


def test_a_call_in_another_key_order_comes_whole() -> None:
    text = '[{"arguments": {"zone": "utc"}, "name": "get_time"}]'
    for size in (1, 5, len(text)):
        _, deltas, _ = _stream("required", text, size)
        assert [(d.index, d.id is not None, d.function.name, d.function.arguments) for d in deltas] == [
            (0, True, "get_time", '{"zone": "utc"}')]


def test_cut_short() -> None:
    """A list cut inside its second call: the first call whole, the second's arguments so far;
    an output cut before any call opened is content at the end, as in the whole reply."""
    cut = f'[{TIME}, {{"name": "get_weather", "arguments": {{"city": "pa'
    content, deltas, parser = _stream("required", cut, 3)
    assert content == "" and _assembled(deltas)[1][1:] == ("get_weather", '{"city": "pa')
    assert [c.function.name for c in parser.calls] == ["get_time"]
    for mode, text in (("named", '{"name": "get_wea'), ("required", "[")):
        content, deltas, _ = _stream(mode, text, 2)
        assert (content, deltas) == (text, []) == split_calls(text, mode)


@pytest.mark.parametrize("mode", ["named", "required"])
def test_the_chat_stream_sends_forced_calls_as_they_come(mode: str) -> None:
    """Through a choice's chunks: the role's chunk aside, no content, the call deltas, and
    `finish_reason: "tool_calls"` (`"length"` when cut short)."""
    text = OUTPUTS[mode]
    for finish in ("stop", "length"):
        stream = ChatRendering(tool_mode=mode).stream(0)
        chunks = [c for at in range(0, len(text), 4) for c in stream.chunks(Piece(text=text[at:at + 4]))]
        chunks += stream.chunks(Piece(finish_reason=finish))
        assert all(c.delta.content is None for c in chunks)
        deltas = [d for c in chunks for d in c.delta.tool_calls or []]
        assert len(deltas) > 10 and [c.finish_reason for c in chunks][-1] == (
            "tool_calls" if finish == "stop" else "length")
        assert [n for _, n, _ in _assembled(deltas)] == [c.function.name for c in split_calls(text, mode)[1]]
