"""LoRA deltas for every row of a packed batch, whatever adapter each row uses, in one call per
adapted projection.

An adapted projection holds the low-rank factors of every resident adapter side by side: slot s
of S = `max_loras` owns rows [s * r, (s + 1) * r) of `a` ([S * r, in], PEFT's lora_A) and of `b_t`
([S * r, out], lora_B transposed, the adapter's scaling folded in), r = `max_lora_rank` (a smaller
rank is zero-padded). A projection fused from P parts that share their input (q/k/v, gate/up: the
lean forward's one GEMM, `llama_forward.py`) keeps its parts' factors together: `a` [P * S * r, in]
(part p's slots from row p * S * r) and `b_t` [S * r, out] whose columns follow the parts' outputs
(`part_ends`). A step's rows each use one slot or none (the base model): `LoraBatch.rows`.

Under tensor parallelism each rank holds its shard's factors (`lora_slots.py` slices them): a
column-parallel projection's `b_t` columns, a row-parallel one's `a` columns. A row-parallel
projection's delta is then a partial sum, like its base output: it is all-reduced over the ranks
(`group`) before it is added to the base output, which its own hook has already reduced.

Three ways to add the deltas, each row's own adapter only:
- the C++ kernel on CPUs (`csrc/lora_cpu.cpp`): each row shrunk and expanded through its slot's
  columns alone (a segmented GEMV, as Punica's SGMV), P parts in one pass;
- the Triton kernel on GPUs (`triton_lora.py`): the same contract, rows sorted by slot on the device
  and taken 16 at a time through their slot's factors;
- elsewhere (a dtype the kernels lack, no Triton, or `$CBSERVE_LORA_KERNEL=torch`): two GEMMs over
  all slots' columns with the other slots' columns masked to exact zeros, ((x @ a.T) * mask) @ b_t,
  whose cost grows with S * r. On CPUs the kernel is what makes 8 adapters cheap (bench/lora.py).
"""

from __future__ import annotations

import os
import threading

import torch

KERNEL_ENV = "CBSERVE_LORA_KERNEL"  # auto; torch: the masked GEMMs; triton: Triton (its interpreter on a CPU)
KERNELS = ("auto", "torch", "triton")


def delta_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which way adapted projections on `device` in `dtype` add their deltas: "cpp", "triton" or
    "torch" (the masked GEMMs)."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNELS:
        raise ValueError(f"${KERNEL_ENV} must be one of {', '.join(KERNELS)}, got {choice!r}")
    if choice == "torch":
        return "torch"
    if choice == "triton" or device.type == "cuda":
        from cbserve.kernels import triton_lora

        reason = triton_lora.unavailable_reason()
        if choice == "triton" and reason:
            raise ValueError(f"${KERNEL_ENV}=triton: {reason}")
        return "torch" if reason else "triton"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float64):
        return "torch"
    from cbserve.kernels import cpu_kernels

    return "torch" if cpu_kernels.unavailable_reason() else "cpp"


class LoraBatch:
    """The step's rows as the adapted projections see them: `rows` (int64 [T], each row's slot, -1
    for none), or None when no row of the step uses an adapter.

    Per thread: the engine's step sets it in the thread that runs the pass, so a plain forward of
    the model from another thread (the model stays its owner's) gets no delta."""

    def __init__(self, slots: int, rank: int) -> None:
        self.slots, self.rank = slots, rank
        self._local = threading.local()

    def __deepcopy__(self, memo: dict) -> LoraBatch:  # a copy of the model while an engine holds it
        return LoraBatch(self.slots, self.rank)

    @property
    def rows(self) -> torch.Tensor | None:
        return getattr(self._local, "rows", None)

    @rows.setter
    def rows(self, value: torch.Tensor | None) -> None:
        self._local.rows = value
        self._local.mask = None

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[T, S * r]: ones on each row's slot's columns (the masked GEMMs' form), made once a step."""
        mask = getattr(self._local, "mask", None)
        if mask is None:
            rows = self.rows
            column_slot = torch.arange(self.slots * self.rank, device=rows.device) // self.rank
            mask = self._local.mask = (column_slot[None, :] == rows[:, None]).to(dtype)
        return mask


class LoraLinear(torch.nn.Module):
    """Stands in for one projection, or one fused group of projections, while an engine with LoRA
    runs: the projection (`base`, packed or not) plus each row's adapter delta. `a` and `b_t` are
    the engine's slot storage (written in place when an adapter is copied into a slot)."""

    def __init__(self, base: torch.nn.Module, a: torch.Tensor, b_t: torch.Tensor, part_ends: list[int],
                 batch: LoraBatch, reduce_group: object | None = None) -> None:
        super().__init__()
        self.base, self.batch = base, batch
        self.reduce_group = reduce_group  # a row-parallel shard's process group: its delta is a partial sum
        self.a, self.b_t = a, b_t
        self.part_ends = part_ends
        self.kernel = delta_kernel(a.device, a.dtype)
        # The Triton kernel reads the part ends on the device (no copy per call, capturable in a graph).
        self._ends = torch.tensor(part_ends, dtype=torch.long, device=a.device if self.kernel == "triton" else "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.batch.rows
        if rows is None:  # no row uses an adapter (or not the engine's pass): the base projection alone
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self.reduce_group is None:
            self._add_delta(y2, x2, rows)
            return y
        import torch.distributed as dist

        delta = torch.zeros_like(y2)
        self._add_delta(delta, x2, rows)
        dist.all_reduce(delta, group=self.reduce_group)
        y2 += delta
        return y

    def _add_delta(self, y2: torch.Tensor, x2: torch.Tensor, rows: torch.Tensor) -> None:
        if self.kernel == "cpp":
            from cbserve.kernels import cpu_kernels

            cpu_kernels.lora_delta_(y2, x2.contiguous(), self.a, self.b_t, rows, self._ends, self.batch.rank)
            return
        if self.kernel == "triton":
            from cbserve.kernels import triton_lora

            triton_lora.lora_delta_(y2, x2, self.a, self.b_t, rows, self._ends, self.batch.rank)
            return
        width = self.batch.slots * self.batch.rank
        h = (x2 @ self.a.T).view(x2.shape[0], -1, width) * self.batch.mask(x2.dtype)[:, None, :]
        begin = 0
        for part, end in enumerate(self.part_ends):
            y2[:, begin:end] += h[:, part] @ self.b_t[:, begin:end]
            begin = end
