"""The OpenAI completions and chat-completions logic, free of HTTP and of Ray.

It turns a validated request into one `WorkerRequest` per choice, opens each choice's stream
through `open_choice` (in the cluster: a streaming call to an engine replica), folds each
choice's events (`replies.py`) and renders either a whole response or server-sent events.
Opening a choice returns once the worker has accepted it, so a bad request still gets a 4xx
before any event is streamed.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import APIError, openai_error
from cbserve.serving.chat_template import template_messages
from cbserve.serving.constraints import requested, tool_choice_mode, tool_constraint
from cbserve.serving.front import embeddings, responses
from cbserve.serving.front.chat_replies import ChatRendering
from cbserve.serving.front.embeddings import EmbeddingRequest
from cbserve.serving.front.metrics import ServingMetrics
from cbserve.serving.front.replies import (
    ChoiceResult,
    ChoiceStream,
    Piece,
    completion_choice,
    completion_chunk_choice,
    pieces,
    prompt_logprobs,
    usage,
    worker_failure,
)
from cbserve.serving.front.responses import ResponsesRequest
from cbserve.serving.front.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingFields,
    StreamOptions,
    _new_id,
)
from cbserve.serving.front.service_args import ServiceArgs
from cbserve.serving.front.worker_requests import (
    check_limits,
    logit_bias,
    routing_hashes,
    sampling,
    user_tenant,
    worker_request,
)
from cbserve.serving.protocol import Constraint, Sampling, WorkerRequest

OpenChoice = Callable[[WorkerRequest], Awaitable[ChoiceStream]]
Chunk = Callable[[list[Any], Any], Any]  # (choices, usage) -> a chunk model


@dataclass
class Reply:
    """Either a whole `body` or an SSE `stream`; `replicas` served the choices (for a header)."""

    replicas: list[str]
    body: Any = None
    stream: AsyncIterator[str] | None = None


def _sse(obj: Any) -> str:
    payload = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {payload}\n\n"


def _status(exc: APIError | InvalidRequestError) -> int:
    return 400 if isinstance(exc, InvalidRequestError) else exc.status


def _as_api_error(exc: Exception, prompt_param: str) -> APIError:
    exc = worker_failure(exc)
    return openai_error(exc, prompt_param) if isinstance(exc, InvalidRequestError) else exc  # type: ignore[return-value]


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def _merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """Items of all streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[Piece]) -> None:
        try:
            async for item in s:
                queue.put_nowait((i, item))
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


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat template's variables: the request's own, and `enable_thinking` from
    reasoning_effort (none and minimal: off) unless they set it."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", req.reasoning_effort not in ("none", "minimal"))
    return kwargs or None


CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def call_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """(the response's id, the call's id in the engine: its choices' ids and fair-share parent).
    With an X-Request-Id (at most 128 of A-Z a-z 0-9 . _ : -) the response is `prefix-<it>`, as
    vLLM answers, and the engine's id adds a random part: two clients sending one X-Request-Id
    never meet in the engine."""
    if client_id is None:
        rid = _new_id(prefix)
        return rid, rid
    if not CLIENT_ID.fullmatch(client_id):
        raise APIError(400, "header x-request-id: at most 128 characters of A-Z a-z 0-9 . _ : -", "x-request-id")
    return f"{prefix}-{client_id}", _new_id(f"{prefix}-{client_id}")


class OpenAIService:
    def __init__(self, args: ServiceArgs, open_choice: OpenChoice, metrics: ServingMetrics | None = None,
                 adapters: Mapping[str, str] | None = None):
        self.args = args
        self._open_choice = open_choice
        self.metrics = metrics
        self.model_name = args.model_name
        self._names = {args.model_name} | ({args.model} if args.model else set())
        # LoRA adapter name -> folder: `lora_modules`, or the cluster's catalog, which changes at run time.
        self.adapters = args.lora_modules if adapters is None else adapters
        self.response_store = responses.ResponseStore()

    # -- request -> worker requests: the rules only this front has -------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self._names and model not in self.adapters:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names; None: the base model."""
        return model if model is not None and model in self.adapters and model not in self._names else None

    def served_name(self, model: str | None) -> str:
        """The `model` of a reply: the adapter the request named, else the base model's name."""
        return self.adapter(model) or self.model_name

    def _check_common(self, req: SamplingFields, max_tokens: int | None, num_prompts: int) -> None:
        self.check_model(req.model)
        check_limits(self.args.limits, max_tokens, req.n, num_prompts, req.stop_list())

    def _sampling(self, req: SamplingFields, rid: str, top_logprobs: int | None,
                  prompt_logprobs: int | None) -> Sampling:
        """The call's sampling block; `rid` (the API call's id) is every choice's parent request."""
        return sampling(
            self.args.generation, temperature=req.temperature, top_p=req.top_p,
            top_k=None if req.top_k is None else max(req.top_k, 0), seed=req.seed, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, logit_bias=logit_bias(req.logit_bias), min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos or None, stop_token_ids=req.stop_token_ids, top_logprobs=top_logprobs or None,
            prompt_logprobs=prompt_logprobs, cache_salt=req.cache_salt, speculative=req.speculative,
            lora=self.adapter(req.model), priority=req.priority or None,
            tenant=user_tenant(req.user), parent_id=rid,
        )

    @staticmethod
    def _choices(first: WorkerRequest, n: int) -> list[WorkerRequest]:
        """A prompt's `n` choices: `first` (its id ending in "-0") and copies of it, each with its
        own id and seed (the call's + its index)."""
        base, seed = first.request_id.removesuffix("-0"), first.sampling.seed
        return [first] + [first.model_copy(update={"request_id": f"{base}-{c}", "sampling": first.sampling.model_copy(
            update={"seed": None if seed is None else seed + c})}) for c in range(1, n)]

    def completion_requests(self, req: CompletionRequest, rid: str) -> list[WorkerRequest]:
        prompts = req.prompts()
        self._check_common(req, req.max_tokens, len(prompts))
        for name, bad in (("suffix", req.suffix is not None), ("best_of", (req.best_of or 1) > 1)):
            if bad:
                raise InvalidRequestError(name, f"{name} is not supported by this server")
        echo_k = req.logprobs if req.echo else None
        wanted = [k for k in (echo_k, req.prompt_logprobs) if k is not None]
        block, constraint = self._sampling(req, rid, req.logprobs, max(wanted) if wanted else None), requested(req)
        out = []
        for p_idx, prompt in enumerate(prompts):
            first = worker_request(
                f"{rid}-{p_idx}-0", routing_hashes(self.args.routing, prompt, cache_key=req.prompt_cache_key), block,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_ids=None if isinstance(prompt, str) else prompt, max_tokens=req.max_tokens,
                stop=req.stop_list(), skip_special_tokens=req.skip_special_tokens, constraint=constraint,
                logprobs=req.logprobs is not None, echo=req.echo, migrate=req.migrate)
            out += self._choices(first, req.n)
        return out

    def _chat_constraint(self, req: ChatCompletionRequest, mode: str) -> Constraint | None:
        """A forced tool call's grammar, else the requested output constraint. With both, the call
        wins, as in OpenAI's API: `response_format` shapes a text answer, and a forced call's turn
        has none (the Agents SDK sends both when an agent with an output type must call a tool)."""
        return tool_constraint(req, mode) or requested(req)

    def chat_requests(self, req: ChatCompletionRequest, rid: str, mode: str = "none") -> list[WorkerRequest]:
        max_tokens = req.max_completion_tokens or req.max_tokens
        self._check_common(req, max_tokens, 1)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs: needs logprobs: true")
        if req.prompt_logprobs is not None and req.stream:
            raise InvalidRequestError("prompt_logprobs", "prompt_logprobs: not with stream on chat completions")
        messages = template_messages(req.messages)
        first = worker_request(
            f"{rid}-0", routing_hashes(self.args.routing, messages=messages, cache_key=req.prompt_cache_key),
            self._sampling(req, rid, req.top_logprobs, req.prompt_logprobs), messages=messages,
            max_tokens=max_tokens, stop=req.stop_list(), skip_special_tokens=req.skip_special_tokens,
            constraint=self._chat_constraint(req, mode), logprobs=req.logprobs,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            template_kwargs=template_kwargs(req), reasoning_effort=req.reasoning_effort, migrate=req.migrate)
        return self._choices(first, req.n)

    # -- running choices ------------------------------------------------------------------------

    async def _open_all(self, wreqs: list[WorkerRequest], n: int = 1) -> list[ChoiceStream]:
        """Open every choice; with `n` > 1 each prompt's first choice first: its siblings then
        follow it to its replica (prefix affinity) and share its prefill (prefix cache)."""
        if n == 1:
            return await self._open_wave(wreqs)
        leads = await self._open_wave(wreqs[::n])
        try:
            rest = iter(await self._open_wave([w for i, w in enumerate(wreqs) if i % n]))
        except BaseException:
            for s in leads:
                s.cancel()
            raise
        return [leads[i // n] if i % n == 0 else next(rest) for i in range(len(wreqs))]

    async def _open_wave(self, wreqs: list[WorkerRequest]) -> list[ChoiceStream]:
        results = await asyncio.gather(*(self._open_choice(w) for w in wreqs), return_exceptions=True)
        streams = [r for r in results if isinstance(r, ChoiceStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s in streams:
                s.cancel()
            refusals = [e for e in errors if isinstance(e, APIError | InvalidRequestError)]
            raise (min(refusals, key=_status) if refusals else errors[0])
        return streams

    def _result(self, stream: ChoiceStream, arrival: float) -> ChoiceResult:
        timer = self.metrics.timer(arrival, stream.start.prompt_tokens, stream.lora) if self.metrics else None
        result = ChoiceResult(timer=timer)
        result.add(stream.start)
        return result

    async def _collect_all(self, streams: list[ChoiceStream], arrival: float) -> list[ChoiceResult]:
        results = [self._result(s, arrival) for s in streams]
        tasks = [asyncio.ensure_future(_drain(pieces(s.events, r))) for s, r in zip(streams, results)]
        try:
            await asyncio.gather(*tasks)
            return results
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.cancel()

    async def _stream_pieces(self, streams: list[ChoiceStream], arrival: float) -> AsyncIterator[tuple[int, Piece]]:
        """The pieces of all choices as they come; raises a choice's failure; cancels every
        choice on exit."""
        results = [self._result(s, arrival) for s in streams]
        try:
            async for i, piece in _merged([pieces(s.events, r) for s, r in zip(streams, results)]):
                yield i, piece
        finally:
            for s in streams:
                s.cancel()

    async def _sse_stream(self, streams: list[ChoiceStream], arrival: float, prompt_param: str, chunk: Chunk,
                          choice: Callable[[int, Piece], Any], first: list[Any], prompt_tokens: int,
                          options: StreamOptions | None) -> AsyncIterator[str]:
        """The SSE lines; `options`: usage last (`include_usage`), and in every chunk too
        (vLLM's `continuous_usage_stats`)."""
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        completion_tokens = generated = 0
        try:
            for c in first:
                yield _sse(chunk([c], usage(prompt_tokens, []) if continuous else None))
            async for i, piece in self._stream_pieces(streams, arrival):
                completion_tokens += piece.completion_tokens
                generated += len(piece.token_ids)
                c = choice(i, piece)
                so_far = usage(prompt_tokens, [Piece(completion_tokens=generated)]) if continuous else None
                for one in c if isinstance(c, list) else [c]:
                    if one is not None:
                        yield _sse(chunk([one], so_far))
            if include_usage:
                yield _sse(chunk([], usage(prompt_tokens, [Piece(completion_tokens=completion_tokens)])))
        except Exception as exc:  # noqa: BLE001 - the client gets an error event, then [DONE]
            yield _sse(_as_api_error(exc, prompt_param).body())
        yield "data: [DONE]\n\n"

    # -- completions and chat -------------------------------------------------------------------

    async def complete(self, req: CompletionRequest, arrival: float | None = None,
                       client_id: str | None = None) -> Reply:
        """`client_id`: the client's X-Request-Id, the response's id (`cmpl-<it>`) as vLLM has it."""
        try:
            return await self._complete(req, time.perf_counter() if arrival is None else arrival,
                                        *call_ids("cmpl", client_id))
        except InvalidRequestError as exc:
            raise openai_error(exc, "prompt") from None

    async def _complete(self, req: CompletionRequest, arrival: float, rid: str, call: str) -> Reply:
        streams = await self._open_all(self.completion_requests(req, call), req.n)
        replicas, name = [s.start.replica or "" for s in streams], self.served_name(req.model)
        prompt_tokens = sum(s.start.prompt_tokens for s in streams[:: req.n])
        if req.stream:
            created = int(time.time())

            def chunk(choices: list[Any], use: Any) -> CompletionChunk:
                return CompletionChunk(id=rid, created=created, model=name, choices=choices, usage=use)

            return Reply(replicas, stream=self._sse_stream(
                streams, arrival, "prompt", chunk,
                lambda i, p: completion_chunk_choice(i, p, req.logprobs, req.echo, req.prompt_logprobs), [],
                prompt_tokens, req.stream_options))
        results = await self._collect_all(streams, arrival)
        choices = [completion_choice(i, r, req.logprobs, req.echo, req.prompt_logprobs) for i, r in enumerate(results)]
        return Reply(replicas, body=CompletionResponse(id=rid, model=name, choices=choices,
                                                       usage=usage(prompt_tokens, results)))

    async def chat(self, req: ChatCompletionRequest, arrival: float | None = None,
                   client_id: str | None = None) -> Reply:
        try:
            return await self._chat(req, time.perf_counter() if arrival is None else arrival,
                                    *call_ids("chatcmpl", client_id))
        except InvalidRequestError as exc:
            raise openai_error(exc, "messages") from None

    async def responses(self, req: ResponsesRequest, arrival: float | None = None,
                        client_id: str | None = None) -> Reply:
        """OpenAI's Responses API, run as a chat completion (`responses.py`); stored for
        `previous_response_id` unless `store` is false."""
        previous = self.response_store.get(req.previous_response_id) if req.previous_response_id else []
        conversation = previous + responses.input_messages(req)
        try:
            reply = await self.chat(responses.to_chat(req, conversation), arrival, client_id)
        except APIError as exc:
            raise responses.renamed(exc) from None

        def keep(rid: str, output: list[dict[str, Any]]) -> None:
            if req.store is not False:
                self.response_store.put(rid, conversation + responses.output_messages(output))

        if reply.stream is not None:
            return Reply(reply.replicas, stream=responses.stream(req, self.served_name(req.model), reply.stream, keep))
        body = responses.render(req, reply.body)
        keep(body["id"], body["output"])
        return Reply(reply.replicas, body=body)

    async def embeddings(self, req: EmbeddingRequest, arrival: float | None = None,
                         client_id: str | None = None) -> Reply:
        """OpenAI's embeddings: one embedding request per input (`embeddings.py`)."""
        try:
            return await self._embed(req, time.perf_counter() if arrival is None else arrival,
                                     call_ids("embd", client_id)[1])
        except InvalidRequestError as exc:
            raise openai_error(exc, "input") from None

    async def _embed(self, req: EmbeddingRequest, arrival: float, call: str) -> Reply:
        self.check_model(req.model)
        req.check(self.args.limits.max_prompts)
        block = Sampling(tenant=user_tenant(req.user), parent_id=call)
        wreqs = [worker_request(f"{call}-{i}", routing_hashes(self.args.routing, p), block,
                                prompt=p if isinstance(p, str) else None,
                                prompt_ids=None if isinstance(p, str) else p, pooling=self.args.embeddings.pooling)
                 for i, p in enumerate(req.inputs())]
        streams = await self._open_all(wreqs)
        results = await self._collect_all(streams, arrival)  # raises a choice's failure
        return Reply([s.start.replica or "" for s in streams], body=embeddings.response(
            self.model_name, [r.embedding or [] for r in results], sum(s.start.prompt_tokens for s in streams),
            req.encoding_format))

    async def _chat(self, req: ChatCompletionRequest, arrival: float, rid: str, call: str) -> Reply:
        mode = tool_choice_mode(req)
        streams = await self._open_all(self.chat_requests(req, call, mode), req.n)
        rendering = ChatRendering(req.logprobs, req.top_logprobs, mode)
        replicas, name = [s.start.replica or "" for s in streams], self.served_name(req.model)
        prompt_tokens = streams[0].start.prompt_tokens
        if req.stream:
            created = int(time.time())

            def chunk(choices: list[Any], use: Any) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=name, choices=choices, usage=use)

            roles = [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(len(streams))]  # the role first, at once
            per_choice = [rendering.stream(i, s.start.reasoning, s.start.tool_format) for i, s in enumerate(streams)]
            return Reply(replicas, stream=self._sse_stream(
                streams, arrival, "messages", chunk, lambda i, p: per_choice[i].chunks(p), roles, prompt_tokens,
                req.stream_options))
        results = await self._collect_all(streams, arrival)
        choices = [rendering.choice(i, r) for i, r in enumerate(results)]
        return Reply(replicas, body=ChatCompletionResponse(
            id=rid, model=name, choices=choices, usage=usage(prompt_tokens, results),
            prompt_logprobs=prompt_logprobs(results[0].prompt, req.prompt_logprobs)))
