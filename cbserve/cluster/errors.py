"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from cbserve.cluster.schemas import ErrorInfo, ErrorResponse

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


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return APIError(status, message, param, code).response()
