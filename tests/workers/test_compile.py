"""Compile levels keep outputs exact and do not recompile at every step."""

from __future__ import annotations

import pytest
import torch

import cbserve
from cbserve.workers.compilation import bucket, resolve
from tests.support.exactness import assert_matches_reference, reference, run_engine
from tests.support.tiny_models import random_prompts

LENGTHS = (1, 7, 33, 64, 100)


def test_levels_and_explicit_configs() -> None:
    assert resolve(0, None) is None
    assert resolve(1, None) == {"mode": "default", "dynamic": True}
    assert resolve(3, None)["dynamic"] is False
    assert resolve(2, {"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}  # explicit wins
    assert [bucket(n, 0) for n in (1, 2, 3, 65)] == [1, 2, 4, 128]
    assert [bucket(n, 16) for n in (1, 16, 17)] == [16, 16, 32]


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 3])
def test_compiled_engine_is_exact_without_recompiling_every_step(level: int) -> None:
    from tests.support.exactness import model_for

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, max_batch_tokens=48,
                                           return_logprobs=True, default_compile_level=level)
    # Inductor keeps float64 where eager rounds through RMSNorm's float32 cast: logprobs agree
    # to about 1e-6, tokens exactly.
    requests, engine = run_engine(model_for("llama"), random_prompts(list(LENGTHS)), cfg)
    assert_matches_reference(requests, reference("llama", LENGTHS, 10), tol=1e-5)
    warm = counters["stats"]["unique_graphs"]
    # A second workload of other shapes reuses the compiled graphs (dynamic shapes or buckets).
    other = (3, 20, 50, 90)
    requests, engine = run_engine(model_for("llama"), random_prompts(list(other)), cfg)
    assert_matches_reference(requests, reference("llama", other, 10), tol=1e-5)
    new_graphs = counters["stats"]["unique_graphs"] - warm
    assert new_graphs <= 2, f"{new_graphs} new graphs compiled over {engine.num_steps} steps"
