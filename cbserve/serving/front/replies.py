"""The one fold of a choice's `WorkerEvent`s into its reply, and the reply's OpenAI renderings.

Every front folds a choice's events with `ChoiceResult.add`: the non-streaming JSON response and
the batch job render the whole result; server-sent events and gRPC render each `Piece` as it is
added. Errors are folded the same way everywhere: an `error` event, an `end` that aborted (the
server cancelled the request) and a stream that stops before its end all leave `result.error`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import ABORTED, CUT_SHORT, APIError, error_event, refusal
from cbserve.serving.front.schemas import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionChoice,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    UsageInfo,
)
from cbserve.serving.protocol import PromptInfo, TopEntry, WorkerEvent

logger = logging.getLogger(__name__)


@dataclass
class ChoiceStream:
    """A choice the worker accepted: its `start` event, the rest of its events, and a cancel."""

    start: WorkerEvent
    events: AsyncIterator[WorkerEvent]
    cancel: Callable[[], None]
    lora: str | None = None  # the LoRA adapter it runs with (per-adapter metrics)


@dataclass
class Piece:
    """What one event adds to a choice: a delta's text and tokens, or (last) its finish."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top_logprobs: list[list[TopEntry]] = field(default_factory=list)
    prompt: PromptInfo | None = None  # on the first delta, when echo or prompt logprobs were asked for
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class ChoiceResult(Piece):
    """A choice so far: the sum of its pieces, who served it, and how it ended."""

    replica: str = ""
    prompt_tokens: int = 0
    reasoning: str = "off"  # the start event's: how a thinking model's output begins
    tool_format: str = "hermes"  # the start event's: how the model writes tool calls
    embedding: list[float] | None = None  # the end event's, of an embedding request
    error: WorkerEvent | None = None  # an `error` event; an abort or a cut stream becomes one too
    timer: Any = field(default=None, repr=False, compare=False)  # a metrics.ChoiceTimer

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def add(self, ev: WorkerEvent) -> Piece | None:
        """Fold one event in; returns what it adds to the reply (None for `start` and errors)."""
        if ev.kind == "start":
            self.replica, self.prompt_tokens, self.reasoning = ev.replica or "", ev.prompt_tokens, ev.reasoning
            self.tool_format = ev.tool_format
            return None
        if ev.kind == "delta":
            piece = Piece(text=ev.text, token_ids=list(ev.token_ids), logprobs=list(ev.logprobs or []),
                          token_texts=list(ev.token_texts or []), top_logprobs=list(ev.top_logprobs or []),
                          prompt=ev.prompt)
            self.text += piece.text
            self.token_ids += piece.token_ids
            self.logprobs += piece.logprobs
            self.token_texts += piece.token_texts
            self.top_logprobs += piece.top_logprobs
            self.prompt = self.prompt or piece.prompt
            if self.timer is not None:
                self.timer.on_tokens(len(piece.token_ids))
            return piece
        if ev.kind == "end" and ev.finish_reason != "abort":
            self.finish_reason, self.completion_tokens = ev.finish_reason or "stop", ev.completion_tokens
            self.embedding = ev.embedding
            if self.timer is not None:
                self.timer.on_end(self.finish_reason)
            return Piece(finish_reason=self.finish_reason, completion_tokens=self.completion_tokens)
        self.error = ev if ev.kind == "error" else error_event(503, ABORTED)
        return None

    def cut_short(self) -> None:
        """The events stopped before the end: never let that look like a finished choice."""
        if not self.done:
            self.error = error_event(503, CUT_SHORT)

    def failure(self) -> InvalidRequestError | APIError | None:
        return None if self.error is None else refusal(self.error)


def worker_failure(exc: Exception) -> Exception:
    """An exception from a choice's event stream (other than a folded error) as the client should
    see it: the worker replica died or became unreachable mid-request (Ray raises
    `ActorDiedError`, `ActorUnavailableError`, ...). A 503, never a clean-looking end."""
    if isinstance(exc, APIError | InvalidRequestError):
        return exc
    logger.warning("a worker failed mid-request: %r", exc)
    return APIError(503, f"the worker serving this request failed before the request finished "
                         f"({type(exc).__name__}); retry it")


async def fold(events: AsyncIterator[WorkerEvent], result: ChoiceResult | None = None) -> ChoiceResult:
    """Fold a choice's events until its end or error (which stays in `result.error`)."""
    result = ChoiceResult() if result is None else result
    async for ev in events:
        result.add(ev)
        if result.done:
            return result
    result.cut_short()
    return result


async def pieces(events: AsyncIterator[WorkerEvent], result: ChoiceResult) -> AsyncIterator[Piece]:
    """Fold a choice's events into `result`, yielding what each adds; raises the choice's failure
    (`InvalidRequestError` or `APIError`) instead of ending when it did not finish."""
    try:
        async for ev in events:
            piece = result.add(ev)
            if result.error is not None:
                break
            if piece is not None:
                yield piece
            if result.done:
                return
    except Exception as exc:
        raise worker_failure(exc) from exc
    result.cut_short()
    raise result.failure()  # type: ignore[misc]


# ---- OpenAI renderings --------------------------------------------------------------------------


def usage(prompt_tokens: int, results: list[Piece] | list[ChoiceResult]) -> UsageInfo:
    completion = sum(r.completion_tokens for r in results)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def _top_dict(entries: list[TopEntry], k: int, token: str, logprob: float) -> dict[str, float]:
    """vLLM's completions `top_logprobs` entry: the k most likely tokens and the chosen one, keyed
    by text (of tokens that decode alike, the most likely one stays)."""
    top: dict[str, float] = {}
    for _, text, lp in entries[:k]:
        top.setdefault(text, lp)
    top.setdefault(token, logprob)
    return top


def _prompt_part(prompt: PromptInfo | None, k: int) -> tuple[list[str], list[float | None], list[Any]]:
    """The echoed prompt's tokens, logprobs (None first) and top entries."""
    if prompt is None or prompt.logprobs is None:
        return [], [], []
    tops: list[Any] = [None]
    for i in range(1, len(prompt.token_ids)):
        entries = prompt.top_logprobs[i] if prompt.top_logprobs and i < len(prompt.top_logprobs) else []
        tops.append(_top_dict(entries, k, prompt.token_texts[i], prompt.logprobs[i]))  # type: ignore[arg-type]
    return list(prompt.token_texts), list(prompt.logprobs), tops


def completion_logprobs(p: Piece, k: int, echo: bool = False, offset: int = 0) -> CompletionLogprobs:
    """Legacy completions logprobs: with `echo`, the prompt's tokens first (the first one's None)."""
    tokens, values, tops = _prompt_part(p.prompt, k) if echo else ([], [], [])
    tokens += p.token_texts
    values += p.logprobs
    tops += [_top_dict(p.top_logprobs[i] if i < len(p.top_logprobs) else [], k, t, lp)
             for i, (t, lp) in enumerate(zip(p.token_texts, p.logprobs))]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def prompt_logprobs(prompt: PromptInfo | None, k: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per position, the prompt's token and the k most likely ones."""
    if k is None or prompt is None or prompt.logprobs is None:
        return None
    out: PromptLogprobs = [None]
    for i in range(1, len(prompt.token_ids)):
        entries = prompt.top_logprobs[i][:k] if prompt.top_logprobs and i < len(prompt.top_logprobs) else []
        at = {str(t): PromptLogprob(logprob=lp, rank=r + 1, decoded_token=text)
              for r, (t, text, lp) in enumerate(entries)}
        token = str(prompt.token_ids[i])
        if token not in at:
            at[token] = PromptLogprob(logprob=prompt.logprobs[i], rank=None,  # type: ignore[arg-type]
                                      decoded_token=prompt.token_texts[i])
        out.append(at)
    return out


def chat_logprobs(p: Piece, top_logprobs: int | None) -> ChatLogprobs:
    content = []
    k = top_logprobs or 0
    for i, (t, lp) in enumerate(zip(p.token_texts, p.logprobs)):
        entries = p.top_logprobs[i][:k] if i < len(p.top_logprobs) else []
        top = [TopLogprob(token=text, logprob=v, bytes=list(text.encode())) for _, text, v in entries]
        content.append(ChatLogprobToken(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_choice(index: int, p: Piece, logprobs: int | None, echo: bool = False,
                      prompt_k: int | None = None) -> CompletionChoice:
    """A whole choice, or a streamed delta or finish (`logprobs`: None when not asked for). With
    `echo` the prompt (carried by the choice's first piece) leads its text and logprobs."""
    lead = (p.prompt.text or "") if echo and p.prompt is not None else ""
    lp = completion_logprobs(p, logprobs, echo) if logprobs is not None else None
    return CompletionChoice(index=index, text=lead + p.text, finish_reason=p.finish_reason,  # type: ignore[arg-type]
                            logprobs=lp, prompt_logprobs=prompt_logprobs(p.prompt, prompt_k))


def completion_chunk_choice(index: int, p: Piece, logprobs: int | None, echo: bool = False,
                            prompt_k: int | None = None) -> CompletionChoice | None:
    """A streamed piece as a chunk's choice; None for a delta with nothing to show."""
    if p.finish_reason is not None:
        return completion_choice(index, Piece(finish_reason=p.finish_reason), None)
    if p.text or logprobs is not None or p.prompt is not None:
        return completion_choice(index, p, logprobs, echo, prompt_k)
    return None
