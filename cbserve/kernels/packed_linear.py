"""Linear layers with weights packed once for the CPU's matrix kernels.

`F.linear` on a CPU calls MKL's sgemm, which re-packs the weight matrix on every call: at the
small row counts of decode steps that packing costs as much as the multiplication. Two packed
kernels avoid it:

- ``cbserve``: the C++ kernel of `kernels/csrc/linear_cpu.cpp` on weights packed into column
  panels, with one path per instruction set (`cpu_isa.selected()`): float32 on AVX2 (6 x 16 tiles)
  and AVX-512 (12 x 32), bfloat16 on AVX-512 BF16 (12 x 32 tiles of `vdpbf16ps`, float32
  accumulation). Each output sums its K products in order, whatever the number of rows: a row's
  result is bitwise the same in any batch (the batch-invariant mode uses only this kernel).
- ``onednn``: `torch.ops.mkldnn._linear_pointwise` on a weight reordered once (float32 and
  bfloat16), where the C++ kernel has no path for the model's dtype on this CPU, and for the row
  counts where it measures faster (`onednn_from_rows`: bfloat16 on a CPU with AMX, whose tile
  multiplies oneDNN uses and our AVX-512 kernel does not): then both packed copies are kept and
  each call picks one by its number of rows.

A gate/up projection (the lean Llama forward's fused `cb_gate_up_proj`) on the 32-column AVX-512
paths also takes silu(gate) * up into the kernel's epilogue (`PackedLinear.silu_mul`): its panels
hold 16 gate and the same 16 up columns, so the [T, 2I] projection is never written out and read
back by a separate op (mixed workload on a 2-core Zen 4, with `csrc/task_queue.h`: +6% bfloat16,
+2.5% float32).

The packed weight is another copy (the model keeps its own, untouched, for after the engine):
weights take twice their memory while an engine runs (three times with both kernels).
`prepack_weights=False` turns it off.
"""

from __future__ import annotations

import functools
import logging

import torch

from cbserve.kernels import cpu_isa

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The C++ kernel's path for each dtype, by the selected instruction set.
_PATHS = {
    torch.float32: {"avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2"},
    torch.bfloat16: {"avx512_bf16": "avx512_bf16"},
}
# From how many rows oneDNN's kernel takes over from ours in bfloat16 on a CPU with AMX-BF16. Measured
# on a 2-core AMX Xeon over the default model's matrices: one matrix in cache, from 4 rows AMX wins
# (8 rows 1.7-2.6x, 128 rows 8-10x); 30 layers' weights streamed from memory, interleaved, 4 rows tie
# (30.3 vs 30.7 ms), 8 rows 35.2 vs 27.8 ms, 16 rows 45.9 vs 22.9 ms; at 1-2 rows ours reads faster.
AMX_ONEDNN_FROM_ROWS = 4


# The C++ kernel's paths with 32-column panels, where a gate/up projection can take silu(gate) * up
# into its epilogue (`PackedLinear.silu_mul`).
EPILOGUE_PATHS = ("avx512", "avx512_bf16")


def gate_up_panels(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up weight ``[2I, K]`` (gate rows, then up rows) with its rows reordered so that each
    32-row panel holds 16 gate rows and the same 16 up rows: a panel's tile then has both inputs
    of silu(gate) * up for 16 outputs."""
    return weight.unflatten(0, (2, -1, 16)).transpose(0, 1).flatten(0, 2).contiguous()


def onednn_from_rows(isa: str | None, dtype: torch.dtype) -> int | None:
    """From how many rows a call of the C++ kernel's path `isa` goes to oneDNN instead; None: never."""
    if isa is None or dtype != torch.bfloat16 or not cpu_isa.has_amx_bf16():
        return None
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return AMX_ONEDNN_FROM_ROWS


def cpp_path(dtype: torch.dtype) -> str | None:
    """The C++ kernel's instruction-set path for `dtype` on this CPU, or None."""
    return _PATHS.get(dtype, {}).get(cpu_isa.selected())


def kernel(dtype: torch.dtype = torch.float32) -> str:
    """``cbserve`` when the C++ linear kernel runs `dtype` here, else ``onednn``."""
    return _kernel(dtype, cpu_isa.selected())


@functools.cache
def _kernel(dtype: torch.dtype, isa: str) -> str:
    from cbserve.kernels import cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    if not reason and _PATHS.get(dtype, {}).get(isa) is None:
        reason = f"no {str(dtype).removeprefix('torch.')} path for the CPU's instruction set ({isa})"
    if reason:
        logger.info("linear weights packed for oneDNN (the C++ linear kernel is not used: %s)", reason)
        return "onednn"
    return "cbserve"


class PackedLinear(torch.nn.Module):
    """Stands in for an `nn.Linear` while the engine runs; `original` is put back afterwards.

    kind: ``cbserve`` (the C++ kernel only), ``onednn`` (oneDNN only), or None: the C++ kernel when
    it runs the dtype here, with oneDNN for calls of `onednn_from_rows` rows or more.
    """

    def __init__(self, linear: torch.nn.Linear, kind: str | None = None, isa: str | None = None,
                 silu_epilogue: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        dtype = weight.dtype
        self.kind = kind or ("cbserve" if isa else kernel(dtype))  # an explicit path: the C++ kernel
        if self.kind not in ("cbserve", "onednn"):
            raise ValueError(f"kind must be 'cbserve' or 'onednn', got {kind!r}")
        self.isa = (isa or cpp_path(dtype)) if self.kind == "cbserve" else None
        if self.kind == "cbserve" and (self.isa is None or kernel(dtype) != "cbserve" and isa is None):
            raise ValueError(f"the C++ linear kernel has no {dtype} path here (see the log); use kind='onednn'")
        if self.kind == "cbserve":
            from cbserve.kernels import cpu_kernels

            cpu_kernels.load()
        self.onednn_from = onednn_from_rows(self.isa, dtype) if kind is None and isa is None else None
        self.packed = self.onednn = None
        # A gate/up projection whose C++ kernel also applies silu(gate) * up (`silu_mul`).
        self.silu_epilogue = (silu_epilogue and self.isa in EPILOGUE_PATHS and linear.bias is None
                              and self.out_features % 32 == 0 and self.in_features > 0)
        if self.kind == "cbserve":
            panels = gate_up_panels(weight) if self.silu_epilogue else weight
            self.packed = torch.ops.cbserve_cpu.pack_linear_weight(panels, self.isa)
        if self.kind == "onednn" or self.onednn_from is not None:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.original = [linear]  # a list: not a submodule, so its weight is not counted twice

    def _cpp_runs(self, x: torch.Tensor) -> bool:
        return self.packed is not None and (self.onednn_from is None or x.numel() < self.onednn_from * self.in_features)

    def cpp_runs_rows(self, rows: int) -> bool:
        """`rows` rows go through the C++ kernel (as `forward` on them would)."""
        return self.packed is not None and (self.onednn_from is None or rows < self.onednn_from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpp_runs(x):
            y = torch.ops.cbserve_cpu.packed_linear(x, self.packed, self.bias, self.out_features, self.isa)
            if self.silu_epilogue:  # the panels' columns back in the weight's order
                y = y.unflatten(-1, (-1, 2, 16)).transpose(-3, -2).flatten(-3)
            return y
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this gate/up projection's output ``[.., 2I]`` (gate first): ``[.., I]``,
        in the GEMM's epilogue when it has one (the same numbers as `cpu_kernels.silu_mul` on its output)."""
        if self.silu_epilogue and self._cpp_runs(x):
            return torch.ops.cbserve_cpu.packed_gate_up_silu(x, self.packed, self.out_features // 2, self.isa)
        from cbserve.kernels import cpu_kernels

        return cpu_kernels.silu_mul(self.forward(x))

    def extra_repr(self) -> str:
        how = self.kind if self.kind == "onednn" else f"cbserve {self.isa}"
        if self.silu_epilogue:
            how += ", silu(gate) * up in the epilogue"
        if self.onednn_from is not None:
            how += f", oneDNN from {self.onednn_from} rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {how}"


def unavailable_reason(device: torch.device, dtype: torch.dtype, batch_invariant: bool | None = None) -> str:
    """'' when the weights can be packed, else why not. `batch_invariant`: for the C++ kernel only."""
    if device.type != "cpu":
        return f"weights are packed for CPUs only, the model is on {device.type}"
    if dtype not in PACKABLE_DTYPES:
        return f"packing supports {[str(d) for d in PACKABLE_DTYPES]}, the model is {dtype}"
    if kernel(dtype) == "cbserve":
        return ""
    if batch_invariant:
        from cbserve.kernels import cpu_kernels

        why = cpu_kernels.unavailable_reason() or (
            f"it has no {str(dtype).removeprefix('torch.')} path for this CPU "
            f"(instruction set {cpu_isa.selected()}; paths: float32 on avx2/avx512, bfloat16 on avx512_bf16)")
        return f"the batch-invariant mode needs the C++ linear kernel, and {why}"
    if not torch.backends.mkldnn.is_available():
        return "the C++ linear kernel is unavailable and this torch build has no oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "the C++ linear kernel has no bfloat16 path here and oneDNN has no bfloat16 support on this CPU"
    return ""


def pack_linears(model: torch.nn.Module, batch_invariant: bool | None = None) -> list[tuple[torch.nn.Module, str]]:
    """Replace every plain `nn.Linear` of `model` (the LM head too) by a `PackedLinear`; returns where,
    for `unpack`. `batch_invariant=True`: the C++ kernel for every row count (never oneDNN).

    A model that runs the lean forward (`llama_forward.py`) gets its q/k/v and gate/up projections
    packed as one matrix each (`llama_forward.fused_groups`), which it calls instead of the parts:
    those keep their own unpacked weights for transformers' forward outside the engine."""
    from cbserve.kernels import llama_forward

    swapped = []
    kind = "cbserve" if batch_invariant else None
    fused_parts = set()
    for parent, name, parts in llama_forward.fused_groups(model):
        setattr(parent, name, _fused(parent, parts, kind))
        swapped.append((parent, name))
        fused_parts.update((id(parent), part) for part in parts)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Subclasses (quantized, parallel...) keep their forward; hooked modules (tensor
            # parallelism's all-reduce) keep theirs, which would not run on a replacement.
            hooked = child._forward_hooks or child._forward_pre_hooks
            if type(child) is torch.nn.Linear and not hooked and (id(parent), name) not in fused_parts:
                setattr(parent, name, PackedLinear(child, kind))
                swapped.append((parent, name))
    if swapped:
        parent, name = swapped[-1]
        how = getattr(parent, name).extra_repr().split("packed for ")[-1]
        logger.info("packed %d linear layers' weights for %s (%d of them fused groups)", len(swapped), how,
                    sum(1 for _, n in swapped if n in llama_forward.FUSED))
    return swapped


def _fused(parent: torch.nn.Module, parts: tuple[str, ...], kind: str | None) -> PackedLinear:
    """One `PackedLinear` over the concatenated weights of `parent`'s `parts` (their outputs side by
    side); it keeps no unpacked copy (`unpack_linears` drops it). Gate/up: with silu in its epilogue
    where the kernel has one."""
    linears = [getattr(parent, p) for p in parts]
    joined = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                             bias=linears[0].bias is not None, device="meta")
    joined.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    if joined.bias is not None:
        joined.bias = torch.nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    packed = PackedLinear(joined, kind, silu_epilogue=parts == ("gate_proj", "up_proj"))
    packed.original = []
    return packed


def unpack_linears(swapped: list[tuple[torch.nn.Module, str]]) -> None:
    """Put the original `nn.Linear` modules back (and drop the fused groups)."""
    from cbserve.kernels import llama_forward

    for parent, name in swapped:
        if name in llama_forward.FUSED:
            delattr(parent, name)
        else:
            setattr(parent, name, getattr(parent, name).original[0])
    swapped.clear()
