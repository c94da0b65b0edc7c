"""Draft-model proposals for speculative decoding: a smaller model of the same tokenizer
continues every speculating request of a step for a few tokens; the target verifies them in its
own step (`workers/speculative.py`). A greedy request's proposals are the draft's argmax tokens; a
sampled request's are drawn from the draft's distribution q under the request's temperature, top-k,
top-p and min-p, and q goes to the verifier (`distributions`), whose rule accepts with min(1, p / q):
when the draft is close to the target most sampled proposals pass, where argmax proposals would
pass only with the target's probability of each.

The draft runs in an engine of its own (`build_engine`: the same paged attention, packed or
quantized linears and lean forward as the target), on a small paged KV cache. Each request that
speculates has a copy there (a `Request` of the draft engine) whose pages hold the K/V of the
tokens the draft has seen. A round of proposals is k batched passes over all the step's
speculating requests: the first feeds each request's tokens since its last round (the accepted
proposals' K/V are kept, rejected ones are overwritten) and proposes one token, the next k - 1
are one-row decode passes. When the draft's pages run out, the copies of requests that are not
proposing this round give theirs back, least recently used first (they are recomputed if they
speculate again); a request that still does not fit gets no proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from cbserve.config import ContinuousBatchingConfig, SpeculativeConfig
from cbserve.kernels import quantized
from cbserve.scheduler.draft_copies import DraftCopies
from cbserve.scheduler.request import Request
from cbserve.scheduler.scheduler import ScheduledRequest
from cbserve.workers import model_sharing
from cbserve.workers.engine import EngineCore
from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.speculative import draw, target_distribution

# The draft's KV cache takes at most this share of the target's cache bytes (and never holds
# more tokens than the target's).
DRAFT_CACHE_SHARE = 0.25
# A copy of a draft of the target's size catches up at most this many tokens per token its
# request has left (`scheduler/draft_copies.py`); a smaller draft's, more.
MAX_LAG_PER_TOKEN_LEFT = 4


@dataclass
class _Round:
    """One request's proposal in the making."""

    request: Request
    copy: Request  # the draft engine's
    k: int  # tokens to propose
    tokens: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)  # a sampled request's draft distributions


class DraftModelProposer:
    def __init__(self, engine: EngineCore, num_tokens: int, catch_up: float = MAX_LAG_PER_TOKEN_LEFT) -> None:
        """`engine`: the draft model's own (`workers/factory.py` builds it with `load_draft` and
        `draft_engine_config`), whose paged cache, block manager and runner this drives;
        `catch_up`: the most tokens a copy may lag per token its request has left (`catch_up_factor`)."""
        self.engine = engine
        self.num_tokens = num_tokens
        self.copies = DraftCopies(engine.block_manager, catch_up)
        self._probs: dict[str, torch.Tensor] = {}  # a sampled request's last proposal's q rows
        self._seeded: dict[str, torch.Generator] = {}  # a seeded request's draws: reproducible
        self._generator = torch.Generator()
        self._generator.seed()

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """Up to `min(limit, num_speculative_tokens)` tokens to follow each request's tokens."""
        ks = [min(limit, self.num_tokens) for limit in limits]
        proposing = {r.request_id for r, k in zip(requests, ks) if k > 0}
        rounds: dict[int, _Round] = {}  # by id of the draft's copy: requests with pages for this round
        for request, k in zip(requests, ks):
            if k > 0 and (copy := self.copies.sync(request, k, proposing)) is not None:
                rounds[id(copy)] = _Round(request, copy, k)
        active = list(rounds.values())
        while active:  # one pass per proposed position, every request still proposing in it
            batch = [ScheduledRequest(r.copy, len(r.copy.tokens) - r.copy.num_computed, True) for r in active]
            for copy, row in zip(*self._forward(batch)):
                r = rounds[id(copy)]
                r.tokens.append(self._choose(r.request, row, r.q_rows))
                self.copies.advance(copy, r.tokens[-1])
            active = [r for r in active if len(r.tokens) < r.k]
        for r in rounds.values():
            if r.q_rows:
                self._probs[r.request.request_id] = torch.stack(r.q_rows)
            else:
                self._probs.pop(r.request.request_id, None)
        made = {id(r.request): r.tokens for r in rounds.values()}
        return [made.get(id(request), []) for request in requests]

    def _forward(self, batch: list[ScheduledRequest]) -> tuple[list[Request], torch.Tensor]:
        """One pass of the draft engine; its sampled copies in the order of the logits rows."""
        runner = self.engine.runner
        kwargs, sampled = runner.prepare(batch)
        with model_sharing.engine_forward():
            logits = runner.run(kwargs)
        return [s.request for s in sampled], logits

    def _choose(self, request: Request, row: torch.Tensor, q_rows: list[torch.Tensor]) -> int:
        params = request.sampling
        if params.greedy:
            return int(row.argmax())
        q = target_distribution(row[None], params).softmax(dim=-1)[0]
        q_rows.append(q)
        return draw(q, self._generator_of(request))

    def distributions(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    def forget(self, request_id: str) -> None:
        self.copies.forget(request_id)
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


def load_draft(spec: SpeculativeConfig, target: torch.nn.Module) -> torch.nn.Module:
    """The draft `spec.model`, in the target's dtype and device; refused (ValueError naming the
    field) when its vocabulary is not the target's."""
    from cbserve.models import load_model

    param = next(target.parameters())
    try:
        model, _ = load_model(spec.model, dtype=param.dtype)
    except (OSError, ValueError):  # a folder with weights but no tokenizer (the draft needs none)
        model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=param.dtype, local_files_only=True)
    vocab, draft_vocab = target.config.vocab_size, model.config.vocab_size
    if vocab != draft_vocab:
        raise ValueError(f"speculative.model {spec.model!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{vocab}: a draft model must share the target's tokenizer")
    if spec.quantization != "none" and param.device.type != "cpu":
        raise ValueError(f"speculative.quantization={spec.quantization!r} runs on CPUs only (the quantized kernels "
                         "are C++ for x86-64)")
    if spec.quantization == "auto" and getattr(model, quantized.GGUF_SOURCE, None) is None:
        raise ValueError(f"speculative.quantization='auto' needs a GGUF draft (speculative.model {spec.model!r} is "
                         "not a GGUF file): use 'int8', or point speculative.model at a .gguf file")
    return model.to(param.device).eval()


def catch_up_factor(target: Any, draft: Any) -> float:
    """MAX_LAG_PER_TOKEN_LEFT scaled by how much cheaper a token is for the draft than for the
    target (`target`, `draft`: their transformers configs; a layer's cost taken as hidden x
    (hidden + intermediate))."""
    def cost(config: Any) -> int:
        hidden = config.hidden_size
        return config.num_hidden_layers * hidden * (hidden + (getattr(config, "intermediate_size", None) or 4 * hidden))

    return MAX_LAG_PER_TOKEN_LEFT * max(1.0, cost(target) / cost(draft))


def draft_engine_config(config: ContinuousBatchingConfig, draft: torch.nn.Module,
                        cache: PagedKVCache) -> ContinuousBatchingConfig:
    """The draft engine's config: the target's pages, attention and weight packing, the draft's
    `speculative.quantization`; a cache of at most DRAFT_CACHE_SHARE of the target's bytes and
    the target's tokens; no prefix caching (a copy's pages are its own), no CUDA graphs, one rank."""
    from cbserve.workers.model_shape import ModelShape

    shape = ModelShape.from_model(draft)
    param = next(draft.parameters())
    per_block = PagedKVCache.bytes_per_block(shape.num_layers, cache.page_size, shape.num_kv_heads,
                                             shape.head_dim, param.dtype)
    num_blocks = max(1, min(cache.num_blocks, int(cache.nbytes * DRAFT_CACHE_SHARE // per_block)))
    return ContinuousBatchingConfig(
        page_size=cache.page_size, num_blocks=num_blocks, allow_block_sharing=False,
        attention_backend=config.attention_backend, prepack_weights=config.prepack_weights,
        use_cuda_graph=False, use_async_batching=False, batch_invariant=config.batch_invariant,
        auto_switch_to_flash=config.auto_switch_to_flash, quantization=config.speculative.quantization,
    )
