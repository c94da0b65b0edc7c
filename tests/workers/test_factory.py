"""The engine factory wires the engine's parts (issue 27): one cache under the scheduler's block
manager and the runner, the host pool over that cache, the sampler sized to the model; an
`EngineCore` steps with whatever parts it is given, so a part can be replaced in a test."""

from __future__ import annotations

from transformers import GenerationConfig

import cbserve
from cbserve.scheduler.scheduler import StepResult
from cbserve.workers.engine import EngineCore
from cbserve.workers.factory import build_engine, build_parts
from cbserve.workers.sizing import Workload
from tests.support.exactness import assert_matches_reference
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

GREEDY = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None)


def config(**overrides) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=64, **overrides)


def test_build_engine_wires_one_cache_through_every_part() -> None:
    model = tiny_model("llama")
    engine = build_engine(model, GREEDY, config(cpu_offload_space=0.01), Workload(num_requests=3))
    try:
        assert engine.runner.cache is engine.cache
        assert engine.scheduler.block_manager is engine.block_manager
        assert engine.block_manager.num_blocks == engine.cache.num_blocks == 48
        assert engine.host_pool is not None and engine.host_pool.cache is engine.cache
        assert engine.scheduler.host_pages is not None
        assert engine.scheduler.max_requests == 3  # the workload's hint reached the scheduler
        assert engine.sampler.processing.vocab_size == model.config.vocab_size
        assert engine.runner.forward.model is model
        assert model.config._attn_implementation == "cbserve_paged"  # the engine holds the model
    finally:
        engine.release_model()
    assert model.config._attn_implementation != "cbserve_paged"


class RecordingSampler:
    """A stand-in part: the real sampler, with every step's result kept."""

    def __init__(self, sampler) -> None:
        self.sampler, self.results = sampler, []

    def __call__(self, logits, requests, want_logprobs) -> StepResult:
        result = self.sampler(logits, requests, want_logprobs)
        self.results.append([(r.request_id, t) for r, t in zip(result.requests, result.tokens, strict=True)])
        return result

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_an_engine_steps_with_the_parts_it_is_given() -> None:
    model = tiny_model("llama")
    cfg = config(return_logprobs=True)
    parts = build_parts(model, cfg, Workload())
    parts.sampler = RecordingSampler(parts.sampler)
    engine = EngineCore(model, GREEDY, cfg, parts)
    prompts = random_prompts([9, 30], seed=4)
    try:
        requests = [engine.make_request(p, f"r{i}") for i, p in enumerate(prompts)]
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    refs = [reference_generate(tiny_model("llama"), p, GREEDY.max_new_tokens) for p in prompts]
    assert_matches_reference(requests, refs)
    for request, (expected, _) in zip(requests, refs, strict=True):
        recorded = [t for step in parts.sampler.results for rid, t in step if rid == request.request_id]
        assert recorded == expected  # every token came through the part the engine was given
