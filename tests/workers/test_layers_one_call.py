"""A decode step's decoder layers as one C++ call (`csrc/decoder_layers_cpu.cpp`, chosen by
`LlamaForward.one_call_args`): the same tokens and logprobs, bit for bit, as the lean forward's
per-op loop on every path this CPU has, the steps and setups that keep the loop, and that a wrong
argument is caught."""

from __future__ import annotations

import pytest
import torch

import cbserve
from cbserve.kernels import cpu_isa, cpu_kernels, llama_forward
from tests.support.exactness import run_engine
from tests.support.tiny_models import random_prompts, tiny_model

LENGTHS = [1, 9, 40, 70]
MAX_NEW = 8
ONE_CALL_ARGS = llama_forward.LlamaForward.one_call_args

pytestmark = pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason="no C++ CPU kernels here")


def config(**overrides) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=80, max_batch_tokens=96,
                                            return_logprobs=True, **overrides)


def generate(monkeypatch, dtype: torch.dtype, one_call: bool, cfg=None, corrupt=None):
    """Tokens and logprobs per request, and per step whether it ran as one call."""
    steps: list[bool] = []

    def recorded(self, meta, rows):
        args = ONE_CALL_ARGS(self, meta, rows) if one_call else None
        if args is not None and corrupt is not None:
            args = corrupt(args)
        steps.append(args is not None)
        return args

    monkeypatch.setattr(llama_forward.LlamaForward, "one_call_args", recorded)
    requests, _ = run_engine(tiny_model("llama", dtype=dtype), random_prompts(LENGTHS), cfg or config(), MAX_NEW)
    return [(r.generated, r.logprobs) for r in requests], steps


def paths() -> list:
    """(dtype, path) for every C++ linear path, forced in turn: bfloat16 has one (AVX-512 BF16)."""
    params = []
    for dtype, isa in ((torch.float32, "avx512"), (torch.float32, "avx2"), (torch.bfloat16, "avx512_bf16")):
        lacks = isa not in cpu_isa.supported()
        params.append(pytest.param(dtype, isa, id=f"{str(dtype).removeprefix('torch.')}-{isa}",
                                   marks=pytest.mark.skipif(lacks, reason=f"this CPU has no {isa} path")))
    return params


@pytest.mark.parametrize(("dtype", "isa"), paths())
def test_one_call_equals_the_layer_loop_bit_for_bit(monkeypatch, dtype: torch.dtype, isa) -> None:
    monkeypatch.setenv(cpu_isa.ISA_ENV, isa)
    loop, loop_steps = generate(monkeypatch, dtype, one_call=False)
    fused, fused_steps = generate(monkeypatch, dtype, one_call=True)
    assert not any(loop_steps)
    assert any(fused_steps) and not all(fused_steps)  # prompt steps keep the loop
    assert fused == loop  # tokens and logprobs, exactly


def test_a_wrong_argument_is_caught(monkeypatch) -> None:
    """The comparison above fails when the one call is given a slightly different attention scale."""
    def corrupt(args):
        args = list(args)
        args[10] *= 1.01  # scale
        return tuple(args)

    loop, _ = generate(monkeypatch, torch.float32, one_call=False)
    fused, steps = generate(monkeypatch, torch.float32, one_call=True, corrupt=corrupt)
    assert any(steps) and fused != loop


def test_other_steps_and_setups_keep_the_layer_loop(monkeypatch) -> None:
    for cfg in (config(prepack_weights=False), config(attention_backend="reference"), config(attention_backend="sdpa")):
        _, steps = generate(monkeypatch, torch.float32, one_call=True, cfg=cfg)
        assert steps and not any(steps), cfg
