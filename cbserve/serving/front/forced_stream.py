"""Forced tool calls (`tool_choice` "required" or a named function) streamed as OpenAI streams
them: a call's id and name in its first delta, then its arguments' JSON text as it comes.

The output was constrained (`constraints.tool_constraint`) to one call object `{"name": ...,
"arguments": {...}}` (named) or a JSON list of them (required). A scan of the JSON as it comes
(nesting depth, strings) finds each call object and where its arguments' value ends; trailing
whitespace is held back until more of the value follows, so every chunking of the text sends the
same arguments. A call whose keys come in another order goes whole when its object closes.

Cut short (max_tokens, the context), what was sent stays sent, as with OpenAI: a call whose
arguments were cut has streamed them so far. An output where no call was even opened comes back
as content at the end, as the whole reply gives it (`tool_calls.split_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbserve.serving.front.schemas import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from cbserve.serving.front.tool_calls import CALL_HEAD, OpenCall, delta_calls, parse_call

_SPACE = " \t\r\n"


@dataclass
class ForcedCallStream:
    """The streaming parser of a constrained call output; `mode`: "named" or "required"."""

    mode: str
    calls: list[ToolCall] = field(default_factory=list)  # the calls whose objects closed
    opened: int = 0  # calls given a delta index so far
    _text: str = ""
    _depth: int = 0  # of the JSON at the end of `_text`
    _in_string: bool = False
    _escaped: bool = False
    _start: int = -1  # the open call object's `{` in `_text`; -1: none open
    _call: OpenCall | None = None  # the call being streamed (its head was read); `sent`: an offset in `_text`
    _args: int = -1  # where its arguments' value begins
    _args_end: int = -1  # where it ends, once read

    @property
    def _level(self) -> int:
        """The depth just inside a call object."""
        return 1 if self.mode == "named" else 2

    def feed_deltas(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """Add text; returns the content to show now (none: it is all calls) and the deltas."""
        out: list[DeltaToolCall] = []
        at = len(self._text)
        self._text += text
        for i in range(at, len(self._text)):
            self._scan(i, out)
        if self._call is not None:
            out += self._send(self._call, len(self._text) if self._args_end < 0 else self._args_end)
        return "", out

    def flush_deltas(self) -> tuple[str, list[DeltaToolCall]]:
        """The end of the output: the text is content when no call was opened."""
        return ("" if self.opened else self._text), []

    def _scan(self, i: int, out: list[DeltaToolCall]) -> None:
        c = self._text[i]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            return
        inside = self._start >= 0 and self._depth == self._level  # at the call object's own level
        if inside and self._call is None and c not in _SPACE:
            self._read_head(i, out)
        if inside and self._call is not None and self._args_end < 0 and c in ",}" and i > self._args:
            self._args_end = i
        if c == '"':
            self._in_string = True
        elif c in "{[":
            if c == "{" and self._depth == self._level - 1:
                self._start = i
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if c == "}" and self._start >= 0 and self._depth == self._level - 1:
                self._close(i + 1, out)

    def _read_head(self, i: int, out: list[DeltaToolCall]) -> None:
        """At the first character of a value in the call object: the call opens when what came
        before it is the head `{"name": ..., "arguments":`."""
        head = CALL_HEAD.match(self._text, self._start)
        if head is not None and head.end() == i:
            self._call, self._args = OpenCall.read(self.opened, head, i), i
            self.opened += 1
            out.append(self._call.first_delta())

    def _send(self, call: OpenCall, upto: int) -> list[DeltaToolCall]:
        """`call`'s arguments up to `upto` not sent yet, less trailing whitespace."""
        end = self._args + len(self._text[self._args:upto].rstrip())
        if end <= call.sent:
            return []
        piece, call.sent = self._text[call.sent:end], end
        return [DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=piece))]

    def _close(self, end: int, out: list[DeltaToolCall]) -> None:
        """A call object closed at `end`: its last arguments, or the whole call."""
        whole = parse_call(self._text[self._start:end])
        if self._call is not None:
            out += self._send(self._call, self._args_end)
            if whole is not None:
                self.calls.append(ToolCall(id=self._call.id, function=FunctionCall(
                    name=self._call.name, arguments=self._text[self._args:self._call.sent])))
        elif whole is not None:
            out += delta_calls([whole], self.opened)
            self.opened += 1
            self.calls.append(whole)
        self._start, self._call, self._args, self._args_end = -1, None, -1, -1
