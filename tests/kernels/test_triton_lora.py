"""The Triton LoRA delta kernels (`triton_lora.py`) against the definition of `csrc/lora_cpu.cpp`, row
by row in float64: a plain projection and a fused one (parts of unequal widths), rows of the base model
(-1) among adapter rows in random order, runs of one slot longer than a tile, a single row, a rank
zero-padded into the slots' rank, factors given as views; and against `LoraLinear`'s masked GEMMs.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below
before triton is imported), so shapes stay small. CBSERVE_TEST_DEVICE=cuda runs them on a GPU.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

DEVICE = os.environ.get("CBSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when kernels are defined

from cbserve.kernels import lora
from cbserve.kernels import triton_lora as tl_lora

if DEVICE == "cpu" and tl_lora.TRITON_AVAILABLE and not tl_lora._INTERPRETED:
    tl_lora = importlib.reload(tl_lora)  # imported earlier without TRITON_INTERPRET: redefine the kernels

pytestmark = pytest.mark.skipif(bool(tl_lora.unavailable_reason()),
                                reason=f"Triton LoRA kernels unusable: {tl_lora.unavailable_reason()}")

SLOTS, RANK, IN = 4, 8, 40
OUTS = {"plain": [40], "fused": [40, 16, 24]}
# Each row's slot: mixed with -1 in random order, runs longer than a 16-row tile around them, one row.
LAYOUTS = {
    "mixed": [3, -1, 0, 2, -1, 1, 1, 3, -1, 0, 2, 2, -1, 3, 1],
    "runs": [2] * 17 + [-1, 0, 3, -1, 2] + [0] * 16 + [1],
    "one": [1],
}


def _case(parts: list[int], slots: list[int], dtype: torch.dtype, seed: int = 0, rank: int = RANK):
    g = torch.Generator().manual_seed(seed)
    rows, out = len(slots), sum(parts)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    a = torch.randn(len(parts) * SLOTS * rank, IN, generator=g, dtype=torch.float64)
    b_t = torch.randn(SLOTS * rank, out, generator=g, dtype=torch.float64)
    y = torch.randn(rows, out, generator=g, dtype=torch.float64)
    ends = [sum(parts[: i + 1]) for i in range(len(parts))]
    return [t.to(dtype) for t in (y, x, a, b_t)], torch.tensor(slots), ends


def _definition(y, x, a, b_t, slots, ends, rank: int = RANK) -> torch.Tensor:
    """The contract, row by row and part by part in float64."""
    y, x, a, b_t = (t.double().cpu() for t in (y, x, a, b_t))
    out, width = y.clone(), SLOTS * rank
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        begin = 0
        for p, end in enumerate(ends):
            h = a[p * width + s * rank:p * width + (s + 1) * rank] @ x[t]
            out[t, begin:end] += h @ b_t[s * rank:(s + 1) * rank, begin:end]
            begin = end
    return out


def _run(y, x, a, b_t, slots, ends, rank: int = RANK) -> torch.Tensor:
    """The kernel's result on a copy of `y`."""
    y, x, a, b_t, slots = (t.to(DEVICE) for t in (y.clone(), x, a, b_t, slots))
    tl_lora.lora_delta_(y, x, a, b_t, slots, torch.tensor(ends), rank)
    return y.cpu()


def _close(mine: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # bf16 / fp16: their own rounding of y (the sums are float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(mine.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", sorted(OUTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernel_adds_each_rows_own_delta(dtype: torch.dtype, kind: str, layout: str) -> None:
    (y, x, a, b_t), slots, ends = _case(OUTS[kind], LAYOUTS[layout], dtype, seed=len(LAYOUTS[layout]))
    _close(_run(y, x, a, b_t, slots, ends), _definition(y, x, a, b_t, slots, ends), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_zero_padded_into_the_slots_rank(dtype: torch.dtype) -> None:
    """Adapters of rank 3 in slots of rank 8 (rows 3..7 of each slot zero): the rank-3 deltas."""
    parts, small = OUTS["fused"], 3
    (y, x, a3, b3), slots, ends = _case(parts, LAYOUTS["runs"], dtype, seed=7, rank=small)
    a = torch.zeros(len(parts) * SLOTS * RANK, IN, dtype=dtype)
    b_t = torch.zeros(SLOTS * RANK, sum(parts), dtype=dtype)
    for s in range(SLOTS):
        b_t[s * RANK:s * RANK + small] = b3[s * small:(s + 1) * small]
        for p in range(len(parts)):
            a[(p * SLOTS + s) * RANK:(p * SLOTS + s) * RANK + small] = a3[(p * SLOTS + s) * small:][:small]
    _close(_run(y, x, a, b_t, slots, ends), _definition(y, x, a3, b3, slots, ends, rank=small), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_reads_factors_as_views(dtype: torch.dtype) -> None:
    """Part 1 of a fused group wrapped alone (`lora_slots.py`): its rows of the group's `a`, its columns
    of the group's `b_t`; and the group's factors as column slices of wider tensors (row strides > I, O)."""
    (y, x, a, b_t), slots, ends = _case(OUTS["fused"], LAYOUTS["runs"], dtype, seed=3)
    width, out = SLOTS * RANK, ends[-1]
    wide_a = torch.randn(a.shape[0], IN + 7, dtype=torch.float64).to(dtype)
    wide_b = torch.randn(b_t.shape[0], out + 5, dtype=torch.float64).to(dtype)
    wide_a[:, 3:3 + IN], wide_b[:, 2:2 + out] = a, b_t
    a_view, b_view = wide_a[:, 3:3 + IN], wide_b[:, 2:2 + out]
    assert not a_view.is_contiguous() and not b_view.is_contiguous()
    _close(_run(y, x, a_view, b_view, slots, ends), _definition(y, x, a, b_t, slots, ends), dtype)

    a_part, b_part = a[width:2 * width], b_t[:, ends[0]:ends[1]]
    y_part = y[:, ends[0]:ends[1]].contiguous()
    want = _definition(y_part, x, a_part, b_part, slots, [ends[1] - ends[0]])
    _close(_run(y_part, x, a_part, b_part, slots, [ends[1] - ends[0]]), want, dtype)


def test_rows_without_adapter_leave_y_untouched() -> None:
    (y, x, a, b_t), _, ends = _case(OUTS["fused"], [-1] * 9, torch.float32)
    assert torch.equal(_run(y, x, a, b_t, torch.full((9,), -1), ends), y)


def test_equals_lora_linears_masked_gemms(monkeypatch) -> None:
    """`LoraLinear` on its torch path (the masked GEMMs) == the base projection plus the kernel's delta."""
    monkeypatch.setenv(lora.KERNEL_ENV, "torch")
    (_, x, a, b_t), slots, ends = _case(OUTS["fused"], LAYOUTS["runs"], torch.float64, seed=5)
    base = torch.nn.Linear(IN, ends[-1], dtype=torch.float64)
    batch = lora.LoraBatch(SLOTS, RANK)
    layer = lora.LoraLinear(base, a, b_t, ends, batch)
    assert layer.kernel == "torch"
    batch.rows = slots
    with torch.no_grad():
        want = layer(x.view(1, *x.shape))[0]
        y = base(x)
    _close(_run(y, x, a, b_t, slots, ends), want, torch.float64)


def test_kernel_refuses_bad_arguments() -> None:
    (y, x, a, b_t), slots, ends = _case(OUTS["plain"], LAYOUTS["mixed"], torch.float32)
    y, x, a, b_t, slots = (t.to(DEVICE) for t in (y, x, a, b_t, slots))
    with pytest.raises(ValueError, match="part_ends"):
        tl_lora.lora_delta_(y, x, a, b_t, slots, torch.tensor([ends[0] - 1]), RANK)
    if DEVICE == "cpu":  # on a GPU slots past S are skipped, not refused (checking them would sync)
        with pytest.raises(ValueError, match="slot is past"):
            tl_lora.lora_delta_(y, x, a, b_t, torch.full_like(slots, SLOTS), torch.tensor(ends), RANK)
    with pytest.raises(ValueError, match="one dtype"):
        tl_lora.lora_delta_(y, x.double(), a, b_t, slots, torch.tensor(ends), RANK)
    with pytest.raises(ValueError, match="slots x rank"):
        tl_lora.lora_delta_(y, x, a, b_t, slots, torch.tensor(ends), 3)


def test_engine_with_triton_deltas_equals_peft_merged_models(monkeypatch) -> None:
    """The engine's adapted projections on the Triton kernel (`$CBSERVE_LORA_KERNEL=triton`; the
    interpreter here): mixed adapter and base rows, chunked prefill, equal to PEFT's merged models."""
    pytest.importorskip("peft")
    from tests.support.lora_adapters import NAMES
    from tests.support.tiny_models import random_prompts
    from tests.workers.test_lora import check, lora_config, run

    monkeypatch.setenv(lora.KERNEL_ENV, "triton")
    calls = []
    kernel = tl_lora.lora_delta_
    monkeypatch.setattr(tl_lora, "lora_delta_", lambda *args: calls.append(1) or kernel(*args))
    prompts = random_prompts([3, 40, 17, 9, 25], seed=3)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    requests, _ = run("llama", prompts, names, lora_config(), max_new=4)
    check("llama", requests, prompts, names, max_new=4)
    assert calls  # the deltas went through the Triton kernel
