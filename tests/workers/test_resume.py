"""A request continued from another engine (`resume_tokens`, stream migration): its output equals
the undisturbed request's, token for token and logprob for logprob (greedy), draw for draw
(seeded sampling with penalties), and under a grammar; the resumed tokens are not streamed again;
refusals name the field."""

from __future__ import annotations

import functools

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError
from cbserve.workers.structured import StructuredOutputs
from tests.support.tiny_models import random_prompts, tiny_model

MAX_NEW = 24
CFG = {"page_size": 8, "num_blocks": 120, "max_batch_tokens": 64, "return_logprobs": True, "per_request_processors": True}
SAMPLED = {"temperature": 0.9, "top_k": 50, "seed": 1234, "presence_penalty": 0.4, "frequency_penalty": 0.3,
               "repetition_penalty": 1.2}


@functools.cache
def model():
    return tiny_model("llama")


def _run(prompts, max_new: int = MAX_NEW, cfg: dict | None = None, **kwargs):
    """Each (prompt, resume) pair through one manager; returns (final output, streamed tokens) per pair."""
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    results = []
    with cbserve.continuous_batching(model(), gc, cbserve.ContinuousBatchingConfig(**(cfg or CFG))) as manager:
        rids = [manager.add_request(p, streaming=True, resume_tokens=r, **kwargs) for p, r in prompts]
        for rid in rids:
            streamed, final = [], None
            for out in manager.request_id_iter(rid):
                streamed += list(out.new_tokens)
                final = out
            results.append((final, streamed))
    return results


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded-sampled-penalties"])
def test_resumed_output_equals_the_undisturbed_one(sampling: dict) -> None:
    prompts = random_prompts([5, 19, 40])
    whole = _run([(p, None) for p in prompts], **sampling)
    cuts = (1, 9, MAX_NEW - 1)
    pairs = [(p, whole[i][0].generated_tokens[:k]) for i, p in enumerate(prompts) for k in cuts]
    resumed = _run(pairs, **sampling)
    for (out, streamed), (prompt, resume) in zip(resumed, pairs):
        ref = whole[prompts.index(prompt)][0]
        k = len(resume)
        assert out.generated_tokens == ref.generated_tokens, (len(prompt), k)
        assert streamed == ref.generated_tokens[k:], (len(prompt), k)  # the resumed part is not sent again
        assert out.logprobs[k:] == pytest.approx(ref.logprobs[k:], abs=1e-9), (len(prompt), k)


def test_resumed_output_across_preemption() -> None:
    """Few pages: the continued requests are preempted and recomputed like any other."""
    prompts = random_prompts([30, 33, 36, 39])
    tight = {**CFG, "num_blocks": 24}
    whole = _run([(p, None) for p in prompts], cfg=tight)
    resumed = _run([(p, w.generated_tokens[:7]) for p, (w, _) in zip(prompts, whole)], cfg=tight)
    for (out, _), (ref, _) in zip(resumed, whole):
        assert out.generated_tokens == ref.generated_tokens


def test_resumed_output_under_a_grammar() -> None:
    tok = cbserve.load_model(dtype="float32")[1]
    grammar_model = tiny_model("llama", vocab_size=len(tok))
    structured = StructuredOutputs(tok, grammar_model.config.vocab_size, [tok.eos_token_id])
    spec = ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                            "required": ["a", "b"]})
    gc = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id)
    prompt = random_prompts([12], vocab=len(tok))[0]
    with cbserve.continuous_batching(grammar_model, gc, cbserve.ContinuousBatchingConfig(**CFG)) as manager:
        whole = manager.get_result(manager.add_request(prompt, grammar=structured.compile(*spec)), timeout=60)
        k = len(whole.generated_tokens) // 2
        rid = manager.add_request(prompt, grammar=structured.compile(*spec), resume_tokens=whole.generated_tokens[:k])
        resumed = manager.get_result(rid, timeout=60)
        assert resumed.generated_tokens == whole.generated_tokens
        # A continuation its grammar cannot have produced is refused, naming the field.
        with pytest.raises(InvalidRequestError) as err:
            manager.add_request(prompt, grammar=structured.compile(*spec), resume_tokens=tok("zz").input_ids)
        assert err.value.field == "resume_tokens"


def test_refusals_name_the_field() -> None:
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=2)
    with cbserve.continuous_batching(model(), gc, cbserve.ContinuousBatchingConfig(**CFG)) as manager:
        vocab = model().config.vocab_size
        cases = [({"resume_tokens": [1] * 8}, "resume_tokens"),  # nothing left to generate
                 ({"resume_tokens": [vocab]}, "resume_tokens"),
                 ({"resume_tokens": "abc"}, "resume_tokens"),
                 ({"resume_tokens": [5, 2]}, "resume_tokens"),  # ends with EOS: already complete
                 ({"resume_tokens": [5], "prompt_logprobs": 1}, "prompt_logprobs")]
        for kwargs, field in cases:
            with pytest.raises(InvalidRequestError) as err:
                manager.add_request([3, 4, 5], **kwargs)
            assert err.value.field == field, kwargs
