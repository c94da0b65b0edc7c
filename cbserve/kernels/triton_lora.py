"""LoRA deltas on GPUs with Triton: `csrc/lora_cpu.cpp`'s contract (`lora.py` has the factors' layout).

Rows are sorted by slot on the device (no host sync) and each program takes a tile of one slot's rows
through that slot's factors alone with `tl.dot`, as Punica's SGMV: a prompt chunk reads its adapter
once per 16 rows, and no row pays for the other S - 1 slots as in the masked GEMMs. Shrink and expand
are two kernels because the expand splits the outputs over many more programs than the shrink has.
"""

from __future__ import annotations

import torch

from cbserve.kernels.triton_import import IMPORT_ERROR as _IMPORT_ERROR
from cbserve.kernels.triton_import import TRITON_AVAILABLE, tl, triton

__all__ = ["lora_delta_", "unavailable_reason"]

_BLOCK_M = 16  # rows of one slot per program: tl.dot's minimum on GPUs
_BLOCK_I = 64  # input features per shrink step
_BLOCK_O = 64  # output features per expand program
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

if TRITON_AVAILABLE:

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr,
        stride_x, stride_a, stride_h_row, stride_h_part,
        num_in, num_slots, rank,
        BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, R: tl.constexpr,
        ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        # h[i, p] = x[order[i]] @ a[(p * S + s) * r : +r].T for tile m of slot s's rows i (in slot order).
        m = tl.program_id(0)
        s = tl.program_id(1)
        p = tl.program_id(2)
        first = tl.load(starts_ptr + s) + m * BLOCK_M
        end = tl.load(starts_ptr + s + 1)
        if first >= end:  # the grid has room for every row in one slot; this slot has fewer
            return
        i = first + tl.arange(0, BLOCK_M)
        i_ok = i < end
        row = tl.load(order_ptr + i, mask=i_ok, other=0)
        j = tl.arange(0, R)
        a_row = ((p * num_slots + s) * rank + j).to(tl.int64)
        h = tl.full([BLOCK_M, R], 0.0, ACC)
        for k0 in range(0, num_in, BLOCK_I):
            k = k0 + tl.arange(0, BLOCK_I)
            x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :],
                        mask=i_ok[:, None] & (k < num_in)[None, :], other=0.0)
            a = tl.load(a_ptr + a_row[None, :] * stride_a + k[:, None],  # [BLOCK_I, R]: a's rows transposed
                        mask=(k < num_in)[:, None] & (j < rank)[None, :], other=0.0)
            h = tl.dot(x.to(ACC), a.to(ACC), h, input_precision=DOT_PRECISION)
        tl.store(h_ptr + i[:, None] * stride_h_row + p * stride_h_part + j[None, :], h, mask=i_ok[:, None])

    @triton.jit
    def _expand_kernel(
        y_ptr, b_ptr, h_ptr, order_ptr, starts_ptr, ends_ptr,
        stride_y, stride_b, stride_h_row, stride_h_part,
        num_out, rank,
        PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, R: tl.constexpr,
        ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        # y[order[i], o] += h[i, part of o] @ b_t[s * r : +r, o] for tile m of slot s's rows, outputs tile n.
        m = tl.program_id(0)
        s = tl.program_id(1)
        n = tl.program_id(2)
        first = tl.load(starts_ptr + s) + m * BLOCK_M
        end = tl.load(starts_ptr + s + 1)
        if first >= end:
            return
        i = first + tl.arange(0, BLOCK_M)
        i_ok = i < end
        row = tl.load(order_ptr + i, mask=i_ok, other=0)
        j = tl.arange(0, R)
        b_row = (s * rank + j).to(tl.int64)
        o = n * BLOCK_O + tl.arange(0, BLOCK_O)
        acc = tl.full([BLOCK_M, BLOCK_O], 0.0, ACC)
        begin = 0
        for p in tl.static_range(PARTS):
            stop = tl.load(ends_ptr + p)
            if (begin < n * BLOCK_O + BLOCK_O) & (stop > n * BLOCK_O):  # only the parts this tile meets
                b = tl.load(b_ptr + b_row[:, None] * stride_b + o[None, :],
                            mask=(j < rank)[:, None] & ((o >= begin) & (o < stop))[None, :], other=0.0)
                h = tl.load(h_ptr + i[:, None] * stride_h_row + p * stride_h_part + j[None, :],
                            mask=i_ok[:, None], other=0.0)
                acc = tl.dot(h, b.to(ACC), acc, input_precision=DOT_PRECISION)
            begin = stop
        mask = i_ok[:, None] & (o < num_out)[None, :]
        y_ptrs = y_ptr + row[:, None] * stride_y + o[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(ACC) + acc).to(y_ptr.dtype.element_ty), mask=mask)  # one rounding into y

    _INTERPRETED = type(_shrink_kernel).__name__ == "InterpretedFunction"
else:
    _INTERPRETED = False


def unavailable_reason() -> str:
    """Why `lora_delta_` cannot run here, '' when it can (triton, and a CUDA device or the interpreter)."""
    if not TRITON_AVAILABLE:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if not _INTERPRETED and not torch.cuda.is_available():
        return ("no CUDA device, and Triton's interpreter is off (TRITON_INTERPRET=1 must be set before "
                "cbserve.kernels.triton_lora is imported)")
    return ""


def _dot_precision(dtype: torch.dtype) -> str:
    # Operands are upcast to the accumulator's dtype (the interpreter's bf16 dot multiplies bit patterns):
    # bf16/fp16 values are exact in tf32 and tf32x3 keeps the expand's float32 h near float32 accuracy.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32x3"


def _accumulator(dtype: torch.dtype):
    # float64 inputs sum in float64; a GPU refuses a loop-carried float32 that a float64 dot turns float64.
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, row_slots: torch.Tensor,
           part_ends: torch.Tensor, rank: int) -> None:
    reason = unavailable_reason()
    if reason or (y.device.type == "cpu" and not _INTERPRETED):
        raise RuntimeError(f"triton lora_delta_: {reason or 'CPU tensors run only under TRITON_INTERPRET=1'}")
    factors = (y, x, a, b_t)
    if any(t.dim() != 2 or t.stride(1) != 1 or t.dtype != y.dtype or t.device != y.device for t in factors):
        raise ValueError("lora_delta_: y, x, a, b_t must be 2-D tensors of one dtype and device with unit "
                         "column stride")
    if y.dtype not in _DTYPES:
        raise ValueError(f"lora_delta_: float32, bfloat16, float16 or float64 tensors only, got {y.dtype}")
    if row_slots.shape != (x.shape[0],) or row_slots.dtype != torch.int64 or row_slots.device != y.device:
        raise ValueError("lora_delta_: row_slots must be int64, one per row of x, on the tensors' device")
    if part_ends.dim() != 1 or part_ends.dtype != torch.int64 or part_ends.shape[0] < 1:
        raise ValueError("lora_delta_: part_ends must be int64, one per part")
    if rank < 1 or b_t.shape[0] % rank:
        raise ValueError(f"lora_delta_: b_t's rows ({b_t.shape[0]}) must be slots x rank ({rank})")
    slots = b_t.shape[0] // rank
    if (y.shape[0] != x.shape[0] or a.shape != (part_ends.shape[0] * slots * rank, x.shape[1])
            or b_t.shape[1] != y.shape[1]):
        raise ValueError("lora_delta_: shapes must be y [T, O], x [T, I], a [P*S*r, I], b_t [S*r, O]")
    # Value checks only where they cost no host sync (the C++ kernel checks them always).
    if part_ends.device.type == "cpu" and int(part_ends[-1]) != y.shape[1]:
        raise ValueError(f"lora_delta_: part_ends[-1] must be O = {y.shape[1]}, got {int(part_ends[-1])}")
    if row_slots.device.type == "cpu" and row_slots.numel() and int(row_slots.max()) >= slots:
        raise ValueError(f"lora_delta_: a row's slot is past the slots ({slots})")


def lora_delta_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, row_slots: torch.Tensor,
                part_ends: torch.Tensor, rank: int) -> None:
    """``y`` ``[T, O]`` += each row's LoRA delta through its slot's factors (`row_slots` int64 ``[T]``,
    -1: none): ``a`` ``[P * S * rank, I]``, ``b_t`` ``[S * rank, O]`` (any row strides), the
    projection's P parts ending at `part_ends` in O; as `cpu_kernels.lora_delta_`. On a GPU, slots
    past S are skipped rather than refused (checking them would sync)."""
    _check(y, x, a, b_t, row_slots, part_ends, rank)
    rows, parts, slots = x.shape[0], part_ends.shape[0], b_t.shape[0] // rank
    if rows == 0 or slots == 0:
        return
    # Slot s's rows are order[starts[s]:starts[s + 1]]; those of slot -1 sort first and are never read.
    sorted_slots, order = torch.sort(row_slots, stable=True)
    starts = torch.searchsorted(sorted_slots, torch.arange(slots + 1, device=y.device))
    padded_rank = max(16, triton.next_power_of_2(rank))  # tl.dot's minimum width
    h = torch.empty(rows, parts, padded_rank, device=y.device,
                    dtype=torch.float64 if y.dtype == torch.float64 else torch.float32)
    tiles = triton.cdiv(rows, _BLOCK_M)  # per slot: as many as if every row were in it
    acc, precision = _accumulator(y.dtype), _dot_precision(y.dtype)
    _shrink_kernel[(tiles, slots, parts)](
        x, a, h, order, starts, x.stride(0), a.stride(0), h.stride(0), h.stride(1), x.shape[1], slots, rank,
        BLOCK_M=_BLOCK_M, BLOCK_I=_BLOCK_I, R=padded_rank, ACC=acc, DOT_PRECISION=precision,
    )  # fmt: skip
    _expand_kernel[(tiles, slots, triton.cdiv(y.shape[1], _BLOCK_O))](
        y, b_t, h, order, starts, part_ends.to(y.device), y.stride(0), b_t.stride(0), h.stride(0), h.stride(1),
        y.shape[1], rank,
        PARTS=parts, BLOCK_M=_BLOCK_M, BLOCK_O=_BLOCK_O, R=padded_rank, ACC=acc, DOT_PRECISION=precision,
    )  # fmt: skip
