"""Batch invariance: with `ContinuousBatchingConfig(batch_invariant=True)` (and by default, None,
which runs the same kernels on a CPU) a request's tokens and log-probabilities are bitwise the same
whatever else shares its batches: alone, first or last among others, with its prefill split into
chunks next to other requests' decode rows, with its prefix served from the cache, in float32 and
bfloat16. `batch_invariant=False` (SDPA for prefill chunks on a path without the tiled kernel) is
shown to differ, so the comparison has teeth."""

from __future__ import annotations

import pytest
import torch

import cbserve
from cbserve.kernels import attention_backends, cpu_isa, cpu_kernels, packed_linear
from tests.support.exactness import run_engine
from tests.support.tiny_models import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()),
                                reason=f"no C++ CPU kernels: {cpu_kernels.unavailable_reason()}")

MAX_NEW = 12
TARGET_LEN = 45
OTHERS = [3, 70, 16, 33, 120, 9, 57]


def config(invariant: bool | None = True, **overrides) -> cbserve.ContinuousBatchingConfig:
    settings = {"page_size": 16, "num_blocks": 160, "max_batch_tokens": 256, "return_logprobs": True,
                "batch_invariant": invariant, **overrides}
    return cbserve.ContinuousBatchingConfig(**settings)


def target_and_others(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    prompts = random_prompts([TARGET_LEN, *OTHERS], seed=seed)
    return prompts[0], prompts[1:]


def run_target(model, prompts: list[list[int]], index: int, cfg, setup=None) -> tuple[list[int], list[float]]:
    requests, _ = run_engine(model, prompts, cfg, MAX_NEW, setup)
    return requests[index].generated, requests[index].logprobs


def scenarios(target: list[int], others: list[list[int]]) -> dict[str, tuple[list[list[int]], int, dict]]:
    """name -> (prompts, index of the target, config overrides). The first is the target alone."""
    shared = target[:32] + random_prompts([20], seed=9)[0]  # two full pages in common with the target
    return {
        "alone": ([target], 0, {}),
        "first of 8": ([target, *others], 0, {}),
        "last of 8": ([*others, target], len(others), {}),
        "middle, 7-token chunks": ([*others[:3], target, *others[3:]], 3, {"max_batch_tokens": 7}),
        "chunks of 40 next to decodes": ([*others, target], len(others), {"max_batch_tokens": 40}),
        "prefix cached": ([shared, *others[:2], target], 3, {"max_batch_tokens": 64}),
        "one request per step": ([*others[:2], target], 2, {"max_requests_per_batch": 1}),
    }


def outcomes(model, invariant: bool | None) -> dict[str, tuple[list[int], list[float]]]:
    target, others = target_and_others()
    results = {}
    for name, (prompts, index, overrides) in scenarios(target, others).items():
        results[name] = run_target(model, prompts, index, config(invariant, **overrides))
    return results


@pytest.mark.parametrize("invariant", [True, None], ids=["batch_invariant", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_request_is_bitwise_the_same_in_any_batch(arch: str, dtype: torch.dtype, invariant: bool | None) -> None:
    if dtype == torch.bfloat16 and packed_linear.kernel(torch.bfloat16) != "cbserve":
        pytest.skip(f"no bfloat16 C++ linear kernel on this CPU ({cpu_isa.selected()})")
    if invariant is None and arch == "qwen3":
        pytest.skip("the default's kernels are those of batch_invariant=True: one architecture shows it")
    if invariant is None and dtype == torch.bfloat16 and cpu_isa.has_amx_bf16():
        pytest.skip("with AMX the default runs bfloat16 GEMMs of 4+ rows and prefill attention on oneDNN and SDPA "
                    "(AMX tiles), whose reduction order follows the batch: only batch_invariant=True promises this")
    model = tiny_model(arch, dtype=dtype)
    results = outcomes(model, invariant)
    alone_tokens, alone_logprobs = results["alone"]
    assert len(alone_tokens) == MAX_NEW
    for name, (tokens, logprobs) in results.items():
        assert tokens == alone_tokens, name
        assert logprobs == alone_logprobs, f"{name}: logprobs differ (bitwise)"


def test_prefix_hits_happen() -> None:
    """The prefix-cached scenario really serves the target's first pages from the cache."""
    model = tiny_model("llama", dtype=torch.float32)
    target, others = target_and_others()
    prompts, _, overrides = scenarios(target, others)["prefix cached"]
    _, engine = run_engine(model, prompts, config(**overrides), MAX_NEW)
    assert engine.scheduler.prefix_hit_tokens >= 32


def test_the_speed_only_path_is_not_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_invariant=False on the avx2 path (forced: no tiled prefill kernel there): prefill chunks
    go through SDPA (reduction order set by the chunk's shape) and decode rows through the C++
    kernel: the same request's log-probabilities move with its batch, which the invariance test
    would catch."""
    if not cpu_isa.cpu_supports("avx2"):
        pytest.skip("no avx2 here: the C++ kernels' paths need it for float32")
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert attention_backends.kernels("cpu", False, torch.float32).varlen is None  # SDPA
    model = tiny_model("llama", dtype=torch.float32)
    results = outcomes(model, invariant=False)
    alone = results["alone"][1]
    assert any(logprobs != alone for _, logprobs in results.values())


def test_the_flag_is_refused_where_it_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        config(attention_backend="sdpa")
    with pytest.raises(ValueError, match="prepack_weights"):
        config(prepack_weights=False)
    with pytest.raises(ValueError, match="torch.compile"):
        config(default_compile_level=1)
    with pytest.raises(ValueError, match="batch_invariant=True needs the C.. CPU attention kernel"):
        attention_backends.select("auto", torch.device("meta"), 16, True, batch_invariant=True)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "generic")  # no C++ linear path: oneDNN only, refused
    assert "batch-invariant mode needs the C++ linear kernel" in packed_linear.unavailable_reason(
        torch.device("cpu"), torch.float32, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant=True cannot be used here: the batch-invariant mode"):
        run_engine(tiny_model("llama", dtype=torch.float32), [[1, 2, 3]], config(), 2)
    _, engine = run_engine(tiny_model("llama", dtype=torch.float32), [[1, 2, 3]], config(None), 2)  # default: runs
    assert engine.num_steps == 2


@pytest.mark.default_model
def test_default_model_request_is_bitwise_the_same_in_any_batch() -> None:
    """The real model in its auto dtype (bfloat16 on CPUs with native bfloat16): shapes where
    elementwise ops split across threads at odd places, chunks next to decodes, a cached prefix."""
    from cbserve.models import load_model

    model, _ = load_model()
    if packed_linear.kernel(model.dtype) != "cbserve":
        pytest.skip(f"no {model.dtype} C++ linear kernel on this CPU ({cpu_isa.selected()})")
    vocab = model.config.vocab_size
    target, others = random_prompts([TARGET_LEN], seed=1, vocab=vocab)[0], random_prompts(OTHERS, seed=2, vocab=vocab)
    alone = None
    for name, (prompts, index, overrides) in scenarios(target, others).items():
        got = run_target(model, prompts, index, config(True, **overrides))
        alone = alone or got
        assert got == alone, name
