"""Tool calls written in the other common formats (`tool_choice: "auto"`), besides Hermes'
`<tool_call>` blocks (`tool_calls.py`). The replica reads the format off the chat template
(`chat_template.tool_format`) and sends it on the choice's `start` event:

- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content;
- `llama3_json`: the whole output one or more `{"name": ..., "parameters": {...}}` objects
  (separated by `;` or new lines), optionally after `<|python_tag|>` (Llama 3.1 / 3.2);
- `pythonic`: the whole output a Python list of calls, `[get_weather(city="paris"), ...]` (Llama 4).

A whole output is parsed here (`PARSERS`); streamed, Mistral and Llama 3 JSON calls' arguments
go out as they come (`format_stream.py`), while a pythonic list is only known to be calls when the
output ends: `WholeOutputParser` streams content as it comes until the output could be a call, and
holds it from there; the calls (or the held text, when it is not a call after all) come at the end.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any

from cbserve.serving.front.schemas import ToolCall
from cbserve.serving.front.stream_tags import partial_tail

MISTRAL_TAG, PYTHON_TAG = "[TOOL_CALLS]", "<|python_tag|>"


def _calls(objects: list[Any], make: Any) -> list[ToolCall] | None:
    calls = [make(o) for o in objects]
    return calls if calls and all(calls) else None


def parse_mistral(text: str, make: Any) -> tuple[str | None, list[ToolCall]]:
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return text, []
    try:
        objects = json.loads(text[at + len(MISTRAL_TAG):])
    except ValueError:
        return text, []
    calls = _calls(objects if isinstance(objects, list) else [objects], make)
    return (text, []) if calls is None else (text[:at].strip() or None, calls)


def parse_llama3_json(text: str, make: Any) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, objects, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        objects.append(obj)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    calls = _calls(objects, make)
    return (text, []) if calls is None else (None, calls)


def parse_pythonic(text: str, make: Any) -> tuple[str | None, list[ToolCall]]:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                                                     and not c.args for c in tree.elts):
            return text, []
        objects = [{"name": c.func.id, "arguments": {k.arg: ast.literal_eval(k.value) for k in c.keywords}}
                   for c in tree.elts]
    except (SyntaxError, ValueError, TypeError):
        return text, []
    calls = _calls(objects, make)
    return (text, []) if calls is None else (None, calls)


PARSERS = {"mistral": parse_mistral, "llama3_json": parse_llama3_json, "pythonic": parse_pythonic}


def may_be_call(fmt: str, text: str) -> int:
    """Where in `text` (streamed so far) a call of format `fmt` could begin; -1: nowhere yet."""
    if fmt == "mistral":
        at = text.find(MISTRAL_TAG)
        if at >= 0:
            return at
        tail = partial_tail(text, MISTRAL_TAG)
        return len(text) - tail if tail else -1
    head = text.lstrip()
    if not head:
        return 0  # only whitespace: undecided
    openers = ("{", PYTHON_TAG) if fmt == "llama3_json" else ("[",)
    return 0 if any(head.startswith(o) or o.startswith(head) for o in openers) else -1


@dataclass
class WholeOutputParser:
    """Streams content until the output could be a call of `fmt`; parses what it held at the end."""

    fmt: str
    make: Any  # dict -> ToolCall | None (tool_calls._call)
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _decided: bool = False  # the output is content only: nothing is held any more

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._decided:
            return text, []
        self._held += text
        at = may_be_call(self.fmt, self._held)
        if at < 0:
            self._decided = self.fmt != "mistral"  # a Mistral call may still follow content
            out, self._held = self._held, ""
            return out, []
        out, self._held = self._held[:at], self._held[at:]
        return out, []

    def flush(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not held:
            return "", []
        content, calls = PARSERS[self.fmt](held, self.make)
        self.calls += calls
        return content or "", calls
