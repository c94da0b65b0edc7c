"""Draft-model proposals for speculative decoding: a smaller model of the same tokenizer
continues each speculating request greedily for a few tokens; the target verifies them in its
own step (`workers/speculative.py`).

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


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, num_tokens: int) -> None:
        self.model = model
        self.num_tokens = num_tokens
        # transformers renamed the forward's past_key_values to cache (the old name deprecated).
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # request id -> (the draft's cache, the token ids whose K/V it holds)
        self._caches: dict[str, tuple[DynamicCache, list[int]]] = {}

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
        feed, proposal = tokens[common:], []
        device = next(self.model.parameters()).device
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([feed], device=device), **{self._cache_arg: cache},
                                use_cache=True, logits_to_keep=1).logits
            proposal.append(int(logits[0, -1].argmax()))
            feed = proposal[-1:]
        self._caches[request.request_id] = (cache, tokens + proposal[:-1])  # the last proposal was not fed
        return proposal

    def forget(self, request_id: str) -> None:
        self._caches.pop(request_id, None)


def _common_prefix(a: list[int], b: list[int], most: int) -> int:
    n = min(len(a), len(b), most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
