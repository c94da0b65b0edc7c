"""The errors a refused request raises, wherever it enters (Python API, HTTP, gRPC, batch).

`InvalidRequestError` carries the offending field, so each front maps it without reading the
message: HTTP to a 400 with OpenAI's `param`, gRPC to INVALID_ARGUMENT, the batch job to a failed
line. `QueueFullError` is an overload (the waiting queue is full), not a bad request.
"""

from __future__ import annotations

import queue


class InvalidRequestError(ValueError):
    """A request refused at the boundary. `field` is the engine argument at fault (`input_ids`,
    `max_new_tokens`, `temperature`, ...); the message names it and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class RequestFault(InvalidRequestError):
    """A request that was admitted but cannot go on, through its own arguments (its constraints
    leave no token to draw, its grammar or logits processors raised): it fails alone, its client
    told which fields, and the step's other requests continue. The message is ours; the cause,
    which may hold internals, stays in `__cause__` for the log."""


class EngineFault(RuntimeError):
    """A step failed through no request's fault, in a way a client may be told of: `public` says
    what failed without the internals in the message (the log has those)."""

    public = "the engine serving this request failed"


class QueueFullError(queue.Full):
    """A request refused because the manager's waiting queue holds `max_queue_size` requests
    already: an overload, not a bad request (HTTP maps it to its overload answer). A `queue.Full`,
    as transformers' manager raises when its input queue stays full."""

    def __init__(self, max_queue_size: int, waiting: int) -> None:
        super().__init__(f"the waiting queue is full: {waiting} requests wait for max_queue_size={max_queue_size}; "
                         "retry later")
        self.max_queue_size = max_queue_size
        self.waiting = waiting
