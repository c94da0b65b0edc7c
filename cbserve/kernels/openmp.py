"""One OpenMP thread team per process where it can be: the engine thread's.

GNU OpenMP (the runtime torch's CPU wheels bundle) gives every thread that starts a parallel region
a team of worker threads of its own, kept for that thread's life. The engine steps in a thread of
its own, while the thread that built it (loaded the model, packed the weights) already holds a
team. Once libgomp manages more threads than the process has CPUs it spins ~100 iterations instead
of ~300,000 before a worker sleeps (`gomp_throttled_spin_count_var`), so each of a step's ~200
parallel GEMMs and kernels then wakes its workers through the kernel (futex): measured here, the
same GEMMs ran 20-170% slower in a second thread than in the first. vLLM does not meet this: its
engine steps in its process's main thread.

`release_thread_team()`, called by the thread that built the engine just before the engine
thread starts, hands that thread's team back (`omp_pause_resource_all`, OpenMP 5.0), so the engine
thread's team is the only one. A thread that later runs parallel torch ops again gets a new team
(and the throttle is back until it exits); a process on another OpenMP runtime (Intel's or LLVM's)
is left alone. `$CBSERVE_OMP_RELEASE=0` keeps the team (A/B benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "CBSERVE_OMP_RELEASE"
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime already loaded in this process (torch's), None when there is none."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line})
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])  # the loaded copy: dlopen of a loaded path returns it
    if not hasattr(lib, "omp_pause_resource_all"):  # libgomp before GCC 9
        return None
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP worker threads; True when freed (or it had none)."""
    switch = os.environ.get(ENV, "1").strip()
    if switch not in ("0", "1"):
        raise ValueError(f"${ENV} must be 0 (keep the team) or 1 (release it), got {switch!r}")
    lib = _libgomp()
    if lib is None or switch == "0":
        return False
    freed = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not freed:  # -1: inside a parallel region, or the team is busy
        logger.debug("omp_pause_resource_all refused: this thread's OpenMP team is kept")
    return freed
