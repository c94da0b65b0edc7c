"""The C++ kernels for CPUs, built on first use: paged attention (`csrc/paged_attention_cpu.cpp`:
decode rows and packed varlen rows, read straight from the pages; `csrc/prefill_attention_cpu.cpp`:
prompts' rows in tiles, not batch-invariant), linear layers on
panel-packed weights (`csrc/linear_cpu.cpp`; used by `packed_linear.py`), the fused elementwise
parts of a Llama decoder layer (`csrc/layer_ops_cpu.cpp`; used by `llama_forward.py`), a decode
step's decoder layers as one call of those kernels (`csrc/decoder_layers_cpu.cpp`) and the LoRA
deltas of rows of different adapters (`csrc/lora_cpu.cpp`; used by `lora.py`).

Each kernel has one path per instruction set (AVX2, AVX-512, AVX-512 BF16; `cpu_isa.py`), each
compiled with its own target attributes, so the build is the same on every x86-64 machine and the
path is chosen at run time: `cpu_isa.selected()`, or an explicit ``isa`` argument (tests run every
path the machine has).

Decode rows read K/V straight from the pages through the block table, a request's whole token
rows at a time (sequential memory reads), instead of gathering a padded copy for SDPA (2.4-3.3x
faster than gather + SDPA at 128 requests with 20-1000 cached tokens on a 2-core EPYC). Same
signatures and semantics as `reference.paged_decode_attention` / `reference.varlen_paged_attention`.

The extension is compiled once with `torch.utils.cpp_extension` (~30 s; needs a C++ compiler and
ninja) and cached under `$TORCH_EXTENSIONS_DIR` (default ~/.cache/torch_extensions) by a name that
carries a digest of the sources and flags, so builds of other versions never collide. When it
cannot be built, `unavailable_reason()` says why and the engine falls back to SDPA and oneDNN.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from cbserve.kernels import cpu_isa

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in (
    "paged_attention_cpu.cpp", "prefill_attention_cpu.cpp", "linear_cpu.cpp", "layer_ops_cpu.cpp",
    "quant_linear_cpu.cpp", "lora_cpu.cpp", "decoder_layers_cpu.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("vector_paths.h", "exp_vector.h", "task_queue.h")]  # included by sources: in the build's digest too
# No -march=native: every instruction-set path carries its own target attributes, and the generic
# code must run on any x86-64 CPU. OpenMP: ATen's parallel_for.
CFLAGS = ["-O3", "-fopenmp"]


def extension_name() -> str:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    return f"cbserve_cpu_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def unavailable_reason() -> str:
    """'' when the kernels are loaded (building them if needed), else why they cannot be."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler() if hasattr(cpp_extension, "get_cxx_compiler") else "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not _find_ninja(cpp_extension):
        return "ninja is not installed (pip install ninja)"
    try:
        cpp_extension.load(
            name=extension_name(),
            sources=[str(p) for p in SOURCES],
            extra_cflags=CFLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - a compiler error must not take the engine down: SDPA works
        return f"building the CPU kernels failed: {type(exc).__name__}: {str(exc)[-500:]}"
    logger.info("CPU kernels loaded (%s); paths this CPU runs: %s", ", ".join(p.name for p in SOURCES),
                ", ".join(cpu_isa.supported()))
    return ""


def _find_ninja(cpp_extension) -> bool:
    """torch runs `ninja` from PATH; pip's ninja lives in a virtualenv's bin, not on PATH unless
    the virtualenv is activated (a bare `.venv/bin/python`, Ray workers)."""
    if cpp_extension.is_ninja_available():
        return True
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.is_ninja_available()


def load() -> None:
    """Build or load the kernels; RuntimeError saying why they cannot be."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"the C++ CPU kernels are unavailable: {reason}")


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value ``[T, kvH, D]`` into the pages at `slot_mapping` ``[T]``, slot -1 skipped like
    `reference.store_kv`: a row copy per token in C++ (ATen's `index_copy_` moves one value at a time)."""
    load()
    torch.ops.cbserve_cpu.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """One query per request (``q`` ``[B, H, D]``) at position ``context_lens[b] - 1``; out ``[B, H, D]``.
    Tables and lengths: int32 or int64."""
    load()
    return torch.ops.cbserve_cpu.paged_decode(
        q.contiguous(), k_cache, v_cache, block_tables, context_lens,
        float(scale), int(sliding_window or 0), float(softcap or 0.0), isa or cpu_isa.selected(),
    )


def varlen_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """Packed queries ``q`` ``[T, H, D]`` (request b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``,
    the last of its ``context_lens[b]`` positions), causal over its pages; returns ``[T, H, D]``.

    Every row, decode or prefill, goes through the same routine with a fixed reduction order, so a
    row's output does not depend on the rest of the batch (see the C++ file)."""
    load()
    return torch.ops.cbserve_cpu.paged_attention(
        q.contiguous(), k_cache, v_cache, cu_seqlens_q, block_tables, context_lens,
        float(scale), int(sliding_window or 0), float(softcap or 0.0), isa or cpu_isa.selected(),
    )


def tiled_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """`varlen_paged_attention`'s semantics, a prompt's rows in tiles (flash-attention style, see
    the C++ file): several times faster on prompts, but a row's sums depend on how its request's
    rows were split, so not batch-invariant. bfloat16 on the avx512_bf16 path, float32 on avx512 or
    avx512_bf16, with a head dimension the tiles take (`tiled_prefill_runs`); anything else goes to
    `varlen_paged_attention`."""
    isa = isa or cpu_isa.selected()
    if not tiled_prefill_runs(q.dtype, q.shape[-1], isa):
        return varlen_paged_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale,
                                      sliding_window, softcap, isa)
    return torch.ops.cbserve_cpu.paged_prefill_attention(
        q.contiguous(), k_cache, v_cache, cu_seqlens_q, block_tables, context_lens,
        float(scale), int(sliding_window or 0), float(softcap or 0.0), isa,
    )


@functools.cache
def tiled_prefill_runs(dtype: torch.dtype, head_dim: int, isa: str) -> bool:
    """Whether `tiled_prefill_attention` has a path for these (else it runs the per-row routine)."""
    load()
    isas = {torch.bfloat16: ("avx512_bf16",), torch.float32: ("avx512", "avx512_bf16")}.get(dtype, ())
    return isa in isas and torch.ops.cbserve_cpu.tiled_prefill_available(str(dtype).removeprefix("torch."), head_dim)


def layer_ops_isa(isa: str | None = None) -> str:
    """The fused layer ops' path: `isa` when given, else ``avx512`` on a CPU with AVX-512 (its
    ``avx512_bf16`` path included: the ops need no BF16 instruction), ``avx2`` on one with AVX2 and
    ``generic`` elsewhere."""
    if isa:
        return isa
    selected = cpu_isa.selected()
    return "avx512" if selected.startswith("avx512") else selected


def add_rms_norm_(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  isa: str | None = None) -> torch.Tensor:
    """``residual += x`` in place (x may be None), then RMSNorm(residual) * weight, as transformers'
    Llama RMSNorm rounds it (float32 / bfloat16)."""
    load()
    return torch.ops.cbserve_cpu.add_rms_norm_(x, residual, weight, float(eps), layer_ops_isa(isa))


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int,
          isa: str | None = None) -> None:
    """Rotary embedding in place on the first `heads` heads of each row of ``qkv`` ``[T, W]``;
    cos/sin ``[T, head_dim]`` of qkv's dtype (transformers' rotate-half convention)."""
    load()
    torch.ops.cbserve_cpu.rope_(qkv, cos, sin, heads, head_dim, layer_ops_isa(isa))


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` from ``gate_up`` ``[.., 2I]`` (gate first); returns ``[.., I]``."""
    load()
    return torch.ops.cbserve_cpu.silu_mul(gate_up, layer_ops_isa(isa))


def greedy(logits: torch.Tensor, isa: str | None = None,
           logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row of ``logits`` ``[R, V]`` (float32): its argmax (the first index of the largest
    value, as torch's) and that token's log-probability; ``(tokens int64 [R], logprobs [R])``.
    ``logprobs=False``: ``(tokens, None)``, without the pass of exponentials (most of the op's time)."""
    load()
    tokens, chosen = torch.ops.cbserve_cpu.greedy(logits, layer_ops_isa(isa), logprobs)
    return tokens, chosen if logprobs else None


def lora_delta_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, row_slots: torch.Tensor,
                part_ends: torch.Tensor, rank: int, isa: str | None = None) -> None:
    """``y`` ``[T, O]`` += each row's LoRA delta through its slot's factors (`row_slots` int64
    ``[T]``, -1: none): ``a`` ``[P * S * rank, I]``, ``b_t`` ``[S * rank, O]``, the projection's
    P parts ending at `part_ends` in O (see `csrc/lora_cpu.cpp`)."""
    load()
    torch.ops.cbserve_cpu.lora_delta_(y, x, a, b_t, row_slots, part_ends, int(rank), layer_ops_isa(isa))
