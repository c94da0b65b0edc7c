"""Next-token choice from the last logits of each sampled request: its logits processors
(`logits_processors.py`), then greedy, or temperature, top-k, top-p and min-p sampling with an
optional per-request seeded generator; log-probabilities (and the top ones) under the
distribution the token was drawn from."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from cbserve.kernels import cpu_kernels
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import StepResult
from cbserve.workers.logits_processors import LogitsProcessing


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, row by row parameters, all rows at once.
    Rows are assumed sampled (not greedy). Returns processed logits (-inf where removed)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=device)[None, :]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device)[:, None]
        remove = ranks >= k
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already hold top_p of the mass; keep the first.
        mass_before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, device=device, dtype=probs.dtype)[:, None]
        remove |= mass_before >= p
        remove[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    return logits


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' MinPLogitsWarper per row: drop tokens below min_p times the top token's
    probability (the top token is always kept)."""
    probs = logits.softmax(dim=-1)
    remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, float("-inf"))


# Below this many logits a step's sampling runs on one thread: its operations are under a
# millisecond of memory traffic, and on a busy machine a team of threads costs more to gather
# than it saves (2 loaded cores: argmax of 16 x 49,152 logits 6.0 ms on 2 threads, 1.2 ms on 1).
# Above it the threads pay even there (2 quiet cores, 128 x 49,152: argmax 3.4 ms on 1 thread,
# 1.7 ms on 2).
ONE_THREAD_MAX_LOGITS = 1 << 21


@contextlib.contextmanager
def _threads_for(logits: torch.Tensor) -> Iterator[None]:
    """One intra-op thread for a small batch of logits on the CPU (restored afterwards)."""
    threads = torch.get_num_threads()
    if logits.device.type != "cpu" or threads == 1 or logits.numel() > ONE_THREAD_MAX_LOGITS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Sampler:
    """Draws with the engine's generator, or with a request's own when it has a seed: those
    generators live here, keyed by request id, from its first draw until `forget`, as does the
    logits processors' per-request state."""

    def __init__(self, vocab_size: int, seed: int | None = None, greedy_kernel: bool = False) -> None:
        # Greedy rows without top logprobs, float32 logits: argmax and log-probability by a C++
        # kernel (`cpu_kernels.greedy`: 32 x 49,152 logits 1.1 vs 5.7 ms on one thread).
        self.greedy_kernel = greedy_kernel
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._seeded: dict[str, torch.Generator] = {}
        self.processing = LogitsProcessing(vocab_size)

    def generator_of(self, request: Request) -> torch.Generator:
        """The generator `request`'s draws come from: its own when seeded, else the engine's."""
        if request.sampling.seed is None:
            return self.generator
        generator = self._seeded.get(request.request_id)
        if generator is None:
            generator = self._seeded[request.request_id] = torch.Generator().manual_seed(request.sampling.seed)
            for _ in range(request.num_resumed):  # a continued request: the draws its output took elsewhere
                torch.rand((), generator=generator)
        return generator

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, cancelled, failed): drop its state."""
        self._seeded.pop(request_id, None)
        self.processing.forget(request_id)

    def observe(self, request: Request, token: int) -> None:
        self.processing.observe(request, token)

    def __call__(self, logits: torch.Tensor, requests: list[Request], want_logprobs: bool) -> StepResult:
        """logits [rows, vocab] float32, one row per request. One token per row; logprobs when
        `want_logprobs` or a request asks for top logprobs."""
        logits = logits.cpu()
        with _threads_for(logits):
            return self._sample(logits, requests, want_logprobs)

    def _sample(self, logits: torch.Tensor, requests: list[Request], want_logprobs: bool) -> StepResult:
        logits, faults = self.processing(logits, requests)
        if faults:  # a faulted row draws nothing; the others draw as they would without it
            faulted = [(requests[i], fault) for i, fault in sorted(faults.items())]
            keep = [i for i in range(len(requests)) if i not in faults]
            logits, requests = logits[keep], [requests[i] for i in keep]
            result = self._draw(logits, requests, want_logprobs) if requests else StepResult([], None, None)
            result.faults = faulted
            return result
        return self._draw(logits, requests, want_logprobs)

    def _draw(self, logits: torch.Tensor, requests: list[Request], want_logprobs: bool) -> StepResult:
        """Greedy rows without top logprobs through the kernel (when on), the others through
        torch's ops; a row's result never depends on which path its neighbours take."""
        plain = [i for i, r in enumerate(requests) if r.sampling.greedy and not r.sampling.top_logprobs] \
            if self.greedy_kernel and logits.dtype == torch.float32 else []
        if not plain:
            return self._draw_torch(logits, requests, want_logprobs)
        whole = len(plain) == len(requests)
        tokens, chosen = cpu_kernels.greedy(logits if whole else logits[plain], logprobs=want_logprobs)
        tokens, chosen = tokens.tolist(), None if chosen is None else chosen.tolist()
        if whole:
            return StepResult(tokens, chosen, None, requests)
        taken = set(plain)
        rest = [i for i in range(len(requests)) if i not in taken]
        other = self._draw_torch(logits[rest], [requests[i] for i in rest], want_logprobs)
        result = StepResult([0] * len(requests), [0.0] * len(requests) if want_logprobs else None,
                            None if other.top_logprobs is None else [[] for _ in requests], requests)
        for rows, part in ((plain, StepResult(tokens, chosen, None)), (rest, other)):
            for j, i in enumerate(rows):
                result.tokens[i] = part.tokens[j]
                if result.logprobs is not None:
                    result.logprobs[i] = part.logprobs[j]
                if part.top_logprobs is not None:
                    result.top_logprobs[i] = part.top_logprobs[j]
        return result

    def _draw_torch(self, logits: torch.Tensor, requests: list[Request], want_logprobs: bool) -> StepResult:
        params = [r.sampling for r in requests]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        k = max(p.top_logprobs for p in params)
        tokens = logits.argmax(dim=-1)
        processed = logits
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            sub = process_logits(logits[rows], [params[i] for i in sampled_rows])
            if any(params[i].min_p > 0 for i in sampled_rows):
                sub = min_p_filter(sub, torch.tensor([params[i].min_p for i in sampled_rows], dtype=sub.dtype))
            cdf = sub.softmax(dim=-1).cumsum(dim=-1)
            # One uniform draw per row from the row's own generator when seeded, so a seeded
            # request gives the same tokens whatever else shares its batch.
            u = torch.stack([torch.rand((), generator=self.generator_of(requests[i])) for i in sampled_rows])
            picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
            picks = picks.clamp(max=logits.shape[-1] - 1)
            tokens = tokens.index_put((rows,), picks)
            processed = logits.index_put((rows,), sub)
        if not (want_logprobs or k):
            return StepResult(tokens.tolist(), None, None, requests)
        logprobs = processed.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        tops = top_pairs(logprobs, [p.top_logprobs for p in params]) if k else None
        return StepResult(tokens.tolist(), chosen, tops, requests)


def prompt_logprobs(logits: torch.Tensor, chunks: list) -> None:
    """Fill the requests' prompt logprobs from their kept prefill rows (the raw model
    distribution, as vLLM's prompt_logprobs): `chunks` are the runner's `prompt_chunks`, whose
    rows follow each other in `logits`."""
    logprobs = logits.float().cpu().log_softmax(dim=-1)
    row = 0
    for scheduled, first, count in chunks:
        request = scheduled.request
        rows = logprobs[row : row + count]
        targets = torch.tensor(request.prompt_ids[first : first + count])
        request.prompt_logprobs.extend(rows.gather(1, targets[:, None]).squeeze(1).tolist())
        k = request.sampling.prompt_logprobs
        request.prompt_top_logprobs.extend(top_pairs(rows, [k] * count) if k else [[] for _ in range(count)])
        row += count


def top_pairs(logprobs: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]]]:
    """Each row's `counts[row]` most likely (token, logprob) pairs, most likely first."""
    values, ids = logprobs.topk(max(counts), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[r][:n], values[r][:n])) for r, n in enumerate(counts)]
