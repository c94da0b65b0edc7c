"""Next-token choice from the last logits of each sampled request: greedy, or temperature,
top-k and top-p sampling with an optional per-request seeded generator; log-probabilities
under the distribution the token was drawn from."""

from __future__ import annotations

import torch

from cbserve.scheduler.request import SamplingParams


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


class Sampler:
    """Draws with the engine's generator, or with a request's own when it has a seed: those
    generators live here, keyed by request id, from its first draw until `forget`."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._seeded: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        generator = self._seeded.get(request_id)
        if generator is None:
            generator = self._seeded[request_id] = torch.Generator().manual_seed(params.seed)
        return generator

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, cancelled, failed): drop its generator."""
        self._seeded.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        want_logprobs: bool,
    ) -> tuple[list[int], list[float] | None]:
        """logits [rows, vocab] float32. Returns one token per row, and its logprob if asked."""
        logits = logits.cpu()
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        processed = logits
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            sub = process_logits(logits[rows], [params[i] for i in sampled_rows])
            cdf = sub.softmax(dim=-1).cumsum(dim=-1)
            # One uniform draw per row from the row's own generator when seeded, so a seeded
            # request gives the same tokens whatever else shares its batch.
            u = torch.stack([torch.rand((), generator=self._generator(request_ids[i], params[i]))
                             for i in sampled_rows])
            picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
            picks = picks.clamp(max=logits.shape[-1] - 1)
            tokens = tokens.index_put((rows,), picks)
            processed = logits.index_put((rows,), sub)
        logprobs = None
        if want_logprobs:
            logprobs = processed.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), logprobs
