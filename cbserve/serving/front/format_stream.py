"""The streaming parser of `tool_choice: "auto"` for each tool-call format (`tool_formats.py`),
in OpenAI's deltas: a call's id and name as soon as they are written, then its arguments' JSON
text as it comes.

- `hermes`: `tool_calls.HermesStreamParser`;
- `mistral` and `llama3_json` (`JsonFormatStream`): content streams until the format's opener
  (`[TOOL_CALLS]`; a `{` or `<|python_tag|>` at the output's start), the rest is scanned as
  the constrained outputs are (`forced_stream.ForcedCallStream`: a JSON list of call objects for
  Mistral, call objects one after another for Llama 3). Text that opened no call comes back as
  content at the end; once streamed, a call stays a call;
- `pythonic`: a Python list of calls is only known to be one when the output ends: whole calls
  then (`tool_formats.WholeOutputParser`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cbserve.serving.front.forced_stream import ForcedCallStream
from cbserve.serving.front.schemas import DeltaToolCall, ToolCall
from cbserve.serving.front.tool_calls import HermesStreamParser, _call
from cbserve.serving.front.tool_formats import MISTRAL_TAG, PYTHON_TAG, WholeOutputParser, may_be_call


@dataclass
class JsonFormatStream:
    """`tool_choice: "auto"` streamed for the Mistral and Llama 3 JSON formats."""

    fmt: str
    _held: str = ""  # text not shown yet: the opener and what followed it, or what may begin it
    _calls: ForcedCallStream | None = None  # once the opener was read
    _content_only: bool = False  # llama3_json: the output began with content, so it holds no call

    @property
    def opened(self) -> int:
        return self._calls.opened if self._calls is not None else 0

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls.calls if self._calls is not None else []

    def feed_deltas(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """Add text; returns the content that may be shown now and the call deltas."""
        if self._content_only:
            return text, []
        if self._calls is not None:
            self._held += text
            return "", self._calls.feed_deltas(text)[1]
        self._held += text
        at = may_be_call(self.fmt, self._held)
        if at < 0:  # no opener, nor the start of one
            self._content_only = self.fmt == "llama3_json"
            shown, self._held = self._held, ""
            return shown, []
        shown, self._held = self._held[:at], self._held[at:]
        body = self._body()
        if not body:  # the opener is not whole yet, or nothing follows it
            return shown, []
        # Calls as a JSON list (Mistral's, mostly) or objects one after another.
        self._calls = ForcedCallStream("required" if body.startswith("[") else "named")
        return shown, self._calls.feed_deltas(body)[1]

    def _body(self) -> str | None:
        """The text after the opener from its first character that is not a space, once the held
        text holds a whole opener (None: not yet)."""
        head = self._held.lstrip()
        if self.fmt == "mistral":
            return head[len(MISTRAL_TAG):].lstrip() if head.startswith(MISTRAL_TAG) else None
        if head.startswith(PYTHON_TAG):
            return head[len(PYTHON_TAG):].lstrip()
        return head if head.startswith("{") else None  # else whitespace, or part of the python tag

    def flush_deltas(self) -> tuple[str, list[DeltaToolCall]]:
        """The end of the output: held text that opened no call is content."""
        held, self._held = self._held, ""
        return ("" if self.opened else held), []


def stream_parser(fmt: str = "hermes") -> HermesStreamParser | JsonFormatStream | WholeOutputParser:
    """The streaming parser of `tool_choice: "auto"` for the model's tool-call format."""
    if fmt == "hermes":
        return HermesStreamParser()
    if fmt in ("mistral", "llama3_json"):
        return JsonFormatStream(fmt)
    return WholeOutputParser(fmt, _call)
