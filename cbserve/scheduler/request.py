"""A request's state inside the engine: its tokens, pages, status and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` or `do_sample=False` means greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = False
    return_logprobs: bool = False
    status: RequestStatus = RequestStatus.PENDING
    # prompt + generated: what the model must have in its cache before the next token is sampled.
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    # Tokens whose K/V are in the cache; the rest of `tokens` is computed by the next steps.
    num_computed: int = 0
    # Async batching: sampled on the device by a launched step, not yet appended to `tokens`.
    num_inflight: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Pages that prefix caching has already hashed (a prefix of block_ids).
    num_hashed_blocks: int = 0
    # Hash chain of the full prompt pages (prefix caching), computed once.
    prompt_page_hashes: list[int] | None = None
    # Leading pages given back because they left every layer's sliding window.
    num_released_blocks: int = 0
    # Host pool pages holding this request's KV while it is evicted (CPU offload).
    host_block_ids: list[int] = field(default_factory=list)
    num_offloaded_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    exception: BaseException | None = None
    created_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finished_time: float | None = None
    # Tokens already delivered to a streaming consumer.
    num_streamed: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.return_logprobs:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) + self.num_inflight - self.num_computed

    @property
    def awaits_last_token(self) -> bool:
        """Its in-flight token is its last one (max_new_tokens): nothing more to schedule."""
        return self.num_inflight > 0 and len(self.generated) + self.num_inflight >= self.max_new_tokens

    def append_token(self, token: int, logprob: float | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.tokens.append(token)
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(float(logprob) if logprob is not None else float("nan"))

    def stop_reason(self) -> FinishReason | None:
        if self.generated and self.generated[-1] in self.eos_token_ids:
            return FinishReason.EOS
        if len(self.generated) >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, status: RequestStatus, reason: FinishReason, error: BaseException | None = None) -> None:
        self.status = status
        self.finish_reason = reason
        self.finished_time = time.time()
        if error is not None:
            self.exception = error
            self.error = f"{type(error).__name__}: {error}"

    def snapshot(self) -> GenerationOutput:
        """An output reading the growing token lists up to their current length (no copy)."""
        new_tokens = self.generated[self.num_streamed :]
        self.num_streamed = len(self.generated)
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            exception=self.exception,
            new_tokens=new_tokens,
            created_time=self.created_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            _tokens=self.generated,
            _logprobs=self.logprobs,
            _length=len(self.generated),
        )
