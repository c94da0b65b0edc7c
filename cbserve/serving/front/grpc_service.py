"""The gRPC `Generate` call without Ray: `protos/generate.proto` messages to and from the worker
protocol, and refusals as gRPC statuses (a refused request is INVALID_ARGUMENT)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import APIError, front_message
from cbserve.serving.front.replies import ChoiceResult, ChoiceStream, Piece, pieces
from cbserve.serving.front.service_args import GenerationDefaults
from cbserve.serving.front.worker_requests import check_limits, routing_hashes, sampling, worker_request
from cbserve.serving.protocol import Constraint, Sampling, TopEntry, WorkerRequest

SERVICE = "cbserve.generate.GenerateService"

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# The `SamplingParams` fields with presence (`optional` in the proto), carried when set.
_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens", "prompt_logprobs", "cache_salt")
_SAMPLING = {"max_tokens", "stop", "logprobs", "logit_bias", "ignore_eos", "stop_token_ids", "top_logprobs",
             *_OPTIONAL}


class GrpcAbort(Exception):
    """Ends a gRPC call with the status set on its context (Serve sends a set code only when the
    method raises)."""


class UndecodableRequest:
    """Bytes that are not a `GenerateRequest` (corrupt wire format, invalid UTF-8 in a string):
    `Generate` refuses them with INVALID_ARGUMENT. A deserializer that raised would make grpc
    answer UNKNOWN instead."""

    def __init__(self, error: str):
        self.error = error


def _parse_request(data: bytes) -> Any:
    from cbserve.serving.protos import generate_pb2

    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, whatever the backend
        return UndecodableRequest(f"{type(exc).__name__}: {exc}")


def add_generate_servicer(servicer: Any, server: Any) -> None:
    """`grpc_options.grpc_servicer_functions` entry: the generated
    `add_GenerateServiceServicer_to_server`, with a request parser that never raises."""
    from cbserve.serving.protos import generate_pb2

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_parse_request,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


def abort(grpc_context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise GrpcAbort(details)


def grpc_status(http_status: int) -> grpc.StatusCode:
    return _STATUS.get(http_status, grpc.StatusCode.INTERNAL if http_status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)


def grpc_field(field: str, wreq: WorkerRequest | None) -> str:
    """A refused field by its path in `GenerateRequest`."""
    if field == "input_ids":
        return "prompt" if wreq is not None and wreq.prompt is not None else "token_ids"
    if field == "max_new_tokens":
        return "sampling.max_tokens"
    return f"sampling.{field}" if field in _SAMPLING else field


def abort_with(grpc_context: Any, exc: APIError | InvalidRequestError, wreq: WorkerRequest | None) -> NoReturn:
    """End the call with the status of a refusal or failure."""
    if isinstance(exc, InvalidRequestError):
        abort(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, front_message(grpc_field(exc.field, wreq), exc))
    code = grpc_status(exc.status)
    if exc.code == "overloaded":  # as Serve maps backpressure on its own gRPC path
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    abort(grpc_context, code, exc.message)


def to_worker_request(msg: Any, service: Any) -> WorkerRequest:
    """A `GenerateRequest` as a worker request; raises `APIError` (undecodable, larger than
    `limits.max_body_bytes`, unknown model) or `InvalidRequestError` (this front's rules and
    limits; the engine checks the values). Serve's proxy refuses a larger message before it is
    buffered when started by `cbserve.cluster.run` (`ray_compat.proxy_env_vars`)."""
    if isinstance(msg, UndecodableRequest):
        raise APIError(400, f"the request is not a valid cbserve.generate.GenerateRequest: {msg.error}")
    limit = service.args.limits.max_body_bytes
    if msg.ByteSize() > limit:  # HTTP's body cap, before anything reads the prompt (RESOURCE_EXHAUSTED)
        raise APIError(413, f"the request is larger than the limit of {limit} bytes", code="body_too_large")
    service.check_model(msg.model or None)
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("input", "one of prompt or token_ids is required")
    s, args = msg.sampling, service.args
    max_tokens = s.max_tokens if s.HasField("max_tokens") else None
    check_limits(args.limits, max_tokens, stops=s.stop)
    if any(not x for x in s.stop):
        raise InvalidRequestError("stop", "stop strings must not be empty")
    prompt: dict[str, Any] = {"prompt": msg.prompt} if which == "prompt" else {"prompt_ids": list(msg.token_ids.ids)}
    return worker_request(
        f"grpc-{uuid.uuid4().hex}",
        routing_hashes(args.routing, msg.prompt if which == "prompt" else prompt["prompt_ids"]),
        _sampling(s, args.generation, service.adapter(msg.model or None)),
        max_tokens=max_tokens,
        stop=list(s.stop),
        logprobs=s.logprobs,
        constraint=_constraint(msg),
        **prompt,
    )


def _sampling(s: Any, gen: GenerationDefaults, lora: str | None = None) -> Sampling:
    """The message's `SamplingParams` as the sampling block (a field it does not set: None);
    `lora`: the adapter its `model` names."""
    fields: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    return sampling(gen, logit_bias=dict(s.logit_bias) or None, ignore_eos=s.ignore_eos or None,
                    stop_token_ids=list(s.stop_token_ids) or None, top_logprobs=s.top_logprobs or None, lora=lora,
                    **fields)


def _constraint(msg: Any) -> Constraint | None:
    if not msg.HasField("constraint"):
        return None
    kind = msg.constraint.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("constraint", "constraint: set one of json_schema, json_object, regex, choice, "
                                  "grammar")
    value = getattr(msg.constraint, kind)
    spec = list(value.choices) if kind == "choice" else None if kind == "json_object" else value
    return Constraint(kind=kind, spec=spec, field=f"constraint.{kind}")


def start_message(result: ChoiceResult) -> Any:
    from cbserve.serving.protos import generate_pb2

    return generate_pb2.GenerateResponse(prompt_tokens=result.prompt_tokens, replica=result.replica)


def piece_message(piece: Piece) -> Any:
    """A delta's tokens and text, or (last) the finish."""
    from cbserve.serving.protos import generate_pb2

    if piece.finish_reason is not None:
        return generate_pb2.GenerateResponse(finish_reason=piece.finish_reason,
                                             completion_tokens=piece.completion_tokens)
    prompt = piece.prompt
    return generate_pb2.GenerateResponse(
        token_ids=piece.token_ids, text=piece.text, logprobs=piece.logprobs,
        top_logprobs=[_top(entries) for entries in piece.top_logprobs],
        prompt_logprobs=[float("nan") if v is None else v for v in (prompt.logprobs or [])] if prompt else [],
        prompt_top_logprobs=[_top(entries) for entries in (prompt.top_logprobs or [])] if prompt else [],
    )


def _top(entries: list[TopEntry]) -> Any:
    from cbserve.serving.protos import generate_pb2

    return generate_pb2.TopLogprobs(token_ids=[t for t, _, _ in entries], tokens=[text for _, text, _ in entries],
                                    logprobs=[lp for _, _, lp in entries])


async def replies(stream: ChoiceStream, timer: Any, grpc_context: Any) -> AsyncIterator[Any]:
    """The messages of an accepted choice: its start, its deltas, its finish; a choice that fails
    (error, abort, worker gone, stream cut short) ends the call with a status instead."""
    result = ChoiceResult(timer=timer)
    result.add(stream.start)
    try:
        yield start_message(result)
        async for piece in pieces(stream.events, result):
            yield piece_message(piece)
    except (APIError, InvalidRequestError) as exc:
        abort_with(grpc_context, exc, None)
    finally:
        stream.cancel()
