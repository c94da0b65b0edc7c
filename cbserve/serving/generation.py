"""One request on an engine replica: tokenize, submit to the manager, stream `WorkerEvent`s.

Kept apart from the Serve deployment so it can be tested with any manager-like object. The
request's values are checked by the engine when it is submitted; a refusal is streamed back as
one `error` event carrying the `InvalidRequestError`'s field.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.serving.detokenizer import IncrementalDetokenizer, StopStringMatcher
from cbserve.serving.errors import error_event
from cbserve.serving.protocol import WorkerEvent, WorkerRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the request path needs to know about the loaded model."""

    eos_token_id: int | list[int] | None
    max_context: int
    default_max_tokens: int


def tokenize(tokenizer: Any, req: WorkerRequest) -> list[int]:
    """The prompt's token ids; raises InvalidRequestError("messages", ...) when the chat template
    cannot render the messages."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if req.prompt is not None:
        return list(tokenizer(req.prompt).input_ids)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("messages", "messages: this model has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(
            req.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # jinja errors for roles the template refuses, etc.
        raise InvalidRequestError("messages", f"messages: the chat template refused them: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def max_new_tokens(req: WorkerRequest, prompt_len: int, info: ModelInfo) -> int:
    """The request's max_tokens, else the deployment's default capped by the room the prompt leaves.

    Checked here rather than by the engine: the default cannot be chosen without the room, and a
    prompt that leaves none is the prompt's fault (the engine, seeing only prompt + max_new_tokens
    too long, would blame max_new_tokens). Whether an explicit max_tokens fits is the engine's rule.
    """
    room = info.max_context - prompt_len
    if room <= 0:
        raise InvalidRequestError(
            "input_ids",
            f"the prompt's {prompt_len} tokens leave no room to generate in the model's context of "
            f"{info.max_context} tokens",
        )
    return min(info.default_max_tokens, room) if req.max_tokens is None else req.max_tokens


def submit(manager: Any, tokenizer: Any, info: ModelInfo, req: WorkerRequest) -> tuple[int, str]:
    """Queue the request in the manager; returns (prompt tokens, request id). Raises
    InvalidRequestError for a refused request, RuntimeError when the manager is stopping."""
    prompt_ids = tokenize(tokenizer, req)
    rid = manager.add_request(
        prompt_ids,
        request_id=req.request_id,
        max_new_tokens=max_new_tokens(req, len(prompt_ids), info),
        streaming=True,
        eos_token_id=info.eos_token_id,
        temperature=req.temperature,
        top_k=req.top_k,  # explicit: the generation config's defaults must not apply
        top_p=req.top_p,
        seed=req.seed,
    )
    return len(prompt_ids), rid


class _Decoder:
    """The text of one request's outputs: detokenized incrementally, cut at its stop strings."""

    def __init__(self, tokenizer: Any, req: WorkerRequest):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(req.stop)
        self._logprobs = req.logprobs

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def num_tokens(self) -> int:
        return len(self._detok.ids)

    def delta(self, out: Any) -> WorkerEvent | None:
        """The `delta` event of one output (None when it adds neither tokens nor text)."""
        new = list(out.new_tokens)
        text = self._stops.feed(self._detok.step(new)) if new else ""
        if out.is_finished() and not self._stops.stopped:
            text += self._stops.feed(self._detok.flush())
            text += self._stops.flush()
        if not (new or text):
            return None
        return WorkerEvent(
            kind="delta",
            text=text,
            token_ids=new,
            logprobs=list(out.new_logprobs or []) if self._logprobs else None,
            token_texts=[self._detok.token_text(t) for t in new] if self._logprobs else None,
        )


def _last_event(out: Any, decoder: _Decoder) -> WorkerEvent:
    """The `end` (or `error`) event of a request's final output."""
    status = getattr(out.status, "value", out.status)
    if status == "failed":
        logger.warning("request %s failed in the engine: %s", out.request_id, out.error)
        return error_event(500, f"generation failed: {out.error or 'engine error'}")
    if status == "cancelled":
        return WorkerEvent(kind="end", finish_reason="abort", completion_tokens=decoder.num_tokens)
    reason = getattr(out.finish_reason, "value", out.finish_reason)
    return WorkerEvent(kind="end", finish_reason="length" if reason == "length" else "stop",
                       completion_tokens=len(out.generated_tokens))


@contextlib.asynccontextmanager
async def _closing(stream: Any) -> AsyncIterator[Any]:
    """Close an async iterator on exit if it can be closed (async generators can)."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def _stream(manager: Any, rid: str, decoder: _Decoder) -> AsyncIterator[WorkerEvent]:
    """The `delta`s and the last event of a submitted request; cancels it if abandoned."""
    finished = False
    try:
        async with _closing(manager.async_request_iter(rid)) as outputs:
            async for out in outputs:
                ev = decoder.delta(out)
                if ev is not None:
                    yield ev
                if decoder.stopped:
                    finished = True
                    manager.cancel_request(rid)
                    yield WorkerEvent(kind="end", finish_reason="stop", completion_tokens=decoder.num_tokens)
                    return
                if out.is_finished():
                    finished = True
                    yield _last_event(out, decoder)
                    return
    finally:
        if not finished:
            logger.info("request %s abandoned by its caller; cancelling it", rid)
            manager.cancel_request(rid)


async def run_request(
    manager: Any, tokenizer: Any, info: ModelInfo, req: WorkerRequest, replica: str
) -> AsyncIterator[WorkerEvent]:
    """Yield `start`, `delta`s and one `end` (or a single `error`) for one request.

    If the consumer goes away (the generator is closed or its task cancelled), the request is
    cancelled in the engine, which frees its KV pages.
    """
    try:
        prompt_tokens, rid = submit(manager, tokenizer, info, req)
    except InvalidRequestError as exc:
        yield error_event(400, exc.message, exc.field)
        return
    except RuntimeError as exc:  # the manager is stopping (replica draining or shutting down)
        yield error_event(503, f"this worker is not accepting requests: {exc}")
        return
    yield WorkerEvent(kind="start", replica=replica, prompt_tokens=prompt_tokens)
    async for ev in _stream(manager, rid, _Decoder(tokenizer, req)):
        yield ev
