"""Per-request logits processing of one step's sampled rows, before the sampler draws.

Each request's `SamplingParams` says which processors it uses; a step applies each processor
to the rows that use it, all rows at once where the processor is elementwise (penalties, bias,
barred tokens), and row by row with `transformers`' own processors where it reads the request's
tokens (sequence bias, no-repeat n-grams, bad words), so those match `generate()` exactly.

Per-request state lives here, keyed by request id, from its first sampled step until `forget`:
which tokens its prompt and output hold (repetition penalty) and how often each output token
came (presence and frequency penalties), its grammar's matcher (structured outputs), updated as
tokens are appended. The penalties touch only those tokens: each step gathers the (row, token)
pairs of every penalized row and updates them at once, so their cost follows the tokens a
request has seen, not the vocabulary, and a step makes a few tensor operations whatever its rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    InfNanRemoveLogitsProcessor,
    LogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from cbserve.errors import RequestFault
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.workers.structured import GrammarState, apply_masks, mask_proposal_rows

logger = logging.getLogger(__name__)


@dataclass
class _RowState:
    seen: set[int] | None = None  # the tokens in the prompt or the output
    counts: dict[int, int] | None = None  # token -> occurrences in the output
    before: list[LogitsProcessor] = field(default_factory=list)  # transformers' ones ahead of the penalty
    after: list[LogitsProcessor] = field(default_factory=list)  # and behind it
    grammar: GrammarState | None = None  # structured outputs


    def extended(self, tokens: list[int]) -> _RowState:
        """The penalties' state once `tokens` are generated too (no grammar: masks are apart)."""
        seen = None if self.seen is None else self.seen | set(tokens)
        counts = None
        if self.counts is not None:
            counts = dict(self.counts)
            for token in tokens:
                counts[token] = counts.get(token, 0) + 1
        return _RowState(seen, counts, self.before, self.after)


@dataclass
class _ProposalView:
    """What the processors read of a request, as it would be once `draft` tokens are generated."""

    tokens: list[int]
    generated: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]

    @classmethod
    def after(cls, request: Request, draft: list[int]) -> _ProposalView:
        return cls(request.tokens + draft, request.generated + draft, request.sampling, request.eos_token_ids)


def _history_processors(params: SamplingParams, eos: frozenset[int]) -> tuple[list, list]:
    before = [SequenceBiasLogitsProcessor([[list(s), b] for s, b in params.sequence_bias])] if params.sequence_bias \
        else []
    after: list[LogitsProcessor] = []
    if params.no_repeat_ngram_size:
        after.append(NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size))
    if params.bad_words_ids:
        after.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], sorted(eos) or None))
    return before, after


def _bar(logits: torch.Tensor, row: int, tokens: list[int]) -> None:
    if tokens:
        logits[row, torch.tensor(tokens, device=logits.device)] = float("-inf")


def processing_failed(request: Request, exc: Exception) -> RequestFault:
    """The fault of a request whose own logits processing or grammar raised `exc` (logged)."""
    logger.exception("request %s: its logits processing raised", request.request_id)
    fault = RequestFault("grammar" if request.grammar is not None else "logits_processors",
                         f"the request's logits processing failed ({type(exc).__name__})")
    fault.__cause__ = exc
    return fault


def no_token_left(request: Request) -> RequestFault:
    """The fault of a request whose own constraints together exclude every token, e.g. a grammar
    that can only end while min_new_tokens still bars EOS."""
    p = request.sampling
    fields = [name for name, active in (
        ("grammar", request.grammar is not None),
        ("min_new_tokens", len(request.generated) < p.min_new_tokens),
        ("bad_words_ids", bool(p.bad_words_ids)),
        ("suppress_tokens", bool(p.suppress_tokens)),
        ("begin_suppress_tokens", bool(p.begin_suppress_tokens) and not request.generated),
        ("logit_bias", bool(p.logit_bias)),
    ) if active] or ["logits_processors"]
    return RequestFault(fields[0], f"no token can be drawn at output position {len(request.generated)}: "
                                   f"{' and '.join(fields)} together exclude every token")


class LogitsProcessing:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._states: dict[str, _RowState] = {}

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _state(self, request: Request, device: torch.device) -> _RowState:
        state = self._states.get(request.request_id)
        if state is not None:
            return state
        p = request.sampling
        state = _RowState()
        state.before, state.after = _history_processors(p, request.eos_token_ids)
        if p.repetition_penalty != 1.0:
            state.seen = set(request.tokens)
        if request.grammar is not None:
            state.grammar = GrammarState(request.grammar)
            for token in request.generated[: request.num_resumed]:  # continued from elsewhere
                state.grammar.accept(token)
            request.grammar_done = state.grammar.matcher.is_terminated()
        if p.presence_penalty or p.frequency_penalty:
            state.counts = {}
            for token in request.generated:  # resumed after a preemption: the output so far counts
                state.counts[token] = state.counts.get(token, 0) + 1
        self._states[request.request_id] = state
        return state

    def observe(self, request: Request, token: int) -> None:
        """A token was appended to the request: its penalties count it from now on."""
        state = self._states.get(request.request_id)
        if state is None:
            return
        if state.seen is not None:
            state.seen.add(token)
        if state.counts is not None:
            state.counts[token] = state.counts.get(token, 0) + 1
        if state.grammar is not None:
            state.grammar.accept(token)
            request.grammar_done = state.grammar.matcher.is_terminated()

    def mask_proposal_rows(self, rows: torch.Tensor, request: Request, draft: list[int]) -> torch.Tensor:
        """A speculating request's rows masked by its grammar (`structured.mask_proposal_rows`)."""
        masked = rows.clone()
        mask_proposal_rows(masked, self._state(request, rows.device).grammar.matcher, draft)
        return masked

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, dict[int, RequestFault]]:
        """Processed logits [rows, vocab] (a new tensor when any row is processed), and the rows
        that cannot go on: their processing raised, or it left no token to draw. Those faults are
        their requests' own: the other rows are processed as if they were alone."""
        rows = [i for i, r in enumerate(requests) if r.sampling.processes_logits or r.grammar is not None]
        if not rows:
            return logits, {}
        try:
            processed, faults = self._process(logits, requests, rows), {}
        except Exception:  # noqa: BLE001 (row by row finds and logs the rows at fault; each alone gives the same values)
            processed, faults = self._row_by_row(logits, requests, rows)
        rows = [i for i in rows if i not in faults]
        if rows:
            blocked = torch.isneginf(processed[rows].amax(dim=-1)).tolist()
            faults.update((i, no_token_left(requests[i])) for i, dead in zip(rows, blocked) if dead)
        return processed, faults

    def _row_by_row(self, logits: torch.Tensor, requests: list[Request],
                    rows: list[int]) -> tuple[torch.Tensor, dict[int, RequestFault]]:
        processed, faults = logits.clone(), {}
        for i in rows:
            try:
                processed[i] = self._process(logits[i : i + 1], [requests[i]], [0])[0]
            except Exception as exc:  # noqa: BLE001 (logged by processing_failed; the row alone fails)
                faults[i] = processing_failed(requests[i], exc)
        return processed, faults

    def _process(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> torch.Tensor:
        logits = logits.clone()
        states = {i: self._state(requests[i], logits.device) for i in rows}
        self._processors(logits, requests, states)
        grammars = {i: state.grammar for i, state in states.items() if state.grammar is not None}
        if grammars:  # last: the drawn token's distribution is over the tokens the grammar allows
            apply_masks(logits, grammars)
        return logits

    def _processors(self, logits: torch.Tensor, requests: list, states: dict[int, _RowState]) -> None:
        """Every processor but the grammar, in place, on rows `states` (row -> its state)."""
        rows = list(states)
        self._history(logits, requests, [(i, states[i].before) for i in rows])
        self._repetition(logits, requests, states)
        self._history(logits, requests, [(i, states[i].after) for i in rows])
        self._barred(logits, requests, rows)
        self._penalties_and_bias(logits, requests, states)

    def process_proposal_rows(self, rows: torch.Tensor, request: Request, draft: list[int]) -> torch.Tensor:
        """A speculating request's rows (its last token's, then each proposal's), each processed as
        if the request had generated the proposals before the row: its penalties count them, its
        history processors read them, min_new_tokens counts them; then its grammar's masks
        (`structured.mask_proposal_rows`)."""
        state = self._state(request, rows.device)
        processed = rows.clone()
        if request.sampling.processes_logits:
            views = [_ProposalView.after(request, draft[:i]) for i in range(len(rows))]
            self._processors(processed, views, {i: state.extended(draft[:i]) for i in range(len(rows))})
        if state.grammar is not None:
            mask_proposal_rows(processed, state.grammar.matcher, draft)
        return processed

    @staticmethod
    def _history(logits: torch.Tensor, requests: list[Request], work: list[tuple[int, list]]) -> None:
        for i, processors in work:
            if processors:
                ids = torch.tensor([requests[i].tokens], device=logits.device)
                row = logits[i : i + 1]
                for processor in processors:
                    row = processor(ids, row)
                logits[i] = row[0]

    @staticmethod
    def _repetition(logits: torch.Tensor, requests: list[Request], states: dict[int, _RowState]) -> None:
        """transformers' formula over the prompt and output tokens: divide positive logits by the
        penalty, multiply negative ones; the seen tokens of every penalized row at once."""
        rows: list[int] = []
        tokens: list[int] = []
        penalties: list[float] = []
        for i, state in states.items():
            if state.seen is not None:
                rows += [i] * len(state.seen)
                tokens += state.seen
                penalties += [requests[i].sampling.repetition_penalty] * len(state.seen)
        if not rows:
            return
        at = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        penalty = torch.tensor(penalties, device=logits.device, dtype=logits.dtype)
        score = logits[at]
        logits[at] = torch.where(score < 0, score * penalty, score / penalty)

    @staticmethod
    def _barred(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """Tokens a row may not take now: EOS and stop tokens before min_new_tokens, suppressed
        tokens, tokens suppressed at the first position; NaN and inf removed when asked."""
        for i in rows:
            r, p = requests[i], requests[i].sampling
            if len(r.generated) < p.min_new_tokens:
                _bar(logits, i, [*r.eos_token_ids, *p.stop_token_ids])
            if p.remove_invalid_values:  # after min_new_tokens, as in transformers: its -inf become finite
                logits[i : i + 1] = InfNanRemoveLogitsProcessor()(None, logits[i : i + 1])
            _bar(logits, i, list(p.suppress_tokens) + (list(p.begin_suppress_tokens) if not r.generated else []))

    @staticmethod
    def _penalties_and_bias(logits: torch.Tensor, requests: list[Request], states: dict[int, _RowState]) -> None:
        """OpenAI's presence and frequency penalties over the output tokens (frequency * count +
        presence, in float32), then logit_bias; each over the tokens concerned, all rows at once."""
        device = logits.device
        at: list[list[int]] = [[], []]
        freq: list[float] = []
        pres: list[float] = []
        counts: list[int] = []
        for i, state in states.items():
            if state.counts:
                p = requests[i].sampling
                at[0] += [i] * len(state.counts)
                at[1] += state.counts
                counts += state.counts.values()
                freq += [p.frequency_penalty] * len(state.counts)
                pres += [p.presence_penalty] * len(state.counts)
        if counts:
            penalty = torch.tensor(freq) * torch.tensor(counts, dtype=torch.float32) + torch.tensor(pres)
            logits.index_put_((torch.tensor(at[0], device=device), torch.tensor(at[1], device=device)),
                              -penalty.to(device=device, dtype=logits.dtype), accumulate=True)
        bias = [(i, t, b) for i in states for t, b in requests[i].sampling.logit_bias]
        if bias:
            rows_tokens = (torch.tensor([i for i, _, _ in bias], device=device),
                           torch.tensor([t for _, t, _ in bias], device=device))
            logits.index_put_(rows_tokens, torch.tensor([b for _, _, b in bias], device=device, dtype=logits.dtype),
                              accumulate=True)
