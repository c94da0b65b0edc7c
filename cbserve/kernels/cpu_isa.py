"""What the CPU can run: its vector instruction sets, the C++ kernels' path for it, and the model
dtype that suits it.

The C++ kernels (`csrc/*.cpp`) hold one path per instruction set, each compiled for its own
target, and take the path as an argument; this module picks it once per process from the CPU's
flags (`/proc/cpuinfo`, else torch's own CPU probes):

- ``avx512_bf16``: AVX-512 with BF16 dot products (`vdpbf16ps`): float32 and bfloat16 kernels;
- ``avx512``: AVX-512 F/BW/VL/DQ: float32 kernels (bfloat16 attention widened to float32);
- ``avx2``: AVX2 + FMA: float32 kernels;
- ``generic``: plain C++ attention, oneDNN for linear layers.

`$CBSERVE_CPU_ISA` forces a path (one the CPU has: a path it lacks is refused, saying why), e.g.
to compare paths or to run every path's tests on one machine.

`auto_dtype()` is bfloat16 where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX),
float32 elsewhere (bfloat16 would be converted in software there, and slower).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ISA_ENV = "CBSERVE_CPU_ISA"
ISAS = ("avx512_bf16", "avx512", "avx2", "generic")  # best first
_REQUIRED_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    "generic": set(),
}
_TORCH_PROBES = {  # where /proc/cpuinfo is missing
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def cpu_supports(isa: str) -> bool:
    """Whether the CPU runs kernel path `isa` (one of `ISAS`)."""
    if isa not in ISAS:
        raise ValueError(f"unknown CPU kernel path {isa!r}; one of {ISAS}")
    if isa == "generic":
        return True
    if not _is_x86():
        return False
    flags = cpu_flags()
    if flags:
        return _REQUIRED_FLAGS[isa] <= flags
    probe = getattr(torch.cpu, _TORCH_PROBES[isa], None)
    return bool(probe and probe())


def supported() -> tuple[str, ...]:
    """The paths this CPU runs, best first (always ends with ``generic``)."""
    return tuple(isa for isa in ISAS if cpu_supports(isa))


def why_not(isa: str) -> str:
    """'' when the CPU runs `isa`, else a sentence saying what it lacks."""
    if cpu_supports(isa):
        return ""
    if not _is_x86():
        return f"the {isa} kernels are for x86-64 CPUs, this one is {os.uname().machine}"
    missing = sorted(_REQUIRED_FLAGS[isa] - cpu_flags()) if cpu_flags() else ["(torch's probe says no)"]
    return f"this CPU lacks {', '.join(missing)}, which the {isa} kernels need"


def selected() -> str:
    """The kernel path to use: `$CBSERVE_CPU_ISA` when set (ValueError if unknown or if the CPU lacks
    it), else the best the CPU runs."""
    return _selected(os.environ.get(ISA_ENV, "").strip().lower())


@functools.cache
def _selected(forced: str) -> str:
    if forced:
        if forced not in ISAS:
            raise ValueError(f"${ISA_ENV}={forced!r}: one of {ISAS}")
        reason = why_not(forced)
        if reason:
            raise ValueError(f"${ISA_ENV}={forced!r} cannot run here: {reason}")
        logger.info("CPU kernels: the %s path (forced by $%s)", forced, ISA_ENV)
        return forced
    return supported()[0]


def native_bf16() -> bool:
    """Whether the CPU has native bfloat16 dot products (AVX-512 BF16 or AMX-BF16)."""
    flags = cpu_flags()
    if flags:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def has_amx_bf16() -> bool:
    """Whether the CPU has AMX tiles with bfloat16 multiplies (oneDNN uses them; our kernels do not)."""
    flags = cpu_flags()
    if flags:
        return {"amx_bf16", "amx_tile"} <= flags
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype of ``dtype="auto"``: bfloat16 on a CPU with native bfloat16 dot products, else
    float32 (also on accelerators, which keep their previous default)."""
    if torch.device(device).type == "cpu" and native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype from ``"auto"`` (or None), a name (``"bfloat16"``, ``"float32"``...) or a dtype."""
    if dtype is None or dtype == "auto":
        chosen = auto_dtype(device)
        why = "native bfloat16 dot products" if chosen == torch.bfloat16 else "no native bfloat16 dot products"
        if torch.device(device).type != "cpu":
            why = f"a {torch.device(device).type} device"
        logger.info("dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating-point torch dtype name, got {dtype!r}")
    return resolved
