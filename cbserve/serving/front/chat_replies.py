"""A chat choice as OpenAI renders it: its message or its stream of deltas, tool calls included.

`ChatRendering` holds what a chat request asked for (logprobs, top logprobs, the tool-choice
mode); `choice` renders a whole folded choice, `ChatStream` one choice's pieces as they come.
With tools (`tool_calls.py`), text that makes up a call leaves the content and comes back as
`tool_calls`, and the choice finishes with `"tool_calls"`. A thinking model's `<think>` block
leaves the content first and comes back as `reasoning_content` (`reasoning.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbserve.serving.front.forced_stream import ForcedCallStream
from cbserve.serving.front.format_stream import JsonFormatStream, stream_parser
from cbserve.serving.front.reasoning import ThinkSplitter, split_reasoning
from cbserve.serving.front.replies import ChoiceResult, Piece, chat_logprobs
from cbserve.serving.front.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    DeltaMessage,
    DeltaToolCall,
)
from cbserve.serving.front.tool_calls import HermesStreamParser, delta_calls, split_calls
from cbserve.serving.front.tool_formats import WholeOutputParser


@dataclass(frozen=True)
class ChatRendering:
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_mode: str = "none"  # none, auto, required, named (constraints.tool_choice_mode)

    def choice(self, index: int, r: ChoiceResult) -> ChatChoice:
        reasoning, text = split_reasoning(r.text, r.reasoning)
        content, calls = split_calls(text, self.tool_mode, r.tool_format)
        finish = "tool_calls" if calls and r.finish_reason != "length" else r.finish_reason  # cut short: said
        lp = chat_logprobs(r, self.top_logprobs) if self.logprobs else None
        message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
        return ChatChoice(index=index, message=message, finish_reason=finish, logprobs=lp)  # type: ignore[arg-type]

    def stream(self, index: int, reasoning: str = "off", tool_format: str = "hermes") -> ChatStream:
        """One choice's chunks; `reasoning`, `tool_format`: its start event's (how a thinking
        model's output begins, how the model writes tool calls)."""
        splitter = None if reasoning == "off" else ThinkSplitter(inside=reasoning == "open")
        forced = self.tool_mode in ("named", "required")
        return ChatStream(self, index, splitter, ForcedCallStream(self.tool_mode) if forced else stream_parser(tool_format))


@dataclass
class ChatStream:
    """One choice's chunks: content as it comes (held while it may be a call); calls' arguments as
    they come (forced, Hermes, Mistral, Llama 3 JSON), pythonic calls whole."""

    rendering: ChatRendering
    index: int
    splitter: ThinkSplitter | None = None  # a thinking model's: reasoning out of the text first
    _parser: ForcedCallStream | HermesStreamParser | JsonFormatStream | WholeOutputParser = field(
        default_factory=HermesStreamParser)
    _calls: int = 0

    def chunks(self, p: Piece) -> list[ChatChunkChoice]:
        if p.finish_reason is not None:
            return self._finish(p)
        reasoning, text = self.splitter.feed(p.text) if self.splitter is not None else ("", p.text)
        return self._delta(p, *self._content(text), reasoning)

    def _content(self, text: str) -> tuple[str, list]:
        """The content to show now and the calls completed (tools take their text out)."""
        if self.rendering.tool_mode == "none":
            return text, []
        if isinstance(self._parser, WholeOutputParser):
            return self._parser.feed(text)
        return self._parser.feed_deltas(text)

    def _delta(self, p: Piece, text: str, calls: list, reasoning: str = "") -> list[ChatChunkChoice]:
        """`calls`: whole ToolCalls (numbered here) or a stream parser's deltas (numbered there)."""
        out = []
        lp = chat_logprobs(p, self.rendering.top_logprobs) if self.rendering.logprobs and p.token_ids else None
        if reasoning:  # the piece's logprobs ride on its first chunk
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(reasoning_content=reasoning), logprobs=lp))
            lp = None
        if text or lp is not None:
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=text), logprobs=lp))
        if calls and isinstance(calls[0], DeltaToolCall):
            out += [ChatChunkChoice(index=self.index, delta=DeltaMessage(tool_calls=[d])) for d in calls]
            self._calls = self._parser.opened  # type: ignore[union-attr]
        elif calls:
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(tool_calls=delta_calls(calls, self._calls))))
            self._calls += len(calls)
        return out

    def _finish(self, p: Piece) -> list[ChatChunkChoice]:
        reasoning, held = self.splitter.flush() if self.splitter is not None else ("", "")
        text, calls = self._content(held)  # what the splitter held back, through the tools' parsing
        if self.rendering.tool_mode != "none":
            whole = isinstance(self._parser, WholeOutputParser)
            rest, more = self._parser.flush() if whole else self._parser.flush_deltas()  # type: ignore[union-attr]
            text, calls = text + rest, calls + more
        out = self._delta(Piece(), text if not (self._calls or calls) or text.strip() else "", calls, reasoning)
        finish = "tool_calls" if self._calls and p.finish_reason != "length" else p.finish_reason
        out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(), finish_reason=finish))  # type: ignore[arg-type]
        return out
