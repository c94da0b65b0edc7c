"""The OpenAI completions and chat-completions logic, free of HTTP and of Ray.

It turns a validated request into one `WorkerRequest` per choice, opens each choice's stream
through `open_choice` (in the cluster: a streaming call to a worker replica), and assembles
either a whole response or server-sent events. Opening a choice returns once the worker has
accepted it, so a bad request still gets a 4xx before any event is streamed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cbserve.cluster.errors import APIError
from cbserve.cluster.metrics import ChoiceTimer, ServingMetrics
from cbserve.cluster.prefix import chat_routing_text, prefix_hashes
from cbserve.cluster.protocol import WorkerEvent, WorkerRequest
from cbserve.cluster.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    _new_id,
)
from cbserve.cluster.settings import ClusterArgs

logger = logging.getLogger(__name__)


@dataclass
class ChoiceStream:
    """A choice the worker accepted: its `start` event, the rest of its events, and a cancel."""

    start: WorkerEvent
    events: AsyncIterator[WorkerEvent]
    cancel: Callable[[], None]


OpenChoice = Callable[[WorkerRequest], Awaitable[ChoiceStream]]


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0

    def add(self, ev: WorkerEvent) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs or []
        self.token_texts += ev.token_texts or []


@dataclass
class Reply:
    """Either a whole `body` or an SSE `stream`; `replicas` served the choices (for a header)."""

    replicas: list[str]
    body: Any = None
    stream: AsyncIterator[str] | None = None


def _sse(obj: Any) -> str:
    payload = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {payload}\n\n"


def _worker_failure(exc: Exception) -> APIError:
    """An exception from a choice's event stream (other than an error event) as the client
    should see it: the worker replica died or became unreachable mid-request (Ray raises
    `ActorDiedError`, `ActorUnavailableError`, ...). A 503 in OpenAI's shape, never a
    clean-looking end of the stream."""
    if isinstance(exc, APIError):
        return exc
    logger.warning("a worker failed mid-request: %r", exc)
    return APIError(503, f"the worker serving this request failed before it finished ({type(exc).__name__}); "
                         "retry the request")


def _end_error(ev: WorkerEvent) -> APIError | None:
    if ev.kind == "error":
        return APIError(ev.status or 500, ev.message, ev.param)
    if ev.kind == "end" and ev.finish_reason == "abort":
        return APIError(503, "the request was cancelled by the server (a worker is shutting down); retry it")
    return None


class OpenAIService:
    def __init__(self, args: ClusterArgs, open_choice: OpenChoice, metrics: ServingMetrics | None = None):
        self.args = args
        self._open_choice = open_choice
        self.metrics = metrics
        self.model_name = args.model_name
        self._names = {args.model_name} | ({args.model} if args.model else set())

    # -- request -> worker requests -------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self._names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def _check_common(self, req: SamplingFields, max_tokens: int | None, num_prompts: int) -> None:
        limits = self.args.limits
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise APIError(400, f"max_tokens must be at most {limits.max_tokens}, got {max_tokens}", "max_tokens")
        if req.n > limits.max_n:
            raise APIError(400, f"n must be at most {limits.max_n}, got {req.n}", "n")
        if num_prompts > limits.max_prompts:
            raise APIError(400, f"at most {limits.max_prompts} prompts per request, got {num_prompts}", "prompt")
        if len(req.stop_list()) > limits.max_stop:
            raise APIError(400, f"at most {limits.max_stop} stop strings, got {len(req.stop_list())}", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported by this server; leave it at 0", name)

    def routing_hashes(self, routing_key: str | list[int]) -> list[int]:
        r = self.args.routing
        chunk = r.chunk_chars if isinstance(routing_key, str) else r.chunk_tokens
        return prefix_hashes(routing_key, chunk, r.max_chunks)

    def _worker_request(
        self, req: SamplingFields, rid: str, choice: int, max_tokens: int | None, logprobs: bool, **prompt: Any
    ) -> WorkerRequest:
        gen = self.args.generation
        return WorkerRequest(
            request_id=rid,
            max_tokens=max_tokens,
            temperature=gen.temperature if req.temperature is None else req.temperature,
            top_p=gen.top_p if req.top_p is None else req.top_p,
            top_k=gen.top_k if req.top_k is None else req.top_k,
            seed=None if req.seed is None else req.seed + choice,
            stop=req.stop_list(),
            logprobs=logprobs,
            **prompt,
        )

    def completion_requests(self, req: CompletionRequest, rid: str) -> list[WorkerRequest]:
        self.check_model(req.model)
        prompts = req.prompts()
        self._check_common(req, req.max_tokens, len(prompts))
        for name, bad in (("echo", req.echo), ("suffix", req.suffix), ("best_of", (req.best_of or 1) > 1)):
            if bad:
                raise APIError(400, f"{name} is not supported by this server", name)
        if (req.logprobs or 0) > 1:
            raise APIError(400, "logprobs must be 0 or 1: only the sampled token's logprob is available",
                           "logprobs")
        out = []
        for p_idx, prompt in enumerate(prompts):
            key = "prompt" if isinstance(prompt, str) else "prompt_ids"
            if isinstance(prompt, str) and not prompt:
                raise APIError(400, "prompt must not be empty", "prompt")
            hashes = self.routing_hashes(prompt)
            for c in range(req.n):
                out.append(
                    self._worker_request(
                        req, f"{rid}-{p_idx}-{c}", c, req.max_tokens, req.logprobs is not None,
                        prefix_hashes=hashes, **{key: prompt},
                    )
                )
        return out

    def chat_requests(self, req: ChatCompletionRequest, rid: str) -> list[WorkerRequest]:
        self.check_model(req.model)
        max_tokens = req.max_completion_tokens or req.max_tokens
        self._check_common(req, max_tokens, 1)
        if (req.top_logprobs or 0) > 1:
            raise APIError(400, "top_logprobs must be 0 or 1: only the sampled token's logprob is available",
                           "top_logprobs")
        messages = req.template_messages()
        hashes = self.routing_hashes(chat_routing_text(messages))
        return [
            self._worker_request(req, f"{rid}-{c}", c, max_tokens, req.logprobs, messages=messages,
                                 prefix_hashes=hashes)
            for c in range(req.n)
        ]

    # -- running choices ------------------------------------------------------------------------

    async def _open_all(self, wreqs: list[WorkerRequest]) -> list[ChoiceStream]:
        results = await asyncio.gather(*(self._open_choice(w) for w in wreqs), return_exceptions=True)
        streams = [r for r in results if isinstance(r, ChoiceStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s in streams:
                s.cancel()
            api_errors = [e for e in errors if isinstance(e, APIError)]
            raise (min(api_errors, key=lambda e: e.status) if api_errors else errors[0])
        return streams

    def _timer(self, arrival: float, stream: ChoiceStream) -> ChoiceTimer | None:
        return self.metrics.timer(arrival, stream.start.prompt_tokens) if self.metrics else None

    async def _collect(self, stream: ChoiceStream, arrival: float) -> ChoiceResult:
        try:
            return await self._collect_events(stream, arrival)
        except Exception as exc:  # APIErrors pass through unchanged
            raise _worker_failure(exc) from exc

    async def _collect_events(self, stream: ChoiceStream, arrival: float) -> ChoiceResult:
        result, timer = ChoiceResult(), self._timer(arrival, stream)
        async for ev in stream.events:
            error = _end_error(ev)
            if error is not None:
                raise error
            if ev.kind == "delta":
                result.add(ev)
                if timer:
                    timer.on_tokens(len(ev.token_ids))
            elif ev.kind == "end":
                result.finish_reason = ev.finish_reason
                result.completion_tokens = ev.completion_tokens
                if timer:
                    timer.on_end(ev.finish_reason or "stop")
                return result
        raise APIError(503, "the worker ended the stream before finishing the request; retry it")

    async def _collect_all(self, streams: list[ChoiceStream], arrival: float) -> list[ChoiceResult]:
        tasks = [asyncio.ensure_future(self._collect(s, arrival)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.cancel()

    async def _merged(self, streams: list[ChoiceStream]) -> AsyncIterator[tuple[int, WorkerEvent]]:
        """Events of all choices as they come, tagged with the choice's index."""
        if len(streams) == 1:
            async for ev in streams[0].events:
                yield 0, ev
            return
        queue: asyncio.Queue[tuple[int, WorkerEvent | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, s: ChoiceStream) -> None:
            try:
                async for ev in s.events:
                    queue.put_nowait((i, ev))
            except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _stream_events(
        self, streams: list[ChoiceStream], arrival: float
    ) -> AsyncIterator[tuple[int, WorkerEvent]]:
        """Merged events with metrics and error handling; cancels every choice on exit."""
        timers = [self._timer(arrival, s) for s in streams]
        ended: set[int] = set()
        try:
            async for i, ev in self._merged(streams):
                error = _end_error(ev)
                if error is not None:
                    raise error
                timer = timers[i]
                if timer and ev.kind == "delta":
                    timer.on_tokens(len(ev.token_ids))
                if ev.kind == "end":
                    ended.add(i)
                    if timer:
                        timer.on_end(ev.finish_reason or "stop")
                yield i, ev
            if len(ended) < len(streams):  # a choice's stream stopped without its `end`
                raise APIError(503, "the worker ended the stream before finishing the request; retry it")
        finally:
            for s in streams:
                s.cancel()

    # -- completions ----------------------------------------------------------------------------

    async def complete(self, req: CompletionRequest, arrival: float | None = None) -> Reply:
        arrival = time.perf_counter() if arrival is None else arrival
        rid = _new_id("cmpl")
        streams = await self._open_all(self.completion_requests(req, rid))
        replicas = [s.start.replica or "" for s in streams]
        prompt_tokens = sum(s.start.prompt_tokens for s in streams[:: req.n])
        if req.stream:
            return Reply(replicas, stream=self._completion_sse(req, rid, streams, prompt_tokens, arrival))
        results = await self._collect_all(streams, arrival)
        choices = [
            CompletionChoice(
                index=i, text=r.text, finish_reason=r.finish_reason,  # type: ignore[arg-type]
                logprobs=_completion_logprobs(r, req.logprobs) if req.logprobs is not None else None,
            )
            for i, r in enumerate(results)
        ]
        return Reply(replicas, body=CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                                       usage=_usage(prompt_tokens, results)))

    async def _completion_sse(
        self, req: CompletionRequest, rid: str, streams: list[ChoiceStream], prompt_tokens: int, arrival: float
    ) -> AsyncIterator[str]:
        created, completion_tokens = int(time.time()), 0

        def chunk(choice: CompletionChoice) -> str:
            return _sse(CompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]))

        try:
            async for i, ev in self._stream_events(streams, arrival):
                if ev.kind == "delta" and (ev.text or req.logprobs is not None):
                    lp = None
                    if req.logprobs is not None:
                        r = ChoiceResult()
                        r.add(ev)
                        lp = _completion_logprobs(r, req.logprobs)
                    yield chunk(CompletionChoice(index=i, text=ev.text, logprobs=lp))
                elif ev.kind == "end":
                    completion_tokens += ev.completion_tokens
                    yield chunk(CompletionChoice(index=i, text="", finish_reason=ev.finish_reason))  # type: ignore[arg-type]
            if req.stream_options and req.stream_options.include_usage:
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                yield _sse(CompletionChunk(id=rid, created=created, model=self.model_name, choices=[], usage=usage))
        except Exception as exc:  # noqa: BLE001 - the client gets an error event, then [DONE]
            yield _sse(_worker_failure(exc).body())
        yield "data: [DONE]\n\n"

    # -- chat -----------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, arrival: float | None = None) -> Reply:
        arrival = time.perf_counter() if arrival is None else arrival
        rid = _new_id("chatcmpl")
        streams = await self._open_all(self.chat_requests(req, rid))
        replicas = [s.start.replica or "" for s in streams]
        prompt_tokens = streams[0].start.prompt_tokens
        if req.stream:
            return Reply(replicas, stream=self._chat_sse(req, rid, streams, prompt_tokens, arrival))
        results = await self._collect_all(streams, arrival)
        choices = [
            ChatChoice(
                index=i, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason,  # type: ignore[arg-type]
                logprobs=_chat_logprobs(r, req.top_logprobs) if req.logprobs else None,
            )
            for i, r in enumerate(results)
        ]
        return Reply(replicas, body=ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                                           usage=_usage(prompt_tokens, results)))

    async def _chat_sse(
        self, req: ChatCompletionRequest, rid: str, streams: list[ChoiceStream], prompt_tokens: int, arrival: float
    ) -> AsyncIterator[str]:
        created, completion_tokens = int(time.time()), 0

        def chunk(choice: ChatChunkChoice) -> str:
            return _sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]))

        try:
            for i in range(len(streams)):  # the role first, at once
                yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for i, ev in self._stream_events(streams, arrival):
                if ev.kind == "delta" and (ev.text or req.logprobs):
                    lp = None
                    if req.logprobs:
                        r = ChoiceResult()
                        r.add(ev)
                        lp = _chat_logprobs(r, req.top_logprobs)
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(content=ev.text), logprobs=lp))
                elif ev.kind == "end":
                    completion_tokens += ev.completion_tokens
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=ev.finish_reason))  # type: ignore[arg-type]
            if req.stream_options and req.stream_options.include_usage:
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                yield _sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                               usage=usage))
        except Exception as exc:  # noqa: BLE001 - the client gets an error event, then [DONE]
            yield _sse(_worker_failure(exc).body())
        yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, results: list[ChoiceResult]) -> UsageInfo:
    completion = sum(r.completion_tokens for r in results)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def _completion_logprobs(r: ChoiceResult, k: int | None) -> CompletionLogprobs:
    offsets, pos = [], 0
    for t in r.token_texts:
        offsets.append(pos)
        pos += len(t)
    top = [{t: lp} for t, lp in zip(r.token_texts, r.logprobs)] if k else [None] * len(r.logprobs)
    return CompletionLogprobs(tokens=r.token_texts, token_logprobs=list(r.logprobs), top_logprobs=top,
                              text_offset=offsets)


def _chat_logprobs(r: ChoiceResult, top_logprobs: int | None) -> ChatLogprobs:
    content = []
    for t, lp in zip(r.token_texts, r.logprobs):
        top = [TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))] if top_logprobs else []
        content.append(ChatLogprobToken(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)
