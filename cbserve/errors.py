"""The one error a refused request raises, wherever it enters (Python API, HTTP, gRPC, batch).

It carries the offending field, so each front maps it without reading the message: HTTP to a 400
with OpenAI's `param`, gRPC to INVALID_ARGUMENT, the batch job to a failed line.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request refused at the boundary. `field` is the engine argument at fault (`input_ids`,
    `max_new_tokens`, `temperature`, ...); the message names it and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
