"""What callers get back: a request's status and a snapshot of its output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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


class FinishReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


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
    _length: int = 0

    @property
    def generated_tokens(self) -> list[int]:
        return self._tokens[: self._length]

    @property
    def logprobs(self) -> list[float] | None:
        return None if self._logprobs is None else self._logprobs[: self._length]

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
