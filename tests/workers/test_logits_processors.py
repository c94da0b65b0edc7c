"""Logits processing: transformers' GenerationConfig fields give generate()'s tokens and processed
log-probabilities, mixed in batches with requests that use none; vLLM/OpenAI's per-request
controls match a hand-written greedy loop; top logprobs are the real distribution's."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError
from cbserve.workers import validation
from cbserve.workers.factory import build_engine
from tests.support.tiny_models import random_prompts, tiny_model

MAX_NEW = 12
LENGTHS = [1, 5, 17, 40, 90]


@functools.cache
def model():
    return tiny_model("llama")


def run(requests_spec, gc: GenerationConfig, per_request: bool = False):
    """requests_spec: [(prompt, SamplingParams overrides or None)]; greedy, EOS from gc."""
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, max_batch_tokens=32, return_logprobs=True,
                                           per_request_processors=per_request)
    engine = build_engine(model(), gc, cfg)
    try:
        requests = []
        for i, (prompt, options) in enumerate(requests_spec):
            sampling = None
            if options:
                sampling = validation.sampling(engine.default_sampling(), True, engine.shape.vocab_size, **options)
            requests.append(engine.make_request(prompt, f"req_{i}", sampling=sampling))
        for r in requests:
            engine.add_request(r)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return requests


def hf_generate(prompt: list[int], gc: GenerationConfig) -> tuple[list[int], list[float]]:
    """generate() alone on the prompt: tokens and the processed scores' logprobs."""
    out = model().generate(torch.tensor([prompt]), generation_config=gc, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def plain_eos() -> int:
    """A token that greedy decoding emits early for the 17-token prompt: as EOS it stops it soon."""
    prompt = random_prompts(LENGTHS)[2]
    out = model().generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) + 2].item()


HF_FIELDS = [
    {"repetition_penalty": 1.8},
    {"no_repeat_ngram_size": 2},
    {"bad_words_ids": [[7], [20, 21], [100, 101, 102]]},
    {"sequence_bias": {(9,): 4.0, (30, 31): -3.0, (5,): -10.0}},
    {"suppress_tokens": [1, 2, 3, 50, 60]},
    {"begin_suppress_tokens": [10, 11, 12]},
    {"min_new_tokens": 6, "eos_token_id": "plain"},
    {"min_length": 30, "eos_token_id": "plain"},
]


@pytest.mark.parametrize("fields", HF_FIELDS, ids=lambda f: next(iter(f)))
def test_generation_config_field_equals_generate(fields: dict) -> None:
    fields = {k: (plain_eos() if v == "plain" else v) for k, v in fields.items()}
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, **{"eos_token_id": None, **fields})
    prompts = random_prompts(LENGTHS)
    requests = run([(p, None) for p in prompts], gc)
    for request, prompt in zip(requests, prompts):
        tokens, logprobs = hf_generate(prompt, gc)
        assert request.generated == tokens, f"{fields}: prompt of {len(prompt)}"
        assert request.logprobs == pytest.approx(logprobs, abs=1e-5), fields


def test_processed_requests_mixed_with_plain_ones() -> None:
    """Per-request penalties in one batch with plain requests: each gets its own generate()."""
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    penalized = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, repetition_penalty=2.0)
    prompts = random_prompts(LENGTHS + LENGTHS, seed=3)
    spec = [(p, {"repetition_penalty": 2.0} if i % 2 else None) for i, p in enumerate(prompts)]
    requests = run(spec, gc, per_request=True)
    for i, (request, prompt) in enumerate(zip(requests, prompts)):
        tokens, logprobs = hf_generate(prompt, penalized if i % 2 else gc)
        assert request.generated == tokens, i
        assert request.logprobs == pytest.approx(logprobs, abs=1e-5), i


def reference_loop(prompt: list[int], steps: int, eos: set[int], presence: float = 0.0, frequency: float = 0.0,
                   bias: dict[int, float] | None = None, min_tokens: int = 0, ignore_eos: bool = False,
                   stop: set[int] = frozenset()) -> list[int]:
    """Greedy decoding written out from OpenAI's and vLLM's definitions, one full forward a step."""
    tokens, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model()(torch.tensor([tokens])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
        logits -= frequency * counts + presence * (counts > 0).double()
        for t, b in (bias or {}).items():
            logits[t] += b
        if len(out) < min_tokens:
            logits[list(eos | stop)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        tokens.append(token)
        if token in stop or (token in eos and not ignore_eos):
            break
    return out


OPENAI_CASES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.9},
    {"presence_penalty": -1.0, "frequency_penalty": 0.5},
    {"logit_bias": {"17": 5.0, 42: -100, 3: 2.5}},
    {"min_tokens": 8},
    {"ignore_eos": True},
    {"stop_token_ids": "plain"},
]


@pytest.mark.parametrize("options", OPENAI_CASES, ids=lambda o: "+".join(o))
def test_openai_controls_match_their_definition(options: dict) -> None:
    eos = plain_eos()
    options = {k: ([eos] if v == "plain" else v) for k, v in options.items()}
    stop_eos = {} if "stop_token_ids" in options else {"eos_token_id": eos}
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, **{"eos_token_id": None, **stop_eos})
    prompts = random_prompts(LENGTHS)  # the 17-token one (index 2, with options) emits `eos` early
    requests = run([(p, options if i % 2 == 0 else None) for i, p in enumerate(prompts)], gc, per_request=True)
    bias = {int(k): v for k, v in options.get("logit_bias", {}).items()}
    for i, (request, prompt) in enumerate(zip(requests, prompts)):
        o = options if i % 2 == 0 else {}
        expected = reference_loop(prompt, MAX_NEW, set(stop_eos.values()), o.get("presence_penalty", 0.0),
                                  o.get("frequency_penalty", 0.0), bias if o else None, o.get("min_tokens", 0),
                                  o.get("ignore_eos", False), set(o.get("stop_token_ids", ())))
        assert request.generated == expected, (options if o else "plain", len(prompt))
    if {"min_tokens", "ignore_eos", "stop_token_ids"} & set(options):  # (the penalties change other prompts)
        plain = reference_loop(prompts[2], MAX_NEW, set(stop_eos.values()))
        assert requests[2].generated != plain, "the option changed nothing: a vacuous case"


def test_top_logprobs_are_the_distributions_top_tokens() -> None:
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None)
    prompt = random_prompts([23], seed=9)[0]
    [request] = run([(prompt, {"top_logprobs": 20})], gc, per_request=True)
    tokens = list(prompt)
    for token, logprob, top in zip(request.generated, request.logprobs, request.top_logprobs):
        with torch.no_grad():
            ref = torch.log_softmax(model()(torch.tensor([tokens])).logits[0, -1].double(), -1)
        values, ids = ref.topk(20)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert top[0] == (token, pytest.approx(logprob))
        tokens.append(token)


@pytest.mark.parametrize("name, value", [
    ("presence_penalty", 3.0), ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {5: 101}), ("logit_bias", {10**6: 1.0}), ("min_tokens", -1),
    ("ignore_eos", "yes"), ("stop_token_ids", [-1]), ("top_logprobs", 21), ("min_p", 1.5),
])
def test_out_of_range_options_are_refused_naming_the_field(name: str, value) -> None:
    base = cbserve.workers.generation_config.sampling_params(GenerationConfig())
    with pytest.raises(InvalidRequestError) as err:
        validation.sampling(base, True, 256, **{name: value})
    assert err.value.field == name and name in str(err.value)


@pytest.mark.parametrize("field, value", [("num_beams", 4), ("guidance_scale", 2.0), ("typical_p", 0.5),
                                          ("forced_eos_token_id", 3), ("stop_strings", ["\n"])])
def test_unsupported_generation_config_fields_are_refused(field: str, value) -> None:
    gc = GenerationConfig(max_new_tokens=4, **{field: value})
    with pytest.raises(ValueError, match=field):
        build_engine(model(), gc, cbserve.ContinuousBatchingConfig(num_blocks=16, page_size=16))
    assert model().config._attn_implementation == "sdpa"  # refused before the model was touched


def reference_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model()(torch.tensor([prompt])).logits[0].double(), -1)


@pytest.mark.parametrize("max_batch_tokens", [8, 256])  # chunked prefill, and whole prompts
def test_prompt_logprobs_equal_a_full_forward(max_batch_tokens: int) -> None:
    """Each prompt token's logprob given the tokens before it (None for the first), and the top
    pairs, through chunked prefill and when an identical prompt's pages are already cached
    (a request asking for prompt logprobs recomputes its prompt instead of reusing them)."""
    gc = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    shared = random_prompts([70], seed=11)[0]
    prompts = [shared, random_prompts([1], seed=12)[0], shared + [5, 6], shared]
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, max_batch_tokens=max_batch_tokens,
                                           per_request_processors=True)
    engine = build_engine(model(), gc, cfg)
    try:
        requests = []
        for i, prompt in enumerate(prompts):
            options = {"prompt_logprobs": 3} if i != 0 else None  # the first only fills the prefix cache
            sampling = options and validation.sampling(engine.default_sampling(), True, 256, **options)
            requests.append(engine.make_request(prompt, f"req_{i}", sampling=sampling))
            engine.add_request(requests[-1])
            if i == 0:
                while engine.has_work:
                    engine.step()
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    assert engine.stats()["prefix_hit_tokens"] == 0  # the later requests recomputed the shared prompt
    for request, prompt in zip(requests[1:], prompts[1:]):
        ref = reference_prompt_logprobs(prompt)
        expected = [None] + [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
        assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == len(prompt)
        assert request.prompt_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
        for p in range(1, len(prompt)):
            values, ids = ref[p - 1].topk(3)
            assert [v for _, v in request.prompt_top_logprobs[p]] == pytest.approx(values.tolist(), abs=1e-5)
            assert [t for t, _ in request.prompt_top_logprobs[p]] == ids.tolist()
    assert requests[0].prompt_logprobs is None
