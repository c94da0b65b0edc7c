"""Which attention kernels the engine calls, chosen once at construction.

- ``cpu``: the C++ paged attention kernels (`cpu_kernels.py`: read the pages through the block
  table, no gathered copy; a path per instruction set; decode rows through one per-row routine
  with a fixed reduction order, so batch-invariant). The default on a CPU when the kernel builds
  (needs a C++ compiler and ninja). Unless ``batch_invariant=True``, prefill chunks
  go through faster kernels where the CPU has them (`kernels`): the tiled C++ prefill kernel, or
  SDPA as in ``sdpa``.
- ``sdpa``: PyTorch only (`paged_attention.py`): K/V rows gathered per step, then
  `scaled_dot_product_attention`. The fallback without CUDA when the C++ kernel cannot be built.
- ``triton``: the Triton kernels (`triton_attention.py`) read the pages through block tables;
  no gather, no host synchronisation, so decode steps can be captured in CUDA graphs. The
  default on CUDA. On a CPU it runs only under Triton's interpreter (tests).
- ``flash``: flash-attn 2 (`flash_attn_adapter.py`) for attention, Triton for storing K/V.
  Chosen on CUDA when flash-attn is importable and `auto_switch_to_flash` is on; it needs page
  sizes that are multiples of 256.
- ``reference``: the plain-PyTorch reference kernels, one request at a time: slow, for tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "sdpa", "triton", "flash", "reference")


@dataclass(frozen=True)
class KernelBackend:
    """Kernels over block tables; see `reference.py` for their shared signatures."""

    name: str
    store_kv: Callable[..., None]
    decode: Callable[..., torch.Tensor]  # q [B, H, D] -> [B, H, D]
    # packed q [T, H, D] -> [T, H, D]; None: prefill chunks go through the SDPA path, which also
    # stores K/V itself, and only decode rows use `decode` (the ``cpu`` backend).
    varlen: Callable[..., torch.Tensor] | None
    # flash-attn wants the longest query and context as host ints (else it syncs to find them).
    varlen_takes_max_seqlen: bool = False


def _triton_problem(device: torch.device) -> str:
    from cbserve.kernels import triton_attention as tri

    if not tri.TRITON_AVAILABLE:
        return f"triton is not importable ({tri._IMPORT_ERROR})"
    if device.type == "cpu" and not tri._INTERPRETED:
        return "the model is on the CPU, where Triton kernels run only under TRITON_INTERPRET=1 (tests)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton kernels do not run on {device.type} devices"
    return ""


def _cpu_problem(device: torch.device) -> str:
    from cbserve.kernels import cpu_kernels

    if device.type != "cpu":
        return f"the C++ decode kernel runs on CPUs, the model is on {device.type}"
    return cpu_kernels.unavailable_reason()


def _flash_problem(device: torch.device, page_size: int) -> str:
    from cbserve.kernels import flash_attn_adapter as fa

    if device.type != "cuda":
        return f"flash-attn runs only on CUDA devices, the model is on {device.type}"
    reason = fa.flash_unavailable_reason()
    if reason:
        return reason
    if page_size % fa.FLASH_PAGE_SIZE_MULTIPLE:
        return f"flash-attn's paged KV needs page_size to be a multiple of {fa.FLASH_PAGE_SIZE_MULTIPLE}, got {page_size}"
    return _triton_problem(device)  # K/V are stored by the Triton kernel


def select(requested: str, device: torch.device, page_size: int, auto_switch_to_flash: bool,
           batch_invariant: bool | None = None) -> str:
    """The backend to use; an explicit choice that cannot run raises ValueError saying why.

    `$CBSERVE_ATTENTION_BACKEND` overrides `requested` (like vLLM's VLLM_ATTENTION_BACKEND).
    `batch_invariant=True` needs the ``cpu`` backend (the only one whose reduction order per query
    row is fixed whatever the batch): anything else is refused, saying why.
    """
    requested = os.environ.get("CBSERVE_ATTENTION_BACKEND") or requested
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {requested!r}")
    problems = {
        "cpu": lambda: _cpu_problem(device),
        "sdpa": lambda: "",
        "reference": lambda: "",
        "triton": lambda: _triton_problem(device),
        "flash": lambda: _flash_problem(device, page_size),
    }
    if batch_invariant:
        if requested not in ("auto", "cpu"):
            raise ValueError(f"batch_invariant=True needs attention_backend 'cpu' (or 'auto'), got {requested!r}: "
                             "only the C++ CPU kernel fixes each query row's reduction order")
        problem = problems["cpu"]()
        if problem:
            raise ValueError(f"batch_invariant=True needs the C++ CPU attention kernel, which cannot run here: {problem}")
        logger.info("attention backend: cpu, batch-invariant (every row through the C++ kernel)")
        return "cpu"
    if requested != "auto":
        problem = problems[requested]()
        if problem:
            raise ValueError(f"attention_backend={requested!r} cannot run here: {problem}")
        logger.info("attention backend: %s (requested)", requested)
        return requested
    if device.type != "cuda":
        cpu_problem = problems["cpu"]()
        if not cpu_problem:
            how = "prefill through SDPA" if batch_invariant is False else "decode and prefill rows"
            logger.info("attention backend: cpu (C++ paged attention kernel: %s)", how)
            return "cpu"
        logger.warning("attention backend: sdpa (the C++ paged decode kernel is not used: %s)", cpu_problem)
        return "sdpa"
    flash_problem = problems["flash"]() if auto_switch_to_flash else "auto_switch_to_flash is off"
    if not flash_problem:
        logger.info("attention backend: flash (flash-attn %s)", _flash_version())
        return "flash"
    triton_problem = problems["triton"]()
    if not triton_problem:
        logger.info("attention backend: triton (flash-attn not used: %s)", flash_problem)
        return "triton"
    logger.warning("attention backend: sdpa (flash-attn: %s; triton: %s)", flash_problem, triton_problem)
    return "sdpa"


def _flash_version() -> str:
    import flash_attn

    return getattr(flash_attn, "__version__", "?")


def kernels(name: str, batch_invariant: bool | None = None, dtype: torch.dtype | None = None) -> KernelBackend | None:
    """The kernel functions of a backend; None for `sdpa`, which gathers and calls SDPA itself.

    ``cpu``: decode rows through the C++ per-row kernel (a fixed reduction order per row:
    batch-invariant). Prefill chunks, by `batch_invariant` and the CPU:
    - True: the same per-row kernel;
    - otherwise, bfloat16 on a CPU with AMX: SDPA, whose flash kernel multiplies on AMX tiles (8
      prompts of 256 tokens, default model, a 2-core AMX Xeon: attention 448 -> 216 ms a step);
    - otherwise, bfloat16 on the avx512_bf16 path, or float32 on an AVX-512 one: the tiled C++
      prefill kernel (`vdpbf16ps` / FMA tiles; on a 2-core Zen 4 from 128-token prompts 2-2.2x the
      per-row kernel in bfloat16, 1.75x in float32, and ~10x SDPA on one 2,000-token prompt);
    - otherwise False: SDPA; None: the per-row kernel (faster than SDPA on chunks up to ~1k
      tokens on CPUs without AMX)."""
    if name == "sdpa":
        return None
    if name == "cpu":
        from cbserve.kernels import cpu_isa, cpu_kernels

        bf16 = dtype == torch.bfloat16
        tiled = cpu_isa.selected() in (("avx512_bf16",) if bf16 else ("avx512", "avx512_bf16"))
        if batch_invariant:
            varlen = cpu_kernels.varlen_paged_attention
        elif bf16 and cpu_isa.has_amx_bf16():
            varlen = None
        elif tiled and dtype in (torch.bfloat16, torch.float32):
            varlen = cpu_kernels.tiled_prefill_attention
        else:
            varlen = None if batch_invariant is False else cpu_kernels.varlen_paged_attention
        return KernelBackend(name, cpu_kernels.store_kv, cpu_kernels.paged_decode_attention, varlen)
    if name == "reference":
        from cbserve.kernels import reference as ref

        return KernelBackend(name, ref.store_kv, ref.paged_decode_attention, ref.varlen_paged_attention)
    from cbserve.kernels import triton_attention as tri

    if name == "triton":
        return KernelBackend(name, tri.store_kv, tri.paged_decode_attention, tri.varlen_paged_attention)
    if name == "flash":
        from cbserve.kernels import flash_attn_adapter as fa

        return KernelBackend(name, tri.store_kv, fa.flash_decode_with_kvcache, fa.flash_varlen_paged,
                             varlen_takes_max_seqlen=True)
    raise ValueError(f"unknown attention backend {name!r}")
