"""bfloat16 models through the engine's CPU path (weights packed for the bfloat16 linear kernel,
bfloat16 KV pages read by the C++ attention kernel) stay close to `transformers`' own bfloat16
`generate()`, by vLLM's `check_logprobs_close` rule: at the first position where the greedy
tokens differ, each side's token must be among the other's top-5 log-probabilities (after that the
sequences diverge and are not compared). A deliberately broken kernel fails the rule."""

from __future__ import annotations

import pytest
import torch

import cbserve
from cbserve.kernels import cpu_isa, cpu_kernels, packed_linear
from tests.support.exactness import run_engine
from tests.support.tiny_models import random_prompts, tiny_model

TOP = 5
MAX_NEW = 24
LENGTHS = [3, 9, 17, 30, 41, 64, 77, 100, 128, 150, 200, 260]  # 12 prompts

Output = tuple[list[int], list[dict[int, float]]]  # greedy tokens, top-5 {token: logprob} per step


def top_logprobs(logits: torch.Tensor) -> dict[int, float]:
    values, ids = torch.log_softmax(logits.float(), -1).topk(TOP)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


def check_logprobs_close(outputs_0: list[Output], outputs_1: list[Output], name_0: str, name_1: str) -> int:
    """vLLM's rule (tests/models/utils.py); returns how many prompts' tokens differ somewhere."""
    mismatched = 0
    for i, ((ids_0, lp_0), (ids_1, lp_1)) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        for idx, (id_0, id_1) in enumerate(zip(ids_0, ids_1)):
            if id_0 != id_1:
                msg = f"prompt {i}, token {idx}: {name_0} {id_0} (top {lp_0[idx]}) vs {name_1} {id_1} (top {lp_1[idx]})"
                assert id_0 in lp_1[idx], msg
                assert id_1 in lp_0[idx], msg
                mismatched += 1
                break  # the sequences diverge from here
    return mismatched


def generate_alone(model, prompt: list[int], max_new: int) -> Output:
    """`transformers`' own greedy `generate()` on this prompt alone, in the model's dtype."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [top_logprobs(step[0]) for step in out.logits]


def engine_outputs(model, prompts: list[list[int]], max_new: int, **config) -> tuple[list[Output], object]:
    """cbserve's greedy tokens, and the top-5 of the logits each token was sampled from."""
    tops: dict[str, list[dict[int, float]]] = {}

    def record(engine) -> None:
        engine.linear_kinds = {(m.kind, m.isa) for m in engine.model.modules()
                               if isinstance(m, packed_linear.PackedLinear)}
        prepare, run = engine.runner.prepare, engine.runner.run
        order: list[str] = []

        def recording_prepare(batch, *args):
            kwargs, sampled = prepare(batch, *args)
            order[:] = [s.request.request_id for s in sampled]
            return kwargs, sampled

        def recording_run(kwargs):
            logits = run(kwargs)
            for rid, row in zip(order, logits, strict=True):
                tops.setdefault(rid, []).append(top_logprobs(row))
            return logits

        engine.runner.prepare, engine.runner.run = recording_prepare, recording_run

    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, max_batch_tokens=96, **config)
    requests, engine = run_engine(model, prompts, cfg, max_new, record)
    return [(r.generated, tops[r.request_id]) for r in requests], engine


def bf16_paths() -> list:
    """The instruction-set paths to force: the CPU's best, and the float32-only ones below it
    (bfloat16 then goes through oneDNN's linear kernel and the widening attention path)."""
    return [pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        bool(cpu_isa.why_not(isa)), reason=f"the {isa} path cannot run here: {cpu_isa.why_not(isa)}"))
        for isa in ("avx512_bf16", "avx512", "avx2")]


@pytest.fixture(scope="module")
def references() -> dict[str, list[Output]]:
    refs = {}
    for arch in ("llama", "qwen3"):
        model = tiny_model(arch, dtype=torch.bfloat16)
        with torch.inference_mode():
            refs[arch] = [generate_alone(model, p, MAX_NEW) for p in random_prompts(LENGTHS)]
    return refs


@pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason=f"no C++ kernels: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("isa", bf16_paths())
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_engine_is_close_to_bf16_generate(arch: str, isa: str, references, monkeypatch) -> None:
    monkeypatch.setenv(cpu_isa.ISA_ENV, isa)
    model = tiny_model(arch, dtype=torch.bfloat16)
    outputs, engine = engine_outputs(model, random_prompts(LENGTHS), MAX_NEW)
    # The bfloat16 CPU path really ran: packed weights (our kernel where it has a bfloat16 path) and
    # the C++ attention kernel on bfloat16 pages.
    assert engine.attention_backend == "cpu" and engine.cache.k[0].dtype == torch.bfloat16
    # Our kernel's bfloat16 path, else oneDNN's where this CPU gives it bfloat16 (not on AVX2-only
    # CPUs: there nothing is packed and the weights stay plain `F.linear` ones).
    if isa == "avx512_bf16":
        expected = {("cbserve", "avx512_bf16")}
    elif torch.ops.mkldnn._is_mkldnn_bf16_supported():
        expected = {("onednn", None)}
    else:
        expected = set()
    assert engine.linear_kinds == expected, "bfloat16 weights were not packed for the expected kernel"
    mismatched = check_logprobs_close(outputs, references[arch], "cbserve", "generate()")
    assert mismatched <= len(LENGTHS) // 2, f"{mismatched}/{len(LENGTHS)} prompts diverge"


@pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason=f"no C++ kernels: {cpu_kernels.unavailable_reason()}")
def test_the_rule_catches_a_broken_kernel(references, monkeypatch) -> None:
    """Attention with a wrong scale in the decode kernel: tokens leave each other's top-5."""
    kernel = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention",
                        lambda q, k, v, t, lens, scale, *a, **kw: kernel(q, k, v, t, lens, scale * 4, *a, **kw))
    model = tiny_model("llama", dtype=torch.bfloat16)
    outputs, _ = engine_outputs(model, random_prompts(LENGTHS), MAX_NEW)
    with pytest.raises(AssertionError):
        check_logprobs_close(outputs, references["llama"], "cbserve", "generate()")


CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain continuous batching in one sentence.",
    "List three primary colors.", "What is 12 times 7?", "Translate 'good morning' into Spanish.",
    "Name a famous physicist and one discovery.", "Give me a tip for learning to cook.",
    "What does a CPU cache do?", "Describe a cat in five words.", "Why is the sky blue?",
    "Suggest a name for a pet goldfish.",
]


@pytest.mark.default_model
@pytest.mark.skipif(not cpu_isa.native_bf16(), reason="bfloat16 is the auto dtype only on CPUs with native "
                    "bfloat16 dot products; this one has none")
def test_default_model_bf16_is_close_to_generate() -> None:
    from cbserve.__main__ import chat_prompt_ids
    from cbserve.models import load_model

    model, tokenizer = load_model()  # dtype="auto": bfloat16 here
    assert model.dtype == torch.bfloat16
    prompts = [chat_prompt_ids(tokenizer, p) for p in CHAT_PROMPTS]
    with torch.inference_mode():
        references = [generate_alone(model, p, 32) for p in prompts]
    outputs, engine = engine_outputs(model, prompts, 32)
    assert engine.linear_kinds == {("cbserve", "avx512_bf16")}
    # Real text has near-ties, and bfloat16 logits are rounded to 8 bits (ties are frequent): most
    # prompts' greedy tokens part somewhere in 32 tokens (generate() in bfloat16 vs float32 does too,
    # 8/12 on a Zen 5), so the rule alone decides.
    check_logprobs_close(outputs, references, "cbserve", "generate()")
