"""From a batch input line to the worker's request, and from the folded result to the output line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cbserve.batch.schema import BatchLine, ResultLine, TopToken, Usage, describe_validation_error
from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import front_message
from cbserve.serving.constraints import requested
from cbserve.serving.front.replies import ChoiceResult
from cbserve.serving.front.service_args import GenerationDefaults, RoutingConfig
from cbserve.serving.front.worker_requests import logit_bias, routing_hashes, sampling, worker_request
from cbserve.serving.protocol import PromptInfo, Sampling, TopEntry, WorkerEvent, WorkerRequest


@dataclass(frozen=True)
class RequestDefaults:
    """Values for the fields a line leaves out (the job's flags, then the generation defaults)."""

    max_tokens: int | None = None  # None: the worker's default, capped by the model's context
    temperature: float | None = None
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    routing: RoutingConfig = field(default_factory=RoutingConfig)


def _messages(line: BatchLine, chat_template: bool) -> list[dict[str, str]] | None:
    """The chat to send: the line's `messages`, or its `prompt` as one user message when the
    model has a chat template (unless `raw`); None to send the prompt as plain text."""
    if line.messages is not None:
        return [m.model_dump() for m in line.messages]
    if line.prompt is not None and chat_template and not line.raw:
        return [{"role": "user", "content": line.prompt}]
    return None


def to_worker_request(
    line: BatchLine, request_id: str, defaults: RequestDefaults, chat_template: bool
) -> WorkerRequest:
    messages = None if line.input_ids is not None else _messages(line, chat_template)
    if line.input_ids is not None:
        prompt: dict[str, object] = {"prompt_ids": list(line.input_ids)}
        hashes = routing_hashes(defaults.routing, line.input_ids)
    elif messages is not None:
        prompt = {"messages": messages}
        hashes = routing_hashes(defaults.routing, messages=messages)
    else:
        prompt = {"prompt": line.prompt}
        hashes = routing_hashes(defaults.routing, line.prompt or "")
    return worker_request(
        request_id,
        hashes,
        _sampling(line, defaults),
        max_tokens=line.max_tokens if line.max_tokens is not None else defaults.max_tokens,
        stop=line.stop_list(),
        logprobs=line.logprobs,
        constraint=requested(line),
        **prompt,  # type: ignore[arg-type]
    )


def _sampling(line: BatchLine, defaults: RequestDefaults) -> Sampling:
    return sampling(
        defaults.generation, temperature=line.temperature if line.temperature is not None else defaults.temperature,
        top_p=line.top_p, top_k=line.top_k, seed=line.seed, min_p=line.min_p,
        repetition_penalty=line.repetition_penalty, presence_penalty=line.presence_penalty,
        frequency_penalty=line.frequency_penalty, logit_bias=logit_bias(line.logit_bias), min_tokens=line.min_tokens,
        ignore_eos=line.ignore_eos or None, stop_token_ids=line.stop_token_ids, top_logprobs=line.top_logprobs or None,
        prompt_logprobs=line.prompt_logprobs, cache_salt=line.cache_salt, speculative=line.speculative,
        lora=line.lora, priority=line.priority or None,
    )


def _tops(entries: list[list[TopEntry]]) -> list[list[TopToken]]:
    return [[TopToken(token_id=t, token=text, logprob=lp) for t, text, lp in row] for row in entries]


def _logprob_fields(line: BatchLine, result: ChoiceResult) -> dict[str, Any]:
    """The record's logprob fields, those the line asked for."""
    out: dict[str, Any] = {}
    if line.logprobs:
        out["logprobs"] = result.logprobs
        if line.top_logprobs:
            out["top_logprobs"] = _tops(result.top_logprobs)
    prompt: PromptInfo | None = result.prompt
    if line.prompt_logprobs is not None and prompt is not None:
        out["prompt_logprobs"] = prompt.logprobs
        if line.prompt_logprobs:
            out["prompt_top_logprobs"] = _tops(prompt.top_logprobs or [])
    return out


def line_field(field_name: str, line: BatchLine) -> str:
    """A refused field by its name in the input line."""
    if field_name == "input_ids":  # the prompt's token ids: whichever form the line gave them in
        return next(name for name in ("input_ids", "messages", "prompt") if getattr(line, name) is not None)
    return {"max_new_tokens": "max_tokens"}.get(field_name, field_name)


def is_retryable(result: ChoiceResult) -> bool:
    """Failures of the engine (5xx), not of the request (4xx)."""
    return result.error is not None and result.error.status >= 500


def error_text(err: WorkerEvent, line: BatchLine) -> str:
    """The error of a failed request; a refusal leads with the line's name for the field."""
    if err.field is None:
        return err.message or "engine error"
    return front_message(line_field(err.field, line), InvalidRequestError(err.field, err.message))


def refused(line: BatchLine, lineno: int, exc: ValidationError | InvalidRequestError) -> ResultLine:
    """The `invalid_request` record of a line whose request was refused before it ran."""
    if isinstance(exc, InvalidRequestError):
        message = front_message(line_field(exc.field, line), exc)
    else:
        message = describe_validation_error(exc)
    return ResultLine(id=line.id, line=lineno, error=message, error_type="invalid_request", metadata=line.metadata)


def to_result(line: BatchLine, lineno: int, result: ChoiceResult) -> ResultLine:
    if result.error is not None:
        kind = "invalid_request" if 400 <= result.error.status < 500 else "engine_error"
        return ResultLine(id=line.id, line=lineno, error=error_text(result.error, line), error_type=kind,
                          metadata=line.metadata)
    return ResultLine(
        id=line.id,
        line=lineno,
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        usage=Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            total_tokens=result.prompt_tokens + result.completion_tokens,
        ),
        metadata=line.metadata,
        **_logprob_fields(line, result),
    )
