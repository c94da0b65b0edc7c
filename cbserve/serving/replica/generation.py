"""One request on an engine replica: tokenize, submit to the manager, stream `WorkerEvent`s.

Kept apart from the Serve deployment so it can be tested with any `Manager` (the protocol below). The
request's values are checked by the engine when it is submitted; a refusal is streamed back as
one `error` event carrying the `InvalidRequestError`'s field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cbserve.errors import EngineFault, InvalidRequestError, QueueFullError, RequestFault
from cbserve.outputs import GenerationOutput
from cbserve.serving.api_errors import error_event
from cbserve.serving.chat_template import chat_token_ids, has_think_tags, has_thinking_switch, tool_format
from cbserve.serving.protocol import PromptInfo, TopEntry, WorkerEvent, WorkerRequest
from cbserve.serving.replica.detokenizer import IncrementalDetokenizer, StopStringMatcher

logger = logging.getLogger(__name__)


class Manager(Protocol):
    """What a replica's request path uses of its manager (`cbserve.ContinuousBatchingManager`)."""

    def add_request(self, input_ids: Sequence[int], *, request_id: str, max_new_tokens: int, streaming: bool,
                    eos_token_id: int | list[int] | None, **sampling: Any) -> str:
        """Validate and queue a request; raises InvalidRequestError, QueueFullError or RuntimeError."""

    def async_request_batches(self, request_id: str) -> AsyncIterator[list[GenerationOutput]]:
        """The request's outputs, every one ready at once, the final one last."""

    def cancel_request(self, request_id: str) -> None:
        """Stop the request at the next step and free its pages."""


@dataclass(frozen=True)
class ModelInfo:
    """What the request path needs to know about the loaded model."""

    eos_token_id: int | list[int] | None
    max_context: int  # the longest prompt + output: the model's context or the KV cache, the smaller
    default_max_tokens: int | None  # None: the context the prompt leaves
    grammars: Any = None  # a `constraints.Grammars` for the model: structured outputs (None: refused)


# The model's generation_config.json keys that are a request's sampling defaults (vLLM's list),
# with OpenAI's values where the file sets none.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": None}


def manager_generation_config(model: Any, eos_token_id: Any) -> Any:
    """The served manager's GenerationConfig: sampling (a request that names no sampling field
    samples, as OpenAI's API does) with the defaults the model's own generation_config.json sets
    (only the keys it sets: transformers' class defaults, e.g. top_k 50, are not the model's),
    else OpenAI's."""
    from transformers import GenerationConfig

    gc = getattr(model, "generation_config", None)
    own = gc.to_diff_dict() if gc is not None else {}
    values = {k: own.get(k, default) for k, default in SAMPLING_DEFAULTS.items()}
    return GenerationConfig(eos_token_id=eos_token_id, do_sample=True,
                            **{k: v for k, v in values.items() if v is not None})


def tokenize(tokenizer: Any, req: WorkerRequest) -> list[int]:
    """The prompt's token ids; raises InvalidRequestError("messages", ...) when the chat template
    cannot render the messages."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if req.prompt is not None:
        return list(tokenizer(req.prompt).input_ids)
    if req.reasoning_effort is not None and not has_thinking_switch(tokenizer):
        raise InvalidRequestError("reasoning_effort", "reasoning_effort: this model's chat template has no "
                                  "thinking switch (enable_thinking)")
    return chat_token_ids(tokenizer, req.messages or [], req.tools, template_kwargs=req.template_kwargs)


def reasoning_mode(tokenizer: Any, req: WorkerRequest, prompt_ids: list[int]) -> str:
    """How a chat's output begins for a thinking model's template (`front/reasoning.py`): "open"
    when the rendered prompt ends inside a `<think>` block, "tagged" when the output may open one,
    "off" for a template without one, a completion, or a constrained output (pure JSON)."""
    if req.messages is None or req.constraint is not None or not has_think_tags(tokenizer):
        return "off"
    tail = tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
    return "open" if tail.rfind("<think>") > tail.rfind("</think>") else "tagged"


def max_new_tokens(req: WorkerRequest, prompt_len: int, info: ModelInfo) -> int:
    """The request's max_tokens, else the deployment's default (None: no default), capped by the
    room the prompt leaves in the context, as vLLM does: clients that send a large fixed
    max_tokens get the context left, and `finish_reason` is `length` only where the context or
    their own limit ends the output.

    Checked here rather than by the engine: the cap cannot be chosen without the room, and a
    prompt that leaves none is the prompt's fault (the engine, seeing only prompt + max_new_tokens
    too long, would blame max_new_tokens).
    """
    room = info.max_context - prompt_len
    if req.max_tokens == 0:  # echo / prompt logprobs only: one step is run, its token dropped
        return 1
    if room <= 0:
        raise InvalidRequestError(
            "input_ids",
            f"the prompt's {prompt_len} tokens leave no room to generate in the model's context of "
            f"{info.max_context} tokens",
        )
    wanted = req.max_tokens if req.max_tokens is not None else info.default_max_tokens
    return room if wanted is None else min(wanted, room)


def submit(manager: Manager, tokenizer: Any, info: ModelInfo, req: WorkerRequest,
           grammar: Any = None, prompt_ids: list[int] | None = None) -> tuple[list[int], str]:
    """Queue the request in the manager (`prompt_ids`: its tokens, when already known); returns
    (prompt token ids, request id). Raises InvalidRequestError for a refused request,
    QueueFullError when the engine's waiting queue is full, RuntimeError when the manager is
    stopping."""
    prompt_ids = tokenize(tokenizer, req) if prompt_ids is None else prompt_ids
    if req.pooling is not None:  # an embedding: the prompt alone must fit
        if len(prompt_ids) > info.max_context:
            raise InvalidRequestError("input_ids", f"the input's {len(prompt_ids)} tokens exceed the model's context "
                                      f"of {info.max_context} tokens")
        rid = manager.add_request(prompt_ids, request_id=req.request_id, max_new_tokens=None, streaming=True,
                                  eos_token_id=info.eos_token_id, pooling=req.pooling, **req.sampling.engine_kwargs())
        return prompt_ids, rid
    rid = manager.add_request(
        prompt_ids,
        request_id=req.request_id,
        max_new_tokens=max_new_tokens(req, len(prompt_ids), info),
        streaming=True,
        eos_token_id=info.eos_token_id,
        grammar=grammar,
        logprobs=req.logprobs,  # only a request that returns them has them computed
        **req.sampling.engine_kwargs(),
        **({"resume_tokens": req.resume.token_ids} if req.resume is not None else {}),
    )
    return prompt_ids, rid


def resumed_finish(info: ModelInfo, req: WorkerRequest, prompt_len: int) -> str | None:
    """The finish reason of a continued choice whose output was already complete by its tokens
    (a stop token, or max_tokens), else None (its stop strings: `_Decoder.stopped`)."""
    ids = req.resume.token_ids if req.resume is not None else []
    if not ids:
        return None
    eos = info.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if (ids[-1] in eos_ids and not req.sampling.ignore_eos) or ids[-1] in (req.sampling.stop_token_ids or ()):
        return "stop"
    return "length" if len(ids) >= max_new_tokens(req, prompt_len, info) else None


@functools.lru_cache(maxsize=1 << 17)
def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own (for logprobs); may contain U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_entries(tokenizer: Any, pairs: list[tuple[int, float]]) -> list[TopEntry]:
    return [(t, token_text(tokenizer, t), lp) for t, lp in pairs]


def prompt_info(tokenizer: Any, req: WorkerRequest, prompt_ids: list[int], out: GenerationOutput) -> PromptInfo:
    """What the request asked to get back of its prompt (`echo`, `prompt_logprobs`)."""
    info = PromptInfo(token_ids=list(prompt_ids), token_texts=[token_text(tokenizer, t) for t in prompt_ids])
    if req.echo:
        info.text = req.prompt if req.prompt is not None else tokenizer.decode(
            prompt_ids, skip_special_tokens=req.skip_special_tokens)
    if req.sampling.prompt_logprobs is not None and out.prompt_logprobs is not None:
        info.logprobs = list(out.prompt_logprobs)
        info.top_logprobs = [top_entries(tokenizer, pairs) for pairs in out.prompt_top_logprobs or []]
    return info


class _Decoder:
    """The text of one request's outputs: detokenized incrementally, cut at its stop strings."""

    def __init__(self, tokenizer: Any, req: WorkerRequest, prompt_ids: list[int] | None = None):
        self._tokenizer = tokenizer
        self._req = req
        self._detok = IncrementalDetokenizer(tokenizer, req.skip_special_tokens)
        self._stops = StopStringMatcher(req.stop)
        self._logprobs = req.logprobs
        self.keeps_tokens = req.max_tokens != 0  # max_tokens 0: the one token run is dropped
        # The prompt goes back on the first delta, when asked for (echo, prompt logprobs), unless
        # the choice is continued here (its first replica sent it).
        wants_prompt = prompt_ids is not None and (req.echo or req.sampling.prompt_logprobs is not None)
        self._prompt_ids = prompt_ids if wants_prompt and req.resume is None else None
        # A continued choice: its text so far is decoded again (the detokenizer and stop strings
        # carry on from it), and what the client already has is not sent twice.
        self._unsent_text, self._skip_chars = "", 0
        if req.resume is not None:
            self._unsent_text = self._stops.feed(self._detok.step(list(req.resume.token_ids)))
            self._skip_chars = req.resume.text_chars

    def _feed(self, new: list[int]) -> tuple[list[int], str]:
        """The tokens of an output and their text, cut at a stop string: tokens after the one that
        completed it are dropped too (an output may carry several steps' tokens), so the tokens
        and usage of a choice do not depend on how its outputs were batched."""
        if not new:
            return new, ""
        if not self._req.stop or len(new) == 1:
            return new, self._stops.feed(self._detok.step(new))
        text = ""
        for i, token in enumerate(new):
            text += self._stops.feed(self._detok.step([token]))
            if self._stops.stopped:
                return new[: i + 1], text
        return new, text

    def rest(self) -> str:
        """The text still held back (a continued choice that was already complete)."""
        if self._stops.stopped:
            return self._not_sent_yet("")
        return self._not_sent_yet(self._stops.feed(self._detok.flush()) + self._stops.flush())

    def _not_sent_yet(self, text: str) -> str:
        text, self._unsent_text = self._unsent_text + text, ""
        cut = min(self._skip_chars, len(text))
        self._skip_chars -= cut
        return text[cut:]

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def num_tokens(self) -> int:
        return len(self._detok.ids)

    def _prompt(self, out: GenerationOutput) -> PromptInfo | None:
        """The prompt's info, once: when the prefill has given its logprobs (if asked)."""
        if self._prompt_ids is None:
            return None
        if self._req.sampling.prompt_logprobs is not None and not out.new_tokens and not out.is_finished():
            return None  # still prefilling
        info, self._prompt_ids = prompt_info(self._tokenizer, self._req, self._prompt_ids, out), None
        return info

    def delta(self, out: GenerationOutput) -> WorkerEvent | None:
        """The `delta` event of one output (None when it adds neither tokens, text nor prompt)."""
        prompt = self._prompt(out)
        batch = list(out.new_tokens) if self.keeps_tokens else []
        new, text = self._feed(batch)
        if out.is_finished() and not self._stops.stopped:
            text += self._stops.feed(self._detok.flush())
            text += self._stops.flush()
        text = self._not_sent_yet(text)
        if not (new or text or prompt):
            return None
        top = None
        if self._logprobs and self._req.sampling.top_logprobs and new:
            top = [top_entries(self._tokenizer, pairs) for pairs in (out.top_logprobs or [])[-len(batch):][: len(new)]]
        return WorkerEvent(
            kind="delta",
            text=text,
            token_ids=new,
            logprobs=list(out.new_logprobs or [])[: len(new)] if self._logprobs else None,
            token_texts=[token_text(self._tokenizer, t) for t in new] if self._logprobs else None,
            top_logprobs=top,
            prompt=prompt,
        )


def _last_event(out: GenerationOutput, decoder: _Decoder) -> WorkerEvent:
    """The `end` (or `error`) event of a request's final output."""
    status = getattr(out.status, "value", out.status)
    if status == "failed":
        if isinstance(out.exception, RequestFault):  # its own arguments: the client is told which
            return error_event(400, out.exception.message, out.exception.field)
        logger.warning("request %s failed in the engine: %s", out.request_id, out.error)
        if isinstance(out.exception, EngineFault):  # the replica is unhealthy now: another one can serve it
            return error_event(503, f"{out.exception.public}; retry the request")
        return error_event(500, f"generation failed: {out.error or 'engine error'}")
    if status == "cancelled":
        return WorkerEvent(kind="end", finish_reason="abort", completion_tokens=decoder.num_tokens)
    if out.embedding is not None:
        return WorkerEvent(kind="end", finish_reason="stop", embedding=out.embedding)
    if not decoder.keeps_tokens:
        return WorkerEvent(kind="end", finish_reason="length", completion_tokens=0)
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


def merge_outputs(batch: list[GenerationOutput]) -> GenerationOutput:
    """One output standing for a request's consecutive outputs: the last one, carrying the new
    tokens of them all (its token, logprob and prompt lists are cumulative already)."""
    if len(batch) == 1:
        return batch[0]
    return dataclasses.replace(batch[-1], new_tokens=[t for out in batch for t in out.new_tokens])


async def _stream(manager: Manager, rid: str, decoder: _Decoder, interval_s: float = 0.0) -> AsyncIterator[WorkerEvent]:
    """The `delta`s and the last event of a submitted request, one delta for every output ready
    when the previous one went (so at most one per engine step), and at most one every
    `interval_s` after the first; cancels the request if abandoned."""
    finished = False
    try:
        async with _closing(manager.async_request_batches(rid)) as batches:
            async for batch in batches:
                out = merge_outputs(batch)
                ev = decoder.delta(out)
                if ev is not None:
                    sent = time.monotonic()
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
                if ev is not None and interval_s > 0:  # the outputs of the next steps gather meanwhile
                    await asyncio.sleep(max(0.0, sent + interval_s - time.monotonic()))
    finally:
        if not finished:
            logger.info("request %s abandoned by its caller; cancelling it", rid)
            manager.cancel_request(rid)


async def run_request(
    manager: Manager, tokenizer: Any, info: ModelInfo, req: WorkerRequest, replica: str, interval_s: float = 0.0
) -> AsyncIterator[WorkerEvent]:
    """Yield `start`, `delta`s and one `end` (or a single `error`) for one request; a delta carries
    every token generated since the previous one (`_stream`: `interval_s` paces them).

    If the consumer goes away (the generator is closed or its task cancelled), the request is
    cancelled in the engine, which frees its KV pages.
    """
    try:
        grammar = await _grammar(info, req)
        prompt_ids = tokenize(tokenizer, req)
        decoder = _Decoder(tokenizer, req, prompt_ids)
        # A continued choice may be complete already: its replica was lost after its last token.
        finished = resumed_finish(info, req, len(prompt_ids)) or ("stop" if decoder.stopped else None)
        if finished is None:
            _, rid = submit(manager, tokenizer, info, req, grammar, prompt_ids)
    except InvalidRequestError as exc:
        yield error_event(400, exc.message, exc.field)
        return
    except QueueFullError as exc:  # an overload: the front answers 503 + Retry-After
        yield WorkerEvent(kind="error", status=503, message=f"The server is overloaded: {exc}", code="overloaded")
        return
    except RuntimeError as exc:  # the manager is stopping, or its engine failed (the log says which)
        logger.warning("a request was refused by the manager: %s", exc)
        yield error_event(503, "this worker is not accepting requests (draining or being replaced); retry")
        return
    yield WorkerEvent(kind="start", replica=replica, prompt_tokens=len(prompt_ids),
                      reasoning=reasoning_mode(tokenizer, req, prompt_ids), tool_format=tool_format(tokenizer, req.tools))
    if finished is not None:
        text = decoder.rest()
        if text:
            yield WorkerEvent(kind="delta", text=text)
        yield WorkerEvent(kind="end", finish_reason=finished, completion_tokens=len(req.resume.token_ids))
        return
    async for ev in _stream(manager, rid, decoder, interval_s):
        yield ev


async def _grammar(info: ModelInfo, req: WorkerRequest) -> Any:
    """The request's compiled constraint (in a worker thread), or None."""
    if req.constraint is None:
        return None
    if info.grammars is None:
        raise InvalidRequestError(req.constraint.field, f"{req.constraint.field}: structured outputs are not "
                                  "available on this worker")
    return await info.grammars.compile_in_thread(req.constraint)
