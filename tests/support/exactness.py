"""Engine runs against `model.generate()`: the engine on a list of prompts until done, and the
comparison of its tokens and log-probabilities with each prompt run alone."""

from __future__ import annotations

import functools

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.workers.factory import build_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

MAX_NEW = 10

@functools.cache
def model_for(arch: str):
    return tiny_model(arch)


@functools.cache
def reference(arch: str, lengths: tuple[int, ...], max_new: int) -> list[tuple[list[int], list[float]]]:
    model = model_for(arch)
    return [reference_generate(model, p, max_new) for p in random_prompts(list(lengths))]


def run_engine(model, prompts, cfg: cbserve.ContinuousBatchingConfig, max_new: int = MAX_NEW, setup=None,
               eos_token_id: int | None = None, per_request: list[dict] | None = None):
    """Greedy, EOS ignored unless given; `setup(engine)` runs before the requests are added;
    `per_request[i]`: more `make_request` arguments for prompt i (an adapter, sampling, pooling)."""
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos_token_id)
    engine = build_engine(model, gc, cfg)
    try:
        if setup is not None:
            setup(engine)
        extra = per_request or [{}] * len(prompts)
        requests = [engine.make_request(p, f"req_{i}", **kw) for i, (p, kw) in enumerate(zip(prompts, extra))]
        for r in requests:
            engine.add_request(r)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return requests, engine


def assert_matches_reference(requests, refs, tol: float = 1e-6) -> None:
    for request, (ref_tokens, ref_logprobs) in zip(requests, refs):
        assert request.generated == ref_tokens, f"{request.request_id}: prompt of {len(request.prompt_ids)}"
        assert request.logprobs == pytest.approx(ref_logprobs, abs=tol), request.request_id
