"""From a batch input line to the worker's request, and from the worker's outcome to the output line."""

from __future__ import annotations

from dataclasses import dataclass, field

from cbserve.cluster.batch_backends import Outcome
from cbserve.cluster.batch_schema import BatchLine, ResultLine, Usage
from cbserve.cluster.prefix import chat_routing_text, prefix_hashes
from cbserve.cluster.protocol import WorkerRequest
from cbserve.cluster.settings import GenerationDefaults, RoutingConfig


@dataclass(frozen=True)
class RequestDefaults:
    """Values for the fields a line leaves out (the job's flags, then the generation defaults)."""

    max_tokens: int | None = None  # None: the worker's default, capped by the model's context
    temperature: float | None = None
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    routing: RoutingConfig = field(default_factory=RoutingConfig)


def to_worker_request(
    line: BatchLine, request_id: str, defaults: RequestDefaults, chat_template: bool
) -> WorkerRequest:
    """`prompt` goes as one user chat message when the model has a chat template (unless `raw`)."""
    gen, routing = defaults.generation, defaults.routing
    prompt: dict[str, object]
    if line.input_ids is not None:
        prompt = {"prompt_ids": list(line.input_ids)}
        hashes = prefix_hashes(line.input_ids, routing.chunk_tokens, routing.max_chunks)
    else:
        if line.messages is not None:
            messages = [m.model_dump() for m in line.messages]
        elif chat_template and not line.raw:
            messages = [{"role": "user", "content": line.prompt or ""}]
        else:
            messages = None
        if messages is None:
            prompt = {"prompt": line.prompt}
            hashes = prefix_hashes(line.prompt or "", routing.chunk_chars, routing.max_chunks)
        else:
            prompt = {"messages": messages}
            hashes = prefix_hashes(chat_routing_text(messages), routing.chunk_chars, routing.max_chunks)
    return WorkerRequest(
        request_id=request_id,
        max_tokens=line.max_tokens if line.max_tokens is not None else defaults.max_tokens,
        temperature=next(
            t for t in (line.temperature, defaults.temperature, gen.temperature) if t is not None
        ),
        top_p=gen.top_p if line.top_p is None else line.top_p,
        top_k=gen.top_k if line.top_k is None else line.top_k,
        seed=line.seed,
        stop=line.stop_list(),
        prefix_hashes=hashes,
        **prompt,
    )


def is_retryable(out: Outcome) -> bool:
    """Failures of the engine (5xx), not of the request (4xx)."""
    return out.error is not None and out.status >= 500


def to_result(line: BatchLine, lineno: int, out: Outcome) -> ResultLine:
    if out.error is not None:
        kind = "invalid_request" if 400 <= out.status < 500 else "engine_error"
        return ResultLine(id=line.id, line=lineno, error=out.error, error_type=kind, metadata=line.metadata)
    return ResultLine(
        id=line.id,
        line=lineno,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason,
        usage=Usage(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            total_tokens=out.prompt_tokens + out.completion_tokens,
        ),
        metadata=line.metadata,
    )
