"""Verification of proposed tokens (speculative decoding): a request's logits rows for its last
token and each proposed one, in, its accepted proposals and one more token, out.

Greedy: proposals are accepted while each equals the argmax of the row before it, then the
argmax of the first row not matched (or of the last row): the tokens greedy decoding gives.
Sampled: the rejection rule of speculative sampling (Leviathan et al., 2023; Chen et al., 2023):
accept proposal d, drawn from the proposer's distribution q, with probability min(1, p(d) / q(d)),
else draw from max(0, p - q) (normalized) and stop. An n-gram proposal is a point mass (q(d) = 1:
accept with p(d), else draw from p with d removed); a draft model samples its proposals for a
sampled request and hands over its q rows (`distributions`). Each emitted token is then
distributed as the target p at its position, whatever was proposed. p is the row's distribution
after temperature, top-k, top-p and min-p (`target_distribution`); logprobs reported are log p,
the target's.
"""

from __future__ import annotations

import torch

from cbserve.errors import RequestFault
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import StepResult
from cbserve.workers.logits_processors import no_token_left, processing_failed
from cbserve.workers.sampler import Sampler, min_p_filter, process_logits, top_pairs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalized probabilities, by inverting the CDF at a uniform draw."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    return int(torch.searchsorted(cdf, u[None], right=True).clamp(max=probs.numel() - 1))


def target_distribution(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed logits of sampled `rows` (one request's): temperature, top-k, top-p, min-p."""
    processed = process_logits(rows, [params] * rows.shape[0])
    if params.min_p > 0:
        processed = min_p_filter(processed, torch.full((rows.shape[0],), params.min_p, dtype=processed.dtype))
    return processed


def accept(rows: torch.Tensor, draft: list[int], params: SamplingParams, generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """The tokens emitted for `rows` ([1 + len(draft), vocab] float logits: the last token's row,
    then each proposed token's) and the rows' processed logits (the distributions drawn from).
    `draft_probs` ([len(draft), vocab]): the distributions the proposals were drawn from; None:
    point masses."""
    if params.greedy:
        targets = rows.argmax(dim=-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == targets[n]:
            n += 1
        return draft[:n] + [targets[n]], rows
    processed = target_distribution(rows, params)
    probs = processed.softmax(dim=-1)
    q = None if draft_probs is None else draft_probs.to(probs.dtype)
    tokens: list[int] = []
    for i, proposed in enumerate(draft):
        q_d = 1.0 if q is None else q[i, proposed]
        if torch.rand((), generator=generator) * q_d < probs[i, proposed]:  # probability min(1, p / q)
            tokens.append(proposed)
            continue
        if q is None:
            residual = probs[i].clone()
            residual[proposed] = 0.0
        else:
            residual = (probs[i] - q[i]).clamp_min(0.0)
        tokens.append(draw(residual if residual.sum() > 0 else probs[i], generator))  # 0: p = q up to rounding
        return tokens, processed
    tokens.append(draw(probs[len(draft)], generator))
    return tokens, processed


def sample_with_drafts(sampler: Sampler, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                       want_logprobs: bool, draft_probs: list[torch.Tensor | None] | None = None) -> StepResult:
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
    faults = drawn.faults if drawn is not None else []
    for i, draft in enumerate(drafts):
        if draft:
            request = requests[i]
            rows = logits[first[i] : first[i + 1]]
            q = draft_probs[i] if draft_probs else None
            if request.grammar is not None or request.sampling.processes_logits:
                try:
                    rows, draft = _processed(sampler, rows, request, draft)
                except RequestFault as fault:  # its constraints leave no token: it alone fails
                    faults.append((request, fault))
                    continue
                except Exception as exc:  # noqa: BLE001 (the request's own processing: it alone fails)
                    faults.append((request, processing_failed(request, exc)))
                    continue
            by_request[id(request)] = _verified(rows, draft, request, sampler.generator_of(request), want_logprobs, q)
    result = StepResult([], [], [], [], faults)
    for request in requests:
        tokens, logprobs, tops = by_request.get(id(request), ((), (), ()))  # none: faulted, nothing drawn
        for token, logprob, top in zip(tokens, logprobs, tops):
            result.tokens.append(token)
            result.logprobs.append(logprob)
            result.top_logprobs.append(top)
            result.requests.append(request)
    return result


def _processed(sampler: Sampler, rows: torch.Tensor, request: Request,
               draft: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A speculating request's rows through its logits processors and grammar
    (`LogitsProcessing.process_proposal_rows`), and its draft cut before the first row that leaves
    no token (its constraints end there: the row before it is drawn from instead)."""
    processed = sampler.processing.process_proposal_rows(rows, request, draft)
    blocked = torch.isneginf(processed.amax(dim=-1)).tolist()
    if blocked[0]:
        raise no_token_left(request)
    if True in blocked:
        cut = blocked.index(True)
        return processed[:cut], draft[: cut - 1]
    return processed, draft



def _verified(rows: torch.Tensor, draft: list[int], request: Request, generator: torch.Generator,
              want_logprobs: bool, draft_probs: torch.Tensor | None) -> tuple[list[int], list, list]:
    """A speculating request's tokens, with their logprobs and top pairs under the target's
    distribution (None where not asked)."""
    params = request.sampling
    tokens, processed = accept(rows, draft, params, generator, draft_probs)
    n = len(tokens)
    if not (want_logprobs or params.top_logprobs):
        return tokens, [None] * n, [None] * n
    logprobs = processed[:n].log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
    tops = top_pairs(logprobs, [params.top_logprobs] * n) if params.top_logprobs else [None] * n
    return tokens, chosen, tops
