"""Per-request sampling and logprobs through the manager (SPEC sections 2.3 and 2.5).

Seeded requests give the same tokens alone or in any batch; greedy requests stay equal to
`generate()` beside sampled ones; logprobs are those of the processed distribution, checked
against `transformers`' own logits warpers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cbserve import RequestStatus
from tests.support import manager as test_manager
from tests.support.manager import (
    MakeManager,
    assert_all_pages_free,
    engine_model,
    get,
    ref_model,
    ref_tokens,
    reference,
)
from tests.support.tiny_models import random_prompts

# The manager tests' fixtures: a hang guard (autouse) and managers destroyed after each test.
hang_guard = test_manager.hang_guard
make_manager = test_manager.make_manager

SEEDED = {"temperature": 1.5, "top_k": 50, "top_p": 0.95, "seed": 1234}


def test_seeded_sampling_is_reproducible_and_batch_independent(make_manager: MakeManager) -> None:
    prompt = random_prompts([9], seed=21)[0]
    manager = make_manager(max_new=20, per_request_processors=True)
    alone = get(manager, manager.add_request(prompt, **SEEDED)).generated_tokens
    assert get(manager, manager.add_request(prompt, **SEEDED)).generated_tokens == alone
    assert alone != ref_tokens(prompt, 20)  # it did sample
    other_seed = get(manager, manager.add_request(prompt, **{**SEEDED, "seed": 4321})).generated_tokens
    assert other_seed != alone

    # The same request in a busy batch: unseeded, seeded, greedy neighbours of other lengths.
    others = random_prompts([3, 17, 30, 6, 12, 40], seed=22)
    ids = [manager.add_request(others[0], temperature=1.5),
           manager.add_request(others[1]),
           manager.add_request(others[2], temperature=0.8, seed=7, streaming=True)]
    rid = manager.add_request(prompt, **SEEDED)
    ids += [manager.add_request(others[3], top_k=5), manager.add_request(others[4], temperature=0.0),
            manager.add_request(others[5], temperature=2.0, top_p=0.5, seed=1234)]
    assert get(manager, rid).generated_tokens == alone
    for i in ids:
        while not get(manager, i).is_finished():
            pass
    assert_all_pages_free(manager)
    manager.destroy()

    # Another engine batching differently (4-token pages, chunked prefill, other neighbours).
    manager = make_manager(max_new=20, per_request_processors=True, page_size=4, num_blocks=200,
                           max_batch_tokens=8)
    ids = [manager.add_request(p, temperature=1.0) for p in others[:3]]
    rid = manager.add_request(prompt, **SEEDED)
    assert get(manager, rid).generated_tokens == alone
    for i in ids:
        get(manager, i)
    assert_all_pages_free(manager)


def test_greedy_requests_equal_generate_beside_sampled_ones(make_manager: MakeManager) -> None:
    manager = make_manager(max_new=12, per_request_processors=True, return_logprobs=True, max_batch_tokens=32)
    greedy_prompts = random_prompts([1, 7, 25, 60, 14], seed=31)
    sampled_prompts = random_prompts([5, 40, 9, 33], seed=32)
    greedy_ids, sampled_ids = [], []
    for i, prompt in enumerate(greedy_prompts):
        kwargs = {"temperature": 0.0} if i % 2 else {}  # explicit temperature 0 is greedy too
        greedy_ids.append(manager.add_request(prompt, **kwargs))
        if i < len(sampled_prompts):
            sampled_ids.append(manager.add_request(sampled_prompts[i], temperature=1.2, top_p=0.9,
                                                   seed=i if i % 2 else None))
    for rid, prompt in zip(greedy_ids, greedy_prompts):
        out = get(manager, rid)
        tokens, logprobs = reference(tuple(prompt), 12)
        assert out.generated_tokens == tokens, f"prompt of {len(prompt)}"
        assert out.logprobs == pytest.approx(logprobs, abs=1e-6)
    sampled = [get(manager, rid) for rid in sampled_ids]
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == 12 for o in sampled)
    assert any(o.generated_tokens != ref_tokens(p, 12) for o, p in zip(sampled, sampled_prompts))
    assert_all_pages_free(manager)


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"top_k": 1, "temperature": 2.0},
                                    {"top_k": 1, "seed": 5}, {"top_p": 1e-6, "temperature": 1.5},
                                    {"temperature": 0.0, "top_k": 40}])
def test_top_k_1_and_other_degenerate_sampling_equal_greedy(make_manager: MakeManager, kwargs: dict) -> None:
    manager = make_manager(max_new=10, per_request_processors=True)
    prompts = random_prompts([4, 19, 33], seed=41)
    ids = [manager.add_request(p, **kwargs) for p in prompts]
    for rid, prompt in zip(ids, prompts):
        assert get(manager, rid).generated_tokens == ref_tokens(prompt, 10)
    assert_all_pages_free(manager)


def test_generation_config_sampling_applies_to_every_request(make_manager: MakeManager) -> None:
    """Without per_request_processors the generation config decides: top_k=1 is greedy, and a
    sampling config with an engine seed is reproducible."""
    prompts = random_prompts([6, 21], seed=51)
    gc = GenerationConfig(max_new_tokens=10, do_sample=True, top_k=1, temperature=0.9, eos_token_id=None)
    manager = make_manager(generation_config=gc)
    for prompt in prompts:
        assert get(manager, manager.add_request(prompt)).generated_tokens == ref_tokens(prompt, 10)
    manager.destroy()

    gc = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.5, eos_token_id=None)
    runs = []
    for _ in range(2):
        manager = make_manager(generation_config=gc, seed=99)
        runs.append(get(manager, manager.add_request(prompts[0])).generated_tokens)
        manager.destroy()
    assert runs[0] == runs[1] != ref_tokens(prompts[0], 10)


LOGPROB_CASES = [
    {},  # greedy
    {"temperature": 0.7},
    {"top_k": 10},
    {"top_p": 0.8},
    {"temperature": 1.3, "top_k": 20, "top_p": 0.9},
    {"temperature": 0.5, "top_p": 0.5, "seed": 3},
]


def transformers_logprobs(prompt: list[int], tokens: list[int], case: dict) -> tuple[list[float], list[float]]:
    """Log-probabilities of `tokens` under transformers' processed logits (temperature, then
    top-k, then top-p, as `generate()` orders them), and under the raw logits."""
    model = ref_model("llama", torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    warpers = []
    if case.get("temperature", 1.0) != 1.0:
        warpers.append(TemperatureLogitsWarper(case["temperature"]))
    if case.get("top_k", 0) > 0:
        warpers.append(TopKLogitsWarper(case["top_k"]))
    if case.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(case["top_p"]))
    processed, raw = [], []
    for j, token in enumerate(tokens):
        position = len(prompt) - 1 + j
        scores = logits[position : position + 1]
        context = torch.tensor([prompt + tokens[:j]])
        for warper in warpers:
            scores = warper(context, scores)
        processed.append(scores.log_softmax(-1)[0, token].item())
        raw.append(logits[position].log_softmax(-1)[token].item())
    return processed, raw


def test_logprobs_equal_transformers_processed_logits(make_manager: MakeManager) -> None:
    manager = make_manager(model=engine_model("llama", torch.float32), max_new=12, per_request_processors=True,
                           return_logprobs=True)
    prompts = random_prompts([8, 23, 5, 41, 16, 11], seed=61)
    ids = [manager.add_request(p, **case) for p, case in zip(prompts, LOGPROB_CASES)]  # one batch
    for rid, prompt, case in zip(ids, prompts, LOGPROB_CASES):
        out = get(manager, rid)
        assert len(out.logprobs) == len(out.generated_tokens) == 12
        expected, raw = transformers_logprobs(prompt, out.generated_tokens, case)
        assert all(lp > float("-inf") for lp in expected), f"{case}: a token outside the kept set"
        assert out.logprobs == pytest.approx(expected, abs=1e-4), case
        if not case:  # greedy: also log_softmax of generate()'s own logits
            tokens, logprobs = reference(tuple(prompt), 12, dtype=torch.float32)
            assert out.generated_tokens == tokens
            assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
        elif "top_k" in case or "top_p" in case:  # the processed distribution, not the raw one
            assert sum(e - r for e, r in zip(expected, raw)) > 1e-3, case
    assert_all_pages_free(manager)


def test_logprobs_of_raw_logits_are_caught() -> None:
    """The comparison can fail: raw log-probabilities differ from the processed ones."""
    prompt = random_prompts([8], seed=61)[0]
    tokens = reference(tuple(prompt), 6, dtype=torch.float32)[0]
    expected, raw = transformers_logprobs(prompt, tokens, {"temperature": 0.7, "top_k": 10})
    with pytest.raises(AssertionError):
        assert raw == pytest.approx(expected, abs=1e-4)
