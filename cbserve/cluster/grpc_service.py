"""Conversions between `protos/generate.proto` messages and the worker protocol."""

from __future__ import annotations

import uuid
from typing import Any, NoReturn

import grpc
from pydantic import ValidationError

from cbserve.cluster.errors import APIError
from cbserve.cluster.protocol import WorkerEvent, WorkerRequest

SERVICE = "cbserve.generate.GenerateService"

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


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
    from cbserve.cluster.protos import generate_pb2

    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, whatever the backend
        return UndecodableRequest(f"{type(exc).__name__}: {exc}")


def add_generate_servicer(servicer: Any, server: Any) -> None:
    """`grpc_options.grpc_servicer_functions` entry: the generated
    `add_GenerateServiceServicer_to_server`, with a request parser that never raises."""
    from cbserve.cluster.protos import generate_pb2

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


def to_worker_request(msg: Any, service: Any) -> WorkerRequest:
    """Validate a `GenerateRequest`; raises `APIError` (400/404) naming the field."""
    if isinstance(msg, UndecodableRequest):
        raise APIError(400, f"the request is not a valid cbserve.generate.GenerateRequest: {msg.error}")
    service.check_model(msg.model or None)
    which = msg.WhichOneof("input")
    if which is None:
        raise APIError(400, "one of prompt or token_ids is required", "input")
    s = msg.sampling
    gen, limits = service.args.generation, service.args.limits
    max_tokens = s.max_tokens if s.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens must be at most {limits.max_tokens}, got {max_tokens}", "sampling.max_tokens")
    if len(s.stop) > limits.max_stop:
        raise APIError(400, f"at most {limits.max_stop} stop strings, got {len(s.stop)}", "sampling.stop")
    if any(not x for x in s.stop):
        raise APIError(400, "stop strings must not be empty", "sampling.stop")
    if which == "prompt":
        if not msg.prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        prompt: dict[str, Any] = {"prompt": msg.prompt}
        key: str | list[int] = msg.prompt
    else:
        ids = list(msg.token_ids.ids)
        if not ids:
            raise APIError(400, "token_ids must not be empty", "token_ids")
        prompt, key = {"prompt_ids": ids}, ids
    try:
        return WorkerRequest(
            request_id=f"grpc-{uuid.uuid4().hex}",
            max_tokens=max_tokens,
            temperature=s.temperature if s.HasField("temperature") else gen.temperature,
            top_p=s.top_p if s.HasField("top_p") else gen.top_p,
            top_k=s.top_k if s.HasField("top_k") else gen.top_k,
            seed=s.seed if s.HasField("seed") else None,
            stop=list(s.stop),
            logprobs=s.logprobs,
            prefix_hashes=service.routing_hashes(key),
            **prompt,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        param = "sampling." + ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(400, f"{param}: {err.get('msg')}", param) from None


def delta_message(ev: WorkerEvent) -> Any:
    from cbserve.cluster.protos import generate_pb2

    return generate_pb2.GenerateResponse(token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs or [])
