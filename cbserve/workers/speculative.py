"""Verification of proposed tokens (speculative decoding): a request's logits rows for its last
token and each proposed one, in, its accepted proposals and one more token, out.

Greedy: proposals are accepted while each equals the argmax of the row before it, then the
argmax of the first row not matched (or of the last row): the tokens greedy decoding gives.
Sampled: the proposer is deterministic (a point mass on each proposed token), so the rejection
rule of speculative sampling (Leviathan et al., 2023; Chen et al., 2023) reads: accept proposal
d with probability p(d), else draw from p with d removed and stop. Each emitted token is then
distributed as the target p at its position, whatever was proposed. p is the row's distribution
after temperature, top-k, top-p and min-p (`sampler.process_logits`); logprobs reported are
log p, the target's.
"""

from __future__ import annotations

import torch

from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import StepResult
from cbserve.workers.sampler import Sampler, min_p_filter, process_logits, top_pairs


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalized probabilities, by inverting the CDF at a uniform draw."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    return int(torch.searchsorted(cdf, u[None], right=True).clamp(max=probs.numel() - 1))


def accept(rows: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """The tokens emitted for `rows` ([1 + len(draft), vocab] float logits: the last token's row,
    then each proposed token's) and the rows' processed logits (the distributions drawn from)."""
    if params.greedy:
        targets = rows.argmax(dim=-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == targets[n]:
            n += 1
        return draft[:n] + [targets[n]], rows
    processed = process_logits(rows, [params] * rows.shape[0])
    if params.min_p > 0:
        processed = min_p_filter(processed, torch.full((rows.shape[0],), params.min_p, dtype=processed.dtype))
    probs = processed.softmax(dim=-1)
    tokens: list[int] = []
    for i, proposed in enumerate(draft):
        if torch.rand((), generator=generator) < probs[i, proposed]:
            tokens.append(proposed)
            continue
        residual = probs[i].clone()
        residual[proposed] = 0.0
        tokens.append(_draw(residual, generator))
        return tokens, processed
    tokens.append(_draw(probs[len(draft)], generator))
    return tokens, processed


def sample_with_drafts(sampler: Sampler, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                       want_logprobs: bool) -> StepResult:
    """The step's `StepResult` when some requests speculated: `logits` has 1 + len(draft) rows per
    request, in order. Those without a draft are sampled by `sampler` as usual; each one with a
    draft gets its accepted proposals and one more token, in a row (`Scheduler.update` takes them)."""
    logits = logits.cpu()
    first = [0]
    for draft in drafts:
        first.append(first[-1] + 1 + len(draft))
    plain = [i for i, d in enumerate(drafts) if not d]
    drawn = sampler(logits[[first[i] for i in plain]], [requests[i] for i in plain], want_logprobs) if plain else None
    by_request = {}
    if drawn is not None:
        for j, request in enumerate(drawn.requests):
            by_request[id(request)] = ([drawn.tokens[j]], [drawn.logprobs[j]] if drawn.logprobs else [None],
                                       [drawn.top_logprobs[j]] if drawn.top_logprobs else [None])
    for i, draft in enumerate(drafts):
        if draft:
            request = requests[i]
            rows = logits[first[i] : first[i + 1]]
            by_request[id(request)] = _verified(rows, draft, request, sampler.generator_of(request), want_logprobs)
    result = StepResult([], [], [], [], drawn.faults if drawn is not None else [])
    for request in requests:
        tokens, logprobs, tops = by_request.get(id(request), ((), (), ()))  # none: faulted, nothing drawn
        for token, logprob, top in zip(tokens, logprobs, tops):
            result.tokens.append(token)
            result.logprobs.append(logprob)
            result.top_logprobs.append(top)
            result.requests.append(request)
    return result


def _verified(rows: torch.Tensor, draft: list[int], request: Request, generator: torch.Generator,
              want_logprobs: bool) -> tuple[list[int], list, list]:
    """A speculating request's tokens, with their logprobs and top pairs under the target's
    distribution (None where not asked)."""
    params = request.sampling
    tokens, processed = accept(rows, draft, params, generator)
    n = len(tokens)
    if not (want_logprobs or params.top_logprobs):
        return tokens, [None] * n, [None] * n
    logprobs = processed[:n].log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
    tops = top_pairs(logprobs, [params.top_logprobs] * n) if params.top_logprobs else [None] * n
    return tokens, chosen, tops
