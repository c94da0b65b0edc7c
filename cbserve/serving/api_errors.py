"""Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), and the mapping
of a refused request's typed error to them.

A request is refused with `cbserve.errors.InvalidRequestError(field, message)`, by the engine
(its own argument names: `input_ids`, `max_new_tokens`, `temperature`, ...) or by a front's own
rules (the API's names). Each front maps the field to its own name without reading the message:
`openai_error` here for HTTP, `grpc_service.grpc_field` for gRPC, `batch.requests` for batch lines.
"""

from __future__ import annotations

import logging
import math

from fastapi.responses import JSONResponse

from cbserve.errors import InvalidRequestError
from cbserve.serving.front.schemas import ErrorInfo, ErrorResponse
from cbserve.serving.protocol import WorkerEvent

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}

# Engine arguments under their OpenAI names; None: set by the server, not by the client.
_OPENAI_PARAMS: dict[str, str | None] = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                                         "request_id": None, "eos_token_id": None}

logger = logging.getLogger(__name__)

ABORTED = "the request was cancelled by the server (a worker is shutting down); retry it"
CUT_SHORT = "the worker stopped before the request finished; retry it"
OVERLOADED = "overloaded"  # the code of an overload refusal (HTTP 503 or 429 + Retry-After)


class APIError(Exception):
    """A request error that reaches the client with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds, rounded up)

    def body(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(0, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers or None)


def front_message(name: str | None, exc: InvalidRequestError) -> str:
    """A refusal's message as a front shows it: led by the front's name for the field when that
    is not the name the message was written with (the engine's `input_ids`, `max_new_tokens`)."""
    return f"{name}: {exc.message}" if name and name != exc.field else exc.message


def openai_error(exc: InvalidRequestError, prompt_param: str) -> APIError:
    """A refused request as a 400 with OpenAI's `param`; the prompt's token ids (`input_ids`) are
    `prompt_param` ("prompt" for completions, "messages" for chat)."""
    param = prompt_param if exc.field == "input_ids" else _OPENAI_PARAMS.get(exc.field, exc.field)
    return APIError(400, front_message(param, exc), param)


def error_event(status: int, message: str, field: str | None = None) -> WorkerEvent:
    return WorkerEvent(kind="error", status=status, message=message, field=field)


def refusal(ev: WorkerEvent, overload_status: int = 503,
            retry_after_s: float = 1.0) -> InvalidRequestError | APIError:
    """An `error` event as the exception a front maps: the typed refusal when it names a field;
    an overloaded engine (its waiting queue full) as the deployment's overload answer, with
    Retry-After, as when every replica is busy (gRPC: RESOURCE_EXHAUSTED)."""
    if ev.field is not None:
        return InvalidRequestError(ev.field, ev.message)
    if ev.code == OVERLOADED:
        return APIError(overload_status, ev.message, code=OVERLOADED, retry_after_s=retry_after_s)
    status = ev.status or 500
    if status >= 500 and status != 503:
        # A failure's text (an engine exception's) is for the log, never for the client.
        logger.error("a request failed on its worker: %s", ev.message)
        return internal_error(None)
    return APIError(status, ev.message, code=ev.code)


def internal_error(request_id: str | None) -> APIError:
    """A 500 that says nothing of the failure (the log has it, under `request_id`)."""
    where = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"internal server error{where}; the server's log has the details", code="internal_error")
