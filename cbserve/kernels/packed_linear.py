"""Linear layers with weights packed once for the CPU's matrix kernels.

`F.linear` on a CPU calls MKL's sgemm, which re-packs the weight matrix on every call: at the
small row counts of decode steps that packing costs as much as the multiplication. Two packed
kernels avoid it, chosen once per engine:

- ``cbserve``: the C++ kernel of `kernels/csrc/linear_cpu.cpp` (AVX2 + FMA) on weights packed
  into 16-column panels. All 211 matrices of the default model (2-core EPYC, float32, weights
  streamed from memory as in a decode step) vs oneDNN's packed weights: 1.5-2.2x faster at 1-8
  rows, 1.1-1.5x at 16-64, on par at 128; per matrix at 2048 rows with the weights in cache
  oneDNN is 0-10% faster, and whole prefill steps take the same time with either.
- ``onednn``: `torch.ops.mkldnn._linear_pointwise` on a weight reordered once (1.6x faster than
  `F.linear` at 8 rows, 1.2-1.4x at 128), where the C++ kernels cannot be built or the CPU has
  no AVX2.

The packed weight is a second copy (the model keeps its own, untouched, for after the engine):
weights take twice their memory while an engine runs. `prepack_weights=False` turns it off.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32,)


@functools.cache
def kernel() -> str:
    """``cbserve`` when the C++ linear kernel runs here, else ``onednn``."""
    from cbserve.kernels import cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    if not reason and not torch.ops.cbserve_cpu.linear_available():
        reason = "the CPU has no AVX2 + FMA"
    if reason:
        logger.info("linear weights packed for oneDNN (the C++ linear kernel is not used: %s)", reason)
        return "onednn"
    return "cbserve"


class PackedLinear(torch.nn.Module):
    """Stands in for an `nn.Linear` while the engine runs; `original` is put back afterwards."""

    def __init__(self, linear: torch.nn.Linear, kind: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kind = kind or kernel()
        if self.kind == "cbserve" and kernel() != "cbserve":  # kernel() also loads the extension
            raise ValueError("the C++ linear kernel is unavailable here (see the log); use kind='onednn'")
        weight = linear.weight.detach()
        if self.kind == "cbserve":
            self.packed = torch.ops.cbserve_cpu.pack_linear_weight(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.original = [linear]  # a list: not a submodule, so its weight is not counted twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "cbserve":
            return torch.ops.cbserve_cpu.packed_linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {self.kind}"


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str:
    """'' when the weights can be packed, else why not."""
    if device.type != "cpu":
        return f"weights are packed for CPUs only, the model is on {device.type}"
    if dtype not in PACKABLE_DTYPES:
        return f"packing supports {[str(d) for d in PACKABLE_DTYPES]}, the model is {dtype}"
    if kernel() == "onednn" and not torch.backends.mkldnn.is_available():
        return "the C++ linear kernel is unavailable and this torch build has no oneDNN (mkldnn)"
    return ""


def pack_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Replace every plain `nn.Linear` of `model` by a `PackedLinear`; returns where, for `unpack`."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Subclasses (quantized, parallel...) keep their forward; hooked modules (tensor
            # parallelism's all-reduce) keep theirs, which would not run on a replacement.
            hooked = child._forward_hooks or child._forward_pre_hooks
            if type(child) is torch.nn.Linear and not hooked:
                setattr(parent, name, PackedLinear(child))
                swapped.append((parent, name))
    logger.info("packed %d linear layers' weights (%s kernel)", len(swapped), kernel())
    return swapped


def unpack_linears(swapped: list[tuple[torch.nn.Module, str]]) -> None:
    """Put the original `nn.Linear` modules back."""
    for parent, name in swapped:
        setattr(parent, name, getattr(parent, name).original[0])
    swapped.clear()
