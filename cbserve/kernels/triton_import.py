"""Triton, optional (CPU-only installs, macOS...; a broken install raises at import): the Triton
kernel modules take it from here. `triton` and `tl` are None without it, and `IMPORT_ERROR` says why."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR = ""
except (ImportError, OSError, RuntimeError) as exc:  # missing, or a broken install
    triton = tl = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

TRITON_AVAILABLE = triton is not None
