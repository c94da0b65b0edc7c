"""A request's state inside the engine: its tokens, pages, status and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` or `do_sample=False` means greedy.

    Logits processing, in this order (transformers' order for its fields, then vLLM's):
    sequence_bias, repetition_penalty (prompt and output), no_repeat_ngram_size, bad_words_ids,
    min_new_tokens (EOS and stop tokens barred before it), suppress_tokens, begin_suppress_tokens,
    presence/frequency penalties (output tokens), logit_bias; then, when sampling, temperature,
    top-k, top-p, min-p.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    remove_invalid_values: bool = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0  # how many most likely tokens to report with each generated one
    logprobs: bool | None = None  # each generated token's log-probability; None: the config's return_logprobs
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's, and k top ones

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits, no top logprobs: what async batching can sample on the device."""
        return self.greedy and not self.processes_logits and not self.top_logprobs

    @property
    def needs_history(self) -> bool:
        """The processors that read the request's tokens (transformers' own, row by row)."""
        return bool(self.no_repeat_ngram_size or self.bad_words_ids or self.sequence_bias)

    @property
    def processes_logits(self) -> bool:
        return (self.needs_history or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_new_tokens > 0
                or bool(self.suppress_tokens) or bool(self.begin_suppress_tokens) or self.remove_invalid_values)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = False
    return_logprobs: bool = False
    # Fair share (scheduler/fair_share.py): lower priority values go first (vLLM's); the tenant
    # and the parent request (one API call's choices) are each given an equal share of the engine.
    priority: int = 0
    tenant: str = ""
    parent_id: str | None = None  # None: the tenant's one FIFO queue (the Python API's order)
    status: RequestStatus = RequestStatus.PENDING
    # prompt + generated: what the model must have in its cache before the next token is sampled.
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    # With sampling.top_logprobs: the most likely (token, logprob) pairs at each generated token.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With sampling.prompt_logprobs: each prompt token's logprob (None for the first) and top pairs.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Structured outputs: the compiled constraint (workers/structured.py), and whether it is complete.
    grammar: object | None = None
    grammar_done: bool = False
    # An embedding request's pooling (workers/pooling.py): its prompt's hidden states are pooled,
    # nothing is sampled; it finishes when its prompt is computed.
    pooling: object | None = None
    # Tokens whose K/V are in the cache; the rest of `tokens` is computed by the next steps.
    num_computed: int = 0
    # Async batching: sampled on the device by a launched step, not yet appended to `tokens`.
    num_inflight: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Pages that prefix caching has already hashed (a prefix of block_ids).
    num_hashed_blocks: int = 0
    # Hash chain of the full prompt pages (prefix caching), computed once.
    prompt_page_hashes: list[int] | None = None
    # vLLM's cache_salt: mixed into the hash of the first page, so this request's prefix pages are
    # shared only with requests of the same salt (none: only with requests without one).
    cache_salt: str | None = None
    # The LoRA adapter the request runs with (`workers/lora_slots.py`'s id of one load); None: the
    # base model. Roots the prefix hash chain too: pages are never shared across adapters.
    lora_id: int | None = None
    # Speculative decoding, when the engine has it: False opts this request out.
    speculative: bool = True
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
    # Stream migration: how many of `generated` came with the request (`resume`), made elsewhere.
    num_resumed: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.return_logprobs or self.sampling.top_logprobs:
            self.logprobs = []
        if self.sampling.top_logprobs:
            self.top_logprobs = []
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = [None], [[]]

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

    @property
    def live(self) -> bool:
        """Still in the engine: not finished, cancelled or failed."""
        return not self.status.is_final

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: what async batching can sample on the device."""
        return self.sampling.plain_greedy and self.grammar is None

    @property
    def may_speculate(self) -> bool:
        """Its next tokens may be proposed and verified in one pass: no prompt logprobs are owed
        and no prompt is pooled (an embedding request never decodes). Its logits processors and
        grammar process each proposal's row as if the proposals before it were generated
        (`LogitsProcessing.process_proposal_rows`)."""
        return self.speculative and not self.computes_whole_prompt

    @property
    def computes_whole_prompt(self) -> bool:
        """Its prompt is computed, never matched in the prefix cache: the matched positions'
        logits (prompt logprobs) or hidden states (pooling) would be missing."""
        return self.wants_prompt_logprobs or self.pooling is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (every prompt position's logits are kept)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def resume(self, tokens: list[int]) -> None:
        """Continue an output begun on another engine (stream migration): `tokens` count as
        generated (max_new_tokens, min_tokens, penalties, the grammar, a seed's draws), are
        prefilled after the prompt as a preempted request's output is, and are never streamed
        again (their logprobs are NaN: they were reported where they were drawn)."""
        self.tokens += tokens
        self.generated = list(tokens)
        self.num_resumed = self.num_streamed = len(tokens)
        if self.logprobs is not None:
            self.logprobs = [float("nan")] * len(tokens)
        if self.top_logprobs is not None:
            self.top_logprobs = [[] for _ in tokens]

    def append_token(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.tokens.append(token)
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(float(logprob) if logprob is not None else float("nan"))
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or [])

    def stop_reason(self) -> FinishReason | None:
        last = self.generated[-1] if self.generated else None
        if last is not None and last in self.eos_token_ids and not self.sampling.ignore_eos:
            return FinishReason.EOS
        if last is not None and last in self.sampling.stop_token_ids:
            return FinishReason.STOP
        # Its grammar took its stop token: the last one (a speculative run's grammar has taken all
        # of the run's tokens before they are appended one by one).
        if self.grammar_done and last in self.grammar.stop_token_ids:
            return FinishReason.STOP
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
            _top_logprobs=self.top_logprobs,
            _length=len(self.generated),
            prompt_logprobs=self.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
            embedding=getattr(self.pooling, "embedding", None),
        )
