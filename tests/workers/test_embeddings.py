"""Embedding requests (issue 31): the engine pools each prompt's final hidden state, and the
vectors equal transformers' `last_hidden_state` (after the model's last norm) pooled the same way
and L2-normalized, on tiny float64 models, in batches mixed with generating requests (whose tokens
stay `generate()`'s), with prompts longer than a step's token budget (chunked prefill), across
preemptions, through the manager."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError
from cbserve.outputs import FinishReason
from cbserve.workers.factory import build_engine
from cbserve.workers.pooling import Pooling
from tests.support.exactness import MAX_NEW, assert_matches_reference, model_for, reference
from tests.support.tiny_models import random_prompts, reference_generate

LENGTHS = [1, 7, 33, 100, 150]


def reference_embedding(model, prompt: list[int], method: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
        base = model.base_model(torch.tensor([prompt])).last_hidden_state[0]
    assert torch.equal(hidden, base)  # transformers' last hidden state is after the final norm
    pooled = hidden.mean(0) if method == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0)


def run_mixed(model, cfg: cbserve.ContinuousBatchingConfig, method: str, prompts: list[list[int]]):
    """Each prompt twice: an embedding request and a greedy generating one, interleaved."""
    engine = build_engine(model, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None), cfg)
    try:
        requests = []
        for i, p in enumerate(prompts):
            requests.append(engine.make_request(p, f"emb_{i}", pooling=method))
            requests.append(engine.make_request(p, f"gen_{i}"))
        for r in requests:
            engine.add_request(r)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return requests[::2], requests[1::2], engine


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])  # the lean forward, transformers' (a hook)
@pytest.mark.parametrize("method", ["mean", "last"])
def test_pooled_vectors_equal_transformers_in_mixed_chunked_batches(arch: str, method: str) -> None:
    model, prompts = model_for(arch), random_prompts(LENGTHS)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, max_batch_tokens=48, return_logprobs=True, num_blocks=300)
    embeds, gens, engine = run_mixed(model, cfg, method, prompts)
    for request, prompt in zip(embeds, prompts):
        assert request.finish_reason == FinishReason.POOLED and request.generated == []
        got = torch.tensor(request.pooling.embedding, dtype=torch.float64)
        torch.testing.assert_close(got, reference_embedding(model, prompt, method), rtol=0, atol=1e-10)
    assert_matches_reference(gens, reference(arch, tuple(LENGTHS), MAX_NEW))  # generation is unchanged
    assert engine.num_steps > 150 / 48  # the long prompts took several chunks


def test_pooling_survives_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache too small for all: an embedding request is preempted mid-prompt and recomputed; the
    chunk computed again adds nothing twice."""
    model, prompts = model_for("qwen3"), random_prompts(LENGTHS)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=14, max_batch_tokens=64, return_logprobs=True,
                                           allow_block_sharing=False)
    again = []
    positions = Pooling.positions

    def watched(self: Pooling, start: int, count: int) -> range:
        again.append(start < self.num_pooled)
        return positions(self, start, count)

    monkeypatch.setattr(Pooling, "positions", watched)
    embeds, gens, engine = run_mixed(model, cfg, "mean", prompts)
    assert engine.scheduler.num_recomputes > 0 and any(again)
    for request, prompt in zip(embeds, prompts):
        got = torch.tensor(request.pooling.embedding, dtype=torch.float64)
        torch.testing.assert_close(got, reference_embedding(model, prompt, "mean"), rtol=0, atol=1e-10)
    assert_matches_reference(gens, reference("qwen3", tuple(LENGTHS), MAX_NEW))


def test_through_the_manager_and_refusals() -> None:
    model, prompts = model_for("llama"), random_prompts([5, 40])
    gc = GenerationConfig(max_new_tokens=4, do_sample=False)
    manager = cbserve.ContinuousBatchingManager(model, gc, cbserve.ContinuousBatchingConfig(
        page_size=8, num_blocks=64, per_request_processors=True))
    manager.start()
    try:
        ids = [manager.add_request(p, pooling="last") for p in prompts]
        for rid, prompt in zip(ids, prompts):
            out = manager.get_result(rid, timeout=60)
            assert out.is_finished() and out.finish_reason == FinishReason.POOLED and out.generated_tokens == []
            torch.testing.assert_close(torch.tensor(out.embedding, dtype=torch.float64),
                                       reference_embedding(model, prompt, "last"), rtol=0, atol=1e-10)
        with pytest.raises(InvalidRequestError) as err:
            manager.add_request(prompts[0], pooling="max")
        assert err.value.field == "pooling"
        with pytest.raises(InvalidRequestError) as err:  # a prompt longer than the context
            manager.add_request([3] * 1025, pooling="mean")
        assert err.value.field == "input_ids" and "1025" in str(err.value)
        for option in ({"logprobs": True}, {"top_logprobs": 2}):  # of generated tokens: an embedding has none
            with pytest.raises(InvalidRequestError, match="embedding request") as err:
                manager.add_request(prompts[0], pooling="mean", **option)
            assert err.value.field == next(iter(option))
    finally:
        manager.stop()


def test_beside_speculative_decoding() -> None:
    """The generating requests speculate as before; an embedding request is never proposed for
    (a prompt whose last chunk is one token looks like a decode to the scheduler)."""
    segments = [random_prompts([n], seed=4)[0] for n in (12, 30)]  # prompts that repeat themselves
    prompts = [[5]] + [seg + seg[: len(seg) // 2] + seg for seg in segments]  # 1, 30 and 75 tokens
    model = model_for("llama")
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, max_batch_tokens=37, return_logprobs=True, num_blocks=300,
                                           speculative={"num_speculative_tokens": 4, "disable_by_batch_size": None})
    embeds, gens, engine = run_mixed(model, cfg, "last", prompts)
    for request, prompt in zip(embeds, prompts):
        assert request.finish_reason == FinishReason.POOLED and request.generated == []
        assert not request.may_speculate
        torch.testing.assert_close(torch.tensor(request.pooling.embedding, dtype=torch.float64),
                                   reference_embedding(model, prompt, "last"), rtol=0, atol=1e-10)
    assert_matches_reference(gens, [reference_generate(model, p, MAX_NEW) for p in prompts])
    assert engine.scheduler.num_drafts > 0  # the generating requests speculated
