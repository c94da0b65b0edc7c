"""Draft-model proposals for speculative decoding: a smaller model of the same tokenizer
continues each speculating request for a few tokens; the target verifies them in its own step
(`workers/speculative.py`). A greedy request's proposals are the draft's argmax tokens; a sampled
request's are drawn from the draft's distribution q under the request's temperature, top-k, top-p
and min-p, and q goes to the verifier (`distributions`), whose rule accepts with min(1, p / q):
when the draft is close to the target most sampled proposals pass, where argmax proposals would
pass only with the target's probability of each.

The draft keeps a `transformers` KV cache per request, beside the engine's paged cache (small:
a draft model's layers and few requests, speculation being off from `disable_by_batch_size`
decoding requests up). Each proposal first brings that cache up to the request's verified tokens:
entries of proposals the target accepted stay, the rest are cropped. Requests are proposed for
one after another (a draft step is a few small matrix-vector products).
"""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cbserve.config import SpeculativeConfig
from cbserve.scheduler.request import Request
from cbserve.workers.speculative import draw, target_distribution


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, num_tokens: int) -> None:
        self.model = model
        self.num_tokens = num_tokens
        # transformers renamed the forward's past_key_values to cache (the old name deprecated).
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # request id -> (the draft's cache, the token ids whose K/V it holds)
        self._caches: dict[str, tuple[DynamicCache, list[int]]] = {}
        self._probs: dict[str, torch.Tensor] = {}  # a sampled request's last proposal's q rows
        self._seeded: dict[str, torch.Generator] = {}  # a seeded request's draws: reproducible
        self._generator = torch.Generator()
        self._generator.seed()

    @classmethod
    def load(cls, config: SpeculativeConfig, target: torch.nn.Module) -> DraftModelProposer:
        """The draft `config.model`, in the target's dtype and device; refused (ValueError naming the
        field) when its vocabulary is not the target's."""
        from cbserve.models import load_model

        param = next(target.parameters())
        try:
            model, _ = load_model(config.model, dtype=param.dtype)
        except (OSError, ValueError):  # a folder with weights but no tokenizer (the draft needs none)
            model = AutoModelForCausalLM.from_pretrained(config.model, dtype=param.dtype, local_files_only=True)
        vocab, draft_vocab = target.config.vocab_size, model.config.vocab_size
        if vocab != draft_vocab:
            raise ValueError(f"speculative.model {config.model!r} has a vocabulary of {draft_vocab} tokens, the target "
                             f"{vocab}: a draft model must share the target's tokenizer")
        return cls(model.to(param.device).eval(), config.num_speculative_tokens)

    @torch.inference_mode()
    def propose(self, request: Request, limit: int) -> list[int]:
        k = min(limit, self.num_tokens)
        if k <= 0:
            return []
        tokens = request.tokens
        cache, held = self._caches.get(request.request_id, (None, []))
        if cache is None:
            cache, common = DynamicCache(), 0
        else:
            common = _common_prefix(held, tokens, len(tokens) - 1)  # the last token is always fed
            if common < len(held):
                cache.crop(common - len(held))  # a negative count: that many entries dropped from the end
        feed, proposal, rows = tokens[common:], [], []
        device = next(self.model.parameters()).device
        params = request.sampling
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([feed], device=device), **{self._cache_arg: cache},
                                use_cache=True, logits_to_keep=1).logits[0, -1:]
            if params.greedy:
                proposal.append(int(logits.argmax()))
            else:
                q = target_distribution(logits.cpu() if logits.dtype == torch.float64 else logits.float().cpu(),
                                        params).softmax(dim=-1)[0]
                proposal.append(draw(q, self._generator_of(request)))
                rows.append(q)
            feed = proposal[-1:]
        self._caches[request.request_id] = (cache, tokens + proposal[:-1])  # the last proposal was not fed
        if rows:
            self._probs[request.request_id] = torch.stack(rows)
        else:
            self._probs.pop(request.request_id, None)
        return proposal

    def distributions(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    def forget(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
        self._probs.pop(request_id, None)
        self._seeded.pop(request_id, None)

    def _generator_of(self, request: Request) -> torch.Generator:
        """A seeded request's proposals come from a generator of its own (seeded apart from the
        target's draws), so its output is reproducible; the others share one."""
        seed = request.sampling.seed
        if seed is None:
            return self._generator
        if request.request_id not in self._seeded:
            self._seeded[request.request_id] = torch.Generator().manual_seed((seed + 0x5EED) % 2**63)
        return self._seeded[request.request_id]


def _common_prefix(a: list[int], b: list[int], most: int) -> int:
    n = min(len(a), len(b), most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
