"""LoRA deltas for every row of a packed batch, whatever adapter each row uses, in one computation.

Each adapted projection holds the low-rank factors of every resident adapter side by side: slot s
of `max_loras` owns rows [s * r, (s + 1) * r) of `a` ([max_loras * r, in]) and those columns of
`b` ([out, max_loras * r], the adapter's scaling folded in), r = `max_lora_rank` (a smaller rank
is zero-padded). A step's rows each use one slot or none (the base model); `LoraBatch.mask`
([T, max_loras * r]) holds ones on the row's slot's columns and zeros elsewhere, so

    y = base(x) + ((x @ a.T) * mask) @ b.T

is every row's own delta (shrink, mask, expand: two GEMMs over all rows and adapters), not one
pass per adapter. The masked columns are exact zeros, so a row's delta is that of its adapter
alone. At the ranks LoRA uses (8-64) and a few adapters resident, the shrink is a thin GEMM next to
the base projection's.
"""

from __future__ import annotations

import threading

import torch


class LoraBatch:
    """The step's rows as the adapted projections see them: `mask` [T, max_loras * r] (ones on each
    row's adapter's columns), or None when no row of the step uses an adapter.

    Per thread: the engine's step sets it in the thread that runs the pass, so a plain forward of
    the model from another thread (the model stays its owner's) gets no delta."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __deepcopy__(self, memo: dict) -> LoraBatch:  # a copy of the model while an engine holds it
        return LoraBatch()

    @property
    def mask(self) -> torch.Tensor | None:
        return getattr(self._local, "mask", None)

    @mask.setter
    def mask(self, value: torch.Tensor | None) -> None:
        self._local.mask = value


class LoraLinear(torch.nn.Module):
    """Stands in for one projection while an engine with LoRA runs: the projection (`base`, packed
    or not) plus each row's adapter delta. `a` and `b` are written in place when an adapter is
    copied into a slot."""

    def __init__(self, base: torch.nn.Linear, width: int, batch: LoraBatch) -> None:
        super().__init__()
        self.base = base
        weight = base.weight
        self.a = torch.zeros(width, base.in_features, dtype=weight.dtype, device=weight.device)
        self.b = torch.zeros(base.out_features, width, dtype=weight.dtype, device=weight.device)
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.batch.mask
        if mask is None:  # no row uses an adapter (or not the engine's pass): the base projection alone
            return y
        return y + ((x @ self.a.T) * mask) @ self.b.T
