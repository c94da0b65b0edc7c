"""The LoRA delta kernel (`csrc/lora_cpu.cpp`) against the definition, row by row in float64, on
every path this CPU runs (generic; avx2 and avx512 where it has them), for a plain projection and
a fused one (q/k/v: three parts sharing the input), factors given as views (a part of a fused
group wrapped alone), rows of the base model (-1) among adapter rows, runs of one adapter long
enough for the kernel's GEMMs (prompt chunks) beside single rows; and the masked GEMMs (the path
off CPUs) against the same definition."""

from __future__ import annotations

import pytest
import torch

from cbserve.kernels import cpu_isa, cpu_kernels, lora

PATHS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_isa.cpu_supports(isa), reason=f"no {isa} here"))
         for isa in ("generic", "avx2", "avx512")]
SLOTS, RANK, IN = 4, 8, 40
OUTS = {"plain": [24], "fused": [24, 8, 8]}


def _case(parts: list[int], rows: int, dtype: torch.dtype, seed: int = 0, runs: bool = False):
    """Random factors and rows; `runs`: chunks of 16-40 rows of one slot (or none) between single rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    a = torch.randn(len(parts) * SLOTS * RANK, IN, generator=g, dtype=torch.float64)
    b_t = torch.randn(SLOTS * RANK, sum(parts), generator=g, dtype=torch.float64)
    y = torch.randn(rows, sum(parts), generator=g, dtype=torch.float64)
    slots = torch.randint(-1, SLOTS, (rows,), generator=g)
    if runs:
        slots = torch.cat([torch.full((int(torch.randint(16, 40, (1,), generator=g)),), s) for s in (2, -1, 0, 2)]
                          + [slots])
        x = torch.cat([torch.randn(len(slots) - rows, IN, generator=g, dtype=torch.float64), x])
        y = torch.cat([torch.randn(len(slots) - rows, sum(parts), generator=g, dtype=torch.float64), y])
    ends = [sum(parts[: i + 1]) for i in range(len(parts))]
    return [t.to(dtype) for t in (y, x, a, b_t)], slots, ends


def _definition(y, x, a, b_t, slots, ends) -> torch.Tensor:
    """Row by row, part by part, in float64."""
    y, x, a, b_t = (t.double() for t in (y, x, a, b_t))
    out, width = y.clone(), SLOTS * RANK
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        begin = 0
        for p, end in enumerate(ends):
            h = a[p * width + s * RANK:p * width + (s + 1) * RANK] @ x[t]
            out[t, begin:end] += h @ b_t[s * RANK:(s + 1) * RANK, begin:end]
            begin = end
    return out


def _close(mine: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 0.1}[dtype]
    torch.testing.assert_close(mine.double(), want, rtol=tol, atol=tol * 4)


@pytest.fixture
def kernels() -> None:
    if cpu_kernels.unavailable_reason():
        pytest.skip(cpu_kernels.unavailable_reason())


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", sorted(OUTS))
@pytest.mark.parametrize("rows, runs", [(1, False), (9, False), (70, False), (5, True)])
def test_kernel_adds_each_rows_own_delta(kernels: None, isa: str, dtype: torch.dtype, kind: str, rows: int,
                                         runs: bool) -> None:
    (y, x, a, b_t), slots, ends = _case(OUTS[kind], rows, dtype, seed=rows, runs=runs)
    want = _definition(y, x, a, b_t, slots, ends)
    cpu_kernels.lora_delta_(y, x, a, b_t, slots, torch.tensor(ends), RANK, isa)
    _close(y, want, dtype)


@pytest.mark.parametrize("isa", PATHS)
def test_kernel_reads_a_parts_factors_as_views(kernels: None, isa: str) -> None:
    """Part 1 of a fused group wrapped alone: its rows of the group's `a`, its columns of `b_t` (row
    strides of the whole group)."""
    (y, x, a, b_t), slots, ends = _case(OUTS["fused"], 9, torch.float32, seed=3)
    width = SLOTS * RANK
    a_part, b_part = a[width:2 * width], b_t[:, ends[0]:ends[1]]
    y_part = y[:, ends[0]:ends[1]].contiguous()
    want = _definition(y_part, x, a_part.contiguous(), b_part.contiguous(), slots, [ends[1] - ends[0]])
    cpu_kernels.lora_delta_(y_part, x, a_part, b_part, slots, torch.tensor([ends[1] - ends[0]]), RANK, isa)
    _close(y_part, want, torch.float32)


def test_kernel_refuses_bad_shapes(kernels: None) -> None:
    (y, x, a, b_t), slots, ends = _case(OUTS["plain"], 4, torch.float32)
    with pytest.raises(RuntimeError, match="part_ends"):
        cpu_kernels.lora_delta_(y, x, a, b_t, slots, torch.tensor([ends[0] - 1]), RANK)
    with pytest.raises(RuntimeError, match="slot is past"):
        cpu_kernels.lora_delta_(y, x, a, b_t, torch.full_like(slots, SLOTS), torch.tensor(ends), RANK)


@pytest.mark.parametrize("kind", sorted(OUTS))
def test_masked_gemms_add_each_rows_own_delta(kind: str, monkeypatch) -> None:
    """`LoraLinear`'s path off CPUs (forced here): the same deltas, in float64."""
    monkeypatch.setenv(lora.KERNEL_ENV, "torch")
    (y, x, a, b_t), slots, ends = _case(OUTS[kind], 12, torch.float64, seed=5)
    batch = lora.LoraBatch(SLOTS, RANK)

    class Base(torch.nn.Module):
        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return y.clone().view(1, *y.shape)

    layer = lora.LoraLinear(Base(), a, b_t, ends, batch)
    assert layer.kernel == "torch"
    batch.rows = slots
    _close(layer(x.view(1, *x.shape))[0], _definition(y, x, a, b_t, slots, ends), torch.float64)
    batch.rows = None
    assert torch.equal(layer(x.view(1, *x.shape))[0], y)  # no adapter rows: the base projection alone
    monkeypatch.setenv(lora.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=lora.KERNEL_ENV):
        lora.delta_kernel(torch.device("cpu"), torch.float32)
