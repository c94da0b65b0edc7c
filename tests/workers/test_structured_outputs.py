"""Structured outputs: every constrained output parses and validates (JSON schema, any JSON
object, regex, choice list, grammar), mixed in one batch with unconstrained requests, and a
bad constraint is refused naming its field. Uses the default model's tokenizer (49,152 tokens)."""

from __future__ import annotations

import functools
import json
import re

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError
from cbserve.workers.factory import build_engine
from cbserve.workers.structured import StructuredOutputs
from tests.support.tiny_models import random_prompts, tiny_model

pytestmark = pytest.mark.default_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confident", "level"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confident": {"type": "boolean"},
                         "level": {"type": "string", "pattern": "^[a-c]{2}$"}}}


@functools.cache
def default_model():
    return cbserve.load_model(dtype="float32")  # the JSON test below was checked on float32 outputs


def tokenizer():
    return default_model()[1]


@functools.cache
def random_model():
    """Random weights over the real vocabulary: a constraint must hold whatever the logits."""
    return tiny_model("llama", vocab_size=len(tokenizer()))


def constrained_run(specs, max_new: int = 40, proposer=None):
    """`proposer`: speculative decoding with these proposals."""
    model = random_model()
    eos = tokenizer().eos_token_id
    structured = StructuredOutputs(tokenizer(), model.config.vocab_size, [eos])
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
    spec = {"num_speculative_tokens": 4, "disable_by_batch_size": None} if proposer is not None else None
    engine = build_engine(model, gc, cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=400,
                                                                      return_logprobs=True, speculative=spec))
    if proposer is not None:
        engine.scheduler.proposer = proposer
    prompts = random_prompts([5, 30, 12, 50, 8, 21], vocab=len(tokenizer()))
    try:
        requests = [engine.make_request(prompts[i % len(prompts)], f"req_{i}",
                                        grammar=None if spec is None else structured.compile(*spec))
                    for i, spec in enumerate(specs)]
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return requests


def text(request) -> str:
    return tokenizer().decode(request.generated, skip_special_tokens=True)


def test_constrained_outputs_parse_and_validate_beside_free_ones() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    specs = [("json_schema", SCHEMA), None, ("regex", r"[0-9]{3}-[a-z]{2}"), ("choice", ["red", "green", "blue"]),
             None, ("grammar", 'root ::= "(" [a-z]{1,3} ("," [a-z]{1,3}){0,2} ")"'), ("json_schema", json.dumps(SCHEMA))]
    requests = constrained_run(specs)
    for request, spec in zip(requests, specs):
        if spec is None:
            continue
        assert request.finish_reason in (cbserve.FinishReason.EOS, cbserve.FinishReason.STOP), (spec[0], text(request))
        out = text(request)
        if spec[0] == "json_schema":
            jsonschema.validate(json.loads(out), SCHEMA)
        elif spec[0] == "regex":
            assert re.fullmatch(spec[1], out), out
        elif spec[0] == "choice":
            assert out in spec[1]
        else:
            assert re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3}){0,2}\)", out), out
    free = [r for r, s in zip(requests, specs) if s is None]
    assert all(r.finish_reason == cbserve.FinishReason.LENGTH for r in free)  # random weights ramble


class _OracleProposer:
    """Proposes what the run without speculation drew next, but for one token in three (by
    position), replaced by "@", which none of the test's grammars allows anywhere."""

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference, self.bad = reference, tokenizer().convert_tokens_to_ids("@")

    def propose(self, requests, limits):
        out = []
        for r, limit in zip(requests, limits):
            g = len(r.generated)
            out.append([self.bad if (g + i) % 3 == 2 else t for i, t in enumerate(self.reference[r.request_id][g : g + limit])])
        return out

    def distributions(self, request_id):
        return None

    def forget(self, request_id):
        pass


def test_speculation_masks_each_proposed_row_by_the_grammar() -> None:
    """Constrained requests speculate: each proposal's row is masked by the grammar after the
    proposals before it, a proposal the grammar refuses is rejected, and tokens and logprobs are
    those of the run without speculation."""
    specs = [("json_schema", SCHEMA), None, ("regex", r"[0-9]{3}-[a-z]{2}"), ("choice", ["red", "green", "blue"]),
             ("grammar", 'root ::= "(" [a-z]{1,3} ("," [a-z]{1,3}){0,2} ")"')]
    plain = constrained_run(specs)
    oracle = _OracleProposer({r.request_id: r.generated for r in plain})
    speculated = constrained_run(specs, proposer=oracle)
    for a, b in zip(plain, speculated):
        assert b.generated == a.generated, b.request_id
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-6), b.request_id
        assert b.finish_reason == a.finish_reason
    assert not any(oracle.bad in r.generated for r in speculated)


def test_an_objects_keys_come_in_the_schemas_order() -> None:
    """As OpenAI's structured outputs write them (a forced tool call's name before its arguments:
    the name streams first)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["zone", "answer"],
              "properties": {"zone": {"enum": ["utc"]}, "answer": {"type": "boolean"}}}
    [request] = constrained_run([("json_schema", schema)])
    assert list(json.loads(text(request))) == ["zone", "answer"]


def test_json_object_from_the_default_model() -> None:
    model, tok = default_model()
    structured = StructuredOutputs(tok, model.config.vocab_size, [tok.eos_token_id])
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a cat as a JSON object."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    gc = GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=tok.eos_token_id)
    engine = build_engine(model, gc, cbserve.ContinuousBatchingConfig(page_size=64, num_blocks=32))
    try:
        request = engine.make_request(prompt, "cat", grammar=structured.compile("json_object", None))
        engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    assert request.finish_reason in (cbserve.FinishReason.EOS, cbserve.FinishReason.STOP), tok.decode(request.generated)
    assert isinstance(json.loads(tok.decode(request.generated, skip_special_tokens=True)), dict)


@pytest.mark.parametrize("kind, spec", [("json_schema", "{not json"), ("regex", "(unclosed"), ("choice", []),
                                        ("grammar", "root ::= ("), ("xml", "<a/>")])
def test_a_bad_constraint_is_refused_naming_its_field(kind: str, spec) -> None:
    structured = StructuredOutputs(tokenizer(), len(tokenizer()))
    with pytest.raises(InvalidRequestError) as err:
        structured.compile(kind, spec)
    assert err.value.field == "response_format"


def test_through_the_manager() -> None:
    model = random_model()
    structured = StructuredOutputs(tokenizer(), model.config.vocab_size, [tokenizer().eos_token_id])
    gc = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=tokenizer().eos_token_id)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=64)
    with cbserve.continuous_batching(model, gc, cfg) as manager:
        rid = manager.add_request(random_prompts([9], vocab=len(tokenizer()))[0],
                                  grammar=structured.compile("choice", ["left", "right"]))
        out = manager.get_result(rid, timeout=60)
    assert tokenizer().decode(out.generated_tokens, skip_special_tokens=True) in ("left", "right")


# ---- the serving path (issue 26): refusals reach the client as a 400 naming the field ----------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """The OpenAI service on a manager in this process (the replica's request path), tiny model."""
    import asyncio

    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.api_errors import refusal
    from cbserve.serving.constraints import Grammars
    from cbserve.serving.front.openai_service import OpenAIService
    from cbserve.serving.front.replies import ChoiceStream
    from cbserve.serving.replica.generation import ModelInfo, run_request
    from tests.support.cluster import running_manager, tiny_model_dir

    folder = tiny_model_dir(tmp_path_factory)
    model, tok = cbserve.load_model(str(folder), dtype="float32")
    eos = model.config.eos_token_id
    config = cbserve.ContinuousBatchingConfig(grammar_max_nesting=16)
    info = ModelInfo(eos_token_id=eos, max_context=512, default_max_tokens=16,
                     grammars=Grammars(tok, model.config.vocab_size, eos, config))

    with running_manager(model) as manager:
        async def open_choice(wreq):
            gen = run_request(manager, tok, info, wreq, "local")
            first = await gen.__anext__()
            if first.kind == "error":
                raise refusal(first)
            return ChoiceStream(start=first, events=gen, cancel=lambda: asyncio.ensure_future(gen.aclose()))

        args = ClusterArgs(model=str(folder), served_model_name="tiny", limits={"max_tokens": 64, "max_n": 2})
        yield OpenAIService(args, open_choice)


def served_completion(service, **body):
    import asyncio

    from cbserve.serving.front.json_body import parse_request
    from cbserve.serving.front.schemas import CompletionRequest

    req = parse_request(json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 12, **body}).encode(),
                        CompletionRequest)
    return asyncio.run(service.complete(req))


@pytest.mark.parametrize("body, param, text", [
    ({"guided_choice": ["yes"], "min_tokens": 8}, "min_tokens", "min_tokens (8) and guided_choice cannot both hold"),
    ({"guided_regex": "(yes|no)", "min_tokens": 4}, "min_tokens", "min_tokens (4) and guided_regex cannot both hold"),
    ({"guided_json": json.loads('{"type": "array", "items": ' * 20 + "{}" + "}" * 20)}, "guided_json",
     "21 levels deep; at most 16 (grammar_max_nesting)"),
])
def test_a_refused_constraint_is_a_400_naming_its_field_on_the_serving_path(served, body, param, text) -> None:
    from cbserve.serving.api_errors import APIError

    with pytest.raises(APIError) as err:
        served_completion(served, **body)
    assert err.value.status == 400 and err.value.param == param and text in err.value.message
    feasible = served_completion(served, guided_choice=["yes", "abcdefgh"], min_tokens=3).body.model_dump()
    assert feasible["choices"][0]["text"] in ("yes", "abcdefgh")
