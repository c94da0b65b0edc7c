"""Tool calls in a chat's output, in OpenAI's shape.

- `tool_choice: "auto"`: the model's Hermes-style calls, `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` (what Qwen, Hermes, SmolLM3 and most open chat templates teach), are cut
  out of the text as it streams (`HermesParser`); what is not a well-formed call stays content.
- other models' formats (Mistral, Llama 3 JSON, pythonic): `tool_formats.py`; streamed:
  `format_stream.py`.
- `"required"` and a named function: the output was constrained to the calls' JSON (a list of
  calls, or one call: `constraints.tool_constraint`), parsed when it ends (`forced_calls`) or
  as it streams (`forced_stream.py`).

A call gets an id `call_<hex>` and its arguments as JSON text, as OpenAI sends them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cbserve.serving.front.schemas import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from cbserve.serving.front.stream_tags import partial_tail
from cbserve.serving.front.tool_formats import WholeOutputParser

START, END = "<tool_call>", "</tool_call>"


def _call(obj: Any) -> ToolCall | None:
    """A parsed `{"name": ..., "arguments": {...}}` as a ToolCall (None when it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=obj["name"], arguments=text))


def parse_call(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body))
    except ValueError:
        return None


def forced_calls(text: str, mode: str) -> list[ToolCall]:
    """The calls of a constrained output: one call (named) or a JSON list of them (required).
    A list cut short (max_tokens, the context) gives its complete calls; a named call cut short
    gives none."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = complete_items(text) if mode == "required" else None
    items = obj if mode == "required" and isinstance(obj, list) else [obj]
    calls = [_call(item) for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


def complete_items(text: str) -> list[Any]:
    """The whole items at the head of a JSON list whose text was cut short."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    if at == 0:
        return items
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)


@dataclass
class HermesParser:
    """Cuts `<tool_call>...</tool_call>` blocks out of streamed text."""

    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add text; returns the content that may be shown now and the calls completed."""
        self._buf += text
        content, done = "", []
        while True:
            if not self._in_call:
                shown = self._to_call()
                content += shown[0]
                if not shown[1]:
                    break
            else:
                at = self._buf.find(END)
                if at < 0:
                    break
                body, self._buf, self._in_call = self._buf[:at], self._buf[at + len(END):], False
                content += self._take(body, closed=True, out=done)
        return content, done

    def _to_call(self) -> tuple[str, bool]:
        """Outside a call: (the text before the next start tag, whether one was found); a tail
        that may begin a start tag stays buffered."""
        at = self._buf.find(START)
        if at < 0:
            keep = partial_tail(self._buf, START)
            shown, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            return shown, False
        shown, self._buf, self._in_call = self._buf[:at], self._buf[at + len(START):], True
        return shown, True

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: an unclosed call is still a call when its JSON is complete."""
        done: list[ToolCall] = []
        content = self._take(self._buf, closed=False, out=done) if self._in_call else self._buf
        self._buf, self._in_call = "", False
        return content, done

    def _take(self, body: str, closed: bool, out: list[ToolCall]) -> str:
        call = parse_call(body.strip())
        if call is None:  # not a call after all: it stays text
            return START + body + (END if closed else "")
        self.calls.append(call)
        out.append(call)
        return ""


# A Hermes call's head as its templates write it, up to where the arguments' JSON begins.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
# What may still be the call object's own closing brace (held back from the arguments).
_TAIL = re.compile(r"\s*\}?\s*$")


@dataclass
class OpenCall:
    """A call being streamed: its delta index and id, and how much of its body has been sent."""

    index: int
    id: str
    name: str
    sent: int

    @classmethod
    def read(cls, index: int, head: re.Match[str], sent: int) -> OpenCall:
        """The call whose head (`CALL_HEAD`) was just read, with a new id."""
        return cls(index, f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{head.group(1)}"'), sent)

    def first_delta(self) -> DeltaToolCall:
        """OpenAI's first delta of a call: its index, id and name, no arguments yet."""
        return DeltaToolCall(index=self.index, id=self.id, type="function",
                             function=DeltaFunctionCall(name=self.name, arguments=""))


@dataclass
class HermesStreamParser(HermesParser):
    """`HermesParser` for a stream, in OpenAI's deltas: a call's id and name as soon as they are
    written, then its arguments' JSON text as it comes. A call whose head is not `{"name": ...,
    "arguments": ...}` comes whole when it ends; once streamed, a call stays a call."""

    opened: int = 0  # calls given a delta index so far
    _open: OpenCall | None = None

    def feed_deltas(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """Add text; returns the content that may be shown now and the call deltas."""
        self._buf += text
        content, out = "", []
        while True:
            if not self._in_call:
                shown = self._to_call()
                content += shown[0]
                if not shown[1]:
                    return content, out
                continue
            at = self._buf.find(END)
            if at < 0:  # not what may be the start of the end tag
                out += self._progress(self._buf[: len(self._buf) - partial_tail(self._buf, END)], whole=False)
                return content, out
            body, self._buf, self._in_call = self._buf[:at], self._buf[at + len(END):], False
            content += self._end(body, END, out)

    def flush_deltas(self) -> tuple[str, list[DeltaToolCall]]:
        """The end of the output: an unclosed call counts when its JSON is complete."""
        out: list[DeltaToolCall] = []
        content = self._end(self._buf, "", out) if self._in_call else self._buf
        self._buf, self._in_call = "", False
        return content, out

    def _progress(self, body: str, whole: bool) -> list[DeltaToolCall]:
        """The deltas `body` (a call's text so far; `whole`: all of it) adds to what was sent."""
        out = []
        if self._open is None:
            head = CALL_HEAD.match(body)
            if head is None:
                return out
            self._open = OpenCall.read(self.opened, head, head.end())
            self.opened += 1
            out.append(self._open.first_delta())
        end = len(body.rstrip()) - 1 if whole else len(body) - len(_TAIL.search(body, self._open.sent).group(0))
        piece = body[self._open.sent:end].rstrip() if whole else body[self._open.sent:end]
        if piece:
            out.append(DeltaToolCall(index=self._open.index, function=DeltaFunctionCall(arguments=piece)))
            self._open.sent += len(piece)
        return out

    def _end(self, body: str, closing: str, out: list[DeltaToolCall]) -> str:
        """A call's end: its last deltas, or the whole call, or its text back as content."""
        call = parse_call(body.strip())
        if self._open is None and call is None:
            return START + body + closing  # not a call after all: it stays text
        if self._open is None:  # a call of another head: whole, in one delta
            out += delta_calls([call], self.opened)
            self.opened += 1
        else:
            if call is not None:
                out += self._progress(body, whole=True)
                call = ToolCall(id=self._open.id, function=FunctionCall(name=self._open.name,
                                                                        arguments=call.function.arguments))
            self._open = None
        if call is not None:
            self.calls.append(call)
        return ""


def auto_parser(fmt: str = "hermes") -> HermesParser | WholeOutputParser:
    """The parser of `tool_choice: "auto"` for the model's tool-call format."""
    return HermesParser() if fmt == "hermes" else WholeOutputParser(fmt, _call)


def split_calls(text: str, mode: str, fmt: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, tool calls); content None when only calls were made. `fmt`:
    the model's tool-call format (auto mode; `tool_formats.py`)."""
    if mode in ("named", "required"):
        calls = forced_calls(text, mode)
        return (None, calls) if calls else (text, [])
    if mode != "auto":
        return text, []
    parser = auto_parser(fmt)
    content, _ = parser.feed(text)
    rest, _ = parser.flush()
    content += rest
    if not parser.calls:
        return text, []
    return (content.strip() or None), parser.calls


def delta_calls(calls: list[ToolCall], first_index: int) -> list[DeltaToolCall]:
    """Whole calls as stream deltas (each call in one delta, numbered from `first_index`)."""
    return [DeltaToolCall(index=first_index + i, id=c.id, type="function",
                          function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
            for i, c in enumerate(calls)]
