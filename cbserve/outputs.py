"""What callers get back: a request's status and a snapshot of its output."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(str, enum.Enum):
    PENDING = "pending"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)

    def __eq__(self, other: object) -> bool:
        # transformers' RequestStatus (an IntEnum) names the same states: code written for its
        # engine compares against it (`out.status == RequestStatus.FINISHED`).
        if isinstance(other, enum.Enum) and not isinstance(other, RequestStatus):
            return type(other).__name__ == "RequestStatus" and other.name == self.name
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return str.__hash__(self)


class FinishReason(str, enum.Enum):
    EOS = "eos"
    STOP = "stop"  # one of the request's stop_token_ids
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    POOLED = "pooled"  # an embedding request: its prompt pooled (workers/pooling.py), nothing generated


@dataclass
class GenerationOutput:
    """A snapshot of one request.

    `generated_tokens` and `logprobs` are read lazily from the request's growing lists up to
    the snapshot's length, so streaming does not copy the whole token list at every step.
    """

    request_id: str
    prompt_ids: list[int]
    status: RequestStatus
    finish_reason: FinishReason | None = None
    error: str | None = None
    exception: BaseException | None = None
    new_tokens: list[int] = field(default_factory=list)
    created_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    _tokens: list[int] = field(default_factory=list, repr=False)
    _logprobs: list[float] | None = field(default=None, repr=False)
    _top_logprobs: list[list[tuple[int, float]]] | None = field(default=None, repr=False)
    _length: int = 0
    _timestamps: list[float] | None = field(default=None, repr=False)
    # With `prompt_logprobs`: each prompt token's log-probability (None for the first) and the
    # most likely (token, logprob) pairs at each prompt position.
    prompt_logprobs: list[float | None] | None = field(default=None, repr=False)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = field(default=None, repr=False)
    # An embedding request's pooled, L2-normalized final hidden state, once it finished.
    embedding: list[float] | None = field(default=None, repr=False)

    @property
    def generated_tokens(self) -> list[int]:
        return self._tokens[: self._length]

    @property
    def logprobs(self) -> list[float] | None:
        return None if self._logprobs is None else self._logprobs[: self._length]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        """With `top_logprobs=k`: the k most likely (token, logprob) pairs at each generated token."""
        return None if self._top_logprobs is None else self._top_logprobs[: self._length]

    @property
    def timestamps(self) -> list[float] | None:
        """With `record_timestamps=True`: when each generated token reached the host (`time.time()`,
        the clock of `created_time`); None otherwise."""
        return None if self._timestamps is None else self._timestamps[: self._length]

    @property
    def new_logprobs(self) -> list[float] | None:
        if self._logprobs is None:
            return None
        return self._logprobs[self._length - len(self.new_tokens) : self._length]

    def is_finished(self) -> bool:
        return self.status.is_final

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.created_time

    def __repr__(self) -> str:  # the lazy fields are what users want to see
        return (
            f"GenerationOutput(request_id={self.request_id!r}, status={self.status.name}, "
            f"finish_reason={self.finish_reason and self.finish_reason.value!r}, "
            f"generated_tokens={self.generated_tokens!r}, error={self.error!r})"
        )


class TokenClock:
    """Per-token timestamps of the requests that asked for them (`record_timestamps`): whoever
    steps the engine ticks it with the requests each step updated."""

    def __init__(self) -> None:
        self._times: dict[str, list[float]] = {}

    def track(self, request_id: str) -> None:
        self._times[request_id] = []

    def tick(self, requests: Iterable[Any]) -> None:
        """`requests` got tokens just now (objects with `request_id` and `generated`)."""
        if not self._times:
            return
        now = time.time()
        for request in requests:
            times = self._times.get(request.request_id)
            if times is not None and len(times) < len(request.generated):
                finished = request.finished_time  # set inside the step, just before `now`
                stamp = now if finished is None else min(now, finished)
                times.extend([stamp] * (len(request.generated) - len(times)))

    def stamp(self, output: GenerationOutput) -> GenerationOutput:
        """Give `output` its request's timestamps (read lazily up to its length, like its tokens)."""
        times = self._times.pop(output.request_id, None) if output.is_finished() else self._times.get(
            output.request_id)
        if times is not None:
            output._timestamps = times
        return output
