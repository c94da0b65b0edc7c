"""From a batch input line to the worker's request, and from the folded result to the output line."""

from __future__ import annotations

from dataclasses import dataclass, field

from cbserve.batch.schema import BatchLine, ResultLine, Usage
from cbserve.errors import InvalidRequestError
from cbserve.serving.errors import front_message
from cbserve.serving.protocol import WorkerEvent, WorkerRequest
from cbserve.serving.replies import ChoiceResult
from cbserve.serving.requests import routing_hashes, worker_request
from cbserve.serving.settings import GenerationDefaults, RoutingConfig


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
        defaults.generation,
        hashes,
        max_tokens=line.max_tokens if line.max_tokens is not None else defaults.max_tokens,
        temperature=line.temperature if line.temperature is not None else defaults.temperature,
        top_p=line.top_p,
        top_k=line.top_k,
        seed=line.seed,
        stop=line.stop_list(),
        **prompt,  # type: ignore[arg-type]
    )


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
    )
