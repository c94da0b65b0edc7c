"""One request on a worker replica: tokenize, submit to the manager, stream `WorkerEvent`s.

Kept apart from the Serve deployment so it can be tested with any manager-like object.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cbserve.cluster.detokenizer import IncrementalDetokenizer, StopStringMatcher
from cbserve.cluster.protocol import WorkerEvent, WorkerRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the request path needs to know about the loaded model."""

    eos_token_id: int | list[int] | None
    max_context: int
    vocab_size: int
    default_max_tokens: int


def _error(status: int, message: str, param: str | None = None) -> WorkerEvent:
    return WorkerEvent(kind="error", status=status, message=message, param=param)


def field_of(message: str, req: WorkerRequest) -> str | None:
    """The API field a validation message is about: its messages start with the field's name
    ("prompt: ...", "max_tokens: ...", "temperature must ..."), the engine's in its own words."""
    head = re.match(r"[a-z_]+", message)
    name = head.group(0) if head else ""
    if name in ("prompt", "input_ids", "messages"):
        return "messages" if req.messages is not None else "prompt"
    name = {"max_new_tokens": "max_tokens"}.get(name, name)
    return name if name in WorkerRequest.model_fields and name != "request_id" else None


def tokenize(tokenizer: Any, req: WorkerRequest) -> list[int]:
    """The prompt's token ids; raises ValueError naming the field on bad input."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if req.prompt is not None:
        return list(tokenizer(req.prompt).input_ids)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(
            req.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # jinja errors for roles the template refuses, etc.
        raise ValueError(f"messages: the chat template refused them: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def resolve_max_tokens(req: WorkerRequest, prompt_len: int, info: ModelInfo) -> int:
    room = info.max_context - prompt_len
    if room <= 0:
        raise ValueError(
            f"prompt: {prompt_len} tokens leave no room to generate in the model's context of "
            f"{info.max_context} tokens"
        )
    if req.max_tokens is None:
        return min(info.default_max_tokens, room)
    if req.max_tokens > room:
        raise ValueError(
            f"max_tokens: {req.max_tokens} plus the prompt's {prompt_len} tokens exceed the model's "
            f"context of {info.max_context} tokens (at most {room} here)"
        )
    return req.max_tokens


@contextlib.asynccontextmanager
async def _closing(stream: Any) -> AsyncIterator[Any]:
    """Close an async iterator on exit if it can be closed (async generators can)."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _finish_reason(out: Any) -> str:
    reason = getattr(out.finish_reason, "value", out.finish_reason)
    return "length" if reason == "length" else "stop"


async def run_request(
    manager: Any, tokenizer: Any, info: ModelInfo, req: WorkerRequest, replica: str
) -> AsyncIterator[WorkerEvent]:
    """Yield `start`, `delta`s and one `end` (or a single `error`) for one request.

    If the consumer goes away (the generator is closed or its task cancelled), the request is
    cancelled in the engine, which frees its KV pages.
    """
    try:
        prompt_ids = tokenize(tokenizer, req)
        if not prompt_ids:
            raise ValueError("prompt: empty after tokenization")
        bad = [t for t in prompt_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
        max_new = resolve_max_tokens(req, len(prompt_ids), info)
        rid = manager.add_request(
            prompt_ids,
            request_id=req.request_id,
            max_new_tokens=max_new,
            streaming=True,
            eos_token_id=info.eos_token_id,
            temperature=req.temperature,
            top_k=req.top_k,  # explicit: the generation config's defaults must not apply
            top_p=req.top_p,
            seed=req.seed,
        )
    except ValueError as exc:
        yield _error(400, str(exc), getattr(exc, "param", None) or field_of(str(exc), req))
        return
    except RuntimeError as exc:  # the manager is stopping (replica draining or shutting down)
        yield _error(503, f"this worker is not accepting requests: {exc}")
        return

    yield WorkerEvent(kind="start", replica=replica, prompt_tokens=len(prompt_ids))
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopStringMatcher(req.stop)
    finished = False
    try:
        async with _closing(manager.async_request_iter(rid)) as outputs:
            async for out in outputs:
                new = list(out.new_tokens)
                text = stops.feed(detok.step(new)) if new else ""
                done = out.is_finished()
                if done and not stops.stopped:
                    text += stops.feed(detok.flush())
                    text += stops.flush()
                if new or text:
                    yield WorkerEvent(
                        kind="delta",
                        text=text,
                        token_ids=new,
                        logprobs=list(out.new_logprobs or []) if req.logprobs else None,
                        token_texts=[detok.token_text(t) for t in new] if req.logprobs else None,
                    )
                if stops.stopped:
                    finished = True
                    manager.cancel_request(rid)
                    yield WorkerEvent(kind="end", finish_reason="stop", completion_tokens=len(detok.ids))
                    return
                if done:
                    finished = True
                    status = getattr(out.status, "value", out.status)
                    if status == "failed":
                        logger.warning("request %s failed in the engine: %s", rid, out.error)
                        yield _error(500, f"generation failed: {out.error or 'engine error'}")
                    elif status == "cancelled":
                        yield WorkerEvent(kind="end", finish_reason="abort", completion_tokens=len(detok.ids))
                    else:
                        yield WorkerEvent(
                            kind="end", finish_reason=_finish_reason(out), completion_tokens=len(out.generated_tokens)
                        )
                    return
    finally:
        if not finished:
            logger.info("request %s abandoned by its caller; cancelling it", rid)
            manager.cancel_request(rid)
