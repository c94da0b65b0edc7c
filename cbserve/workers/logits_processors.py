"""Per-request logits processing of one step's sampled rows, before the sampler draws.

Each request's `SamplingParams` says which processors it uses; a step applies each processor
to the rows that use it, all rows at once where the processor is elementwise (penalties, bias,
barred tokens), and row by row with `transformers`' own processors where it reads the request's
tokens (sequence bias, no-repeat n-grams, bad words), so those match `generate()` exactly.

Per-request state lives here, keyed by request id, from its first sampled step until `forget`:
which tokens its prompt and output hold (repetition penalty) and how often each output token
came (presence and frequency penalties), its grammar's matcher (structured outputs), updated as
tokens are appended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    InfNanRemoveLogitsProcessor,
    LogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from cbserve.scheduler.request import Request, SamplingParams
from cbserve.workers.structured import GrammarState, apply_masks


@dataclass
class _RowState:
    seen: torch.Tensor | None = None  # bool [vocab]: in the prompt or the output
    counts: torch.Tensor | None = None  # float [vocab]: occurrences in the output
    before: list[LogitsProcessor] = field(default_factory=list)  # transformers' ones ahead of the penalty
    after: list[LogitsProcessor] = field(default_factory=list)  # and behind it
    grammar: GrammarState | None = None  # structured outputs


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
            state.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            state.seen[torch.tensor(request.tokens, device=device)] = True
        if request.grammar is not None:
            state.grammar = GrammarState(request.grammar)
        if p.presence_penalty or p.frequency_penalty:
            state.counts = torch.zeros(self.vocab_size, device=device)
            if request.generated:  # resumed after a preemption: the output so far counts
                state.counts.index_add_(0, torch.tensor(request.generated, device=device),
                                        torch.ones(len(request.generated), device=device))
        self._states[request.request_id] = state
        return state

    def observe(self, request: Request, token: int) -> None:
        """A token was appended to the request: its penalties count it from now on."""
        state = self._states.get(request.request_id)
        if state is None:
            return
        if state.seen is not None:
            state.seen[token] = True
        if state.counts is not None:
            state.counts[token] += 1
        if state.grammar is not None:
            state.grammar.accept(token)
            request.grammar_done = state.grammar.matcher.is_terminated()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Processed logits [rows, vocab] (a new tensor when any row is processed)."""
        rows = [i for i, r in enumerate(requests) if r.sampling.processes_logits or r.grammar is not None]
        if not rows:
            return logits
        logits = logits.clone()
        states = {i: self._state(requests[i], logits.device) for i in rows}
        self._history(logits, requests, [(i, states[i].before) for i in rows])
        self._repetition(logits, requests, states)
        self._history(logits, requests, [(i, states[i].after) for i in rows])
        self._barred(logits, requests, rows)
        self._penalties_and_bias(logits, requests, states)
        grammars = {i: state.grammar for i, state in states.items() if state.grammar is not None}
        if grammars:  # last: the drawn token's distribution is over the tokens the grammar allows
            apply_masks(logits, grammars)
        return logits

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
        penalty, multiply negative ones. All penalized rows at once."""
        rows = [i for i, state in states.items() if state.seen is not None]
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        penalty = torch.tensor([requests[i].sampling.repetition_penalty for i in rows], device=logits.device,
                               dtype=logits.dtype)[:, None]
        score = logits.index_select(0, index)
        penalized = torch.where(score < 0, score * penalty, score / penalty)
        seen = torch.stack([states[i].seen for i in rows])  # type: ignore[misc]
        logits.index_copy_(0, index, torch.where(seen, penalized, score))

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
        """OpenAI's presence and frequency penalties over the output tokens, then logit_bias; all
        rows at once."""
        device = logits.device
        rows = [i for i, state in states.items() if state.counts is not None]
        if rows:
            index = torch.tensor(rows, device=device)
            counts = torch.stack([states[i].counts for i in rows])  # type: ignore[misc]
            freq = torch.tensor([requests[i].sampling.frequency_penalty for i in rows], device=device)[:, None]
            pres = torch.tensor([requests[i].sampling.presence_penalty for i in rows], device=device)[:, None]
            logits.index_copy_(0, index, logits.index_select(0, index) - (freq * counts + pres * (counts > 0)))
        bias = [(i, t, b) for i in states for t, b in requests[i].sampling.logit_bias]
        if bias:
            at = (torch.tensor([i for i, _, _ in bias], device=device), torch.tensor([t for _, t, _ in bias], device=device))
            logits.index_put_(at, torch.tensor([b for _, _, b in bias], device=device, dtype=logits.dtype),
                              accumulate=True)
