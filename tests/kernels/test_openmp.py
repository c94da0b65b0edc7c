"""The calling thread hands its OpenMP team back (kernels/openmp.py), so that the engine thread's
team is the process's only one. Run in a fresh interpreter: this one's threads are pytest's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cbserve.kernels import openmp

SCRIPT = """
import os, torch
from cbserve.kernels import openmp
torch.set_num_threads(2)
def threads(): return len(os.listdir("/proc/self/task"))
before = threads()
torch.randn(2048, 2048) @ torch.randn(2048, 2048)  # a parallel region: this thread's team starts
with_team = threads()
print(before, with_team, openmp.release_thread_team(), threads())
"""

needs_gomp = pytest.mark.skipif(
    not torch.backends.openmp.is_available() or (os.cpu_count() or 1) < 2 or openmp._libgomp() is None,
    reason="needs torch on GNU OpenMP (libgomp) and 2 CPUs: a team of one has no worker thread to free")


def _run(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True)
    return out.stdout.split()


@needs_gomp
def test_the_calling_threads_team_is_freed() -> None:
    before, with_team, freed, after = _run({})
    assert int(with_team) == int(before) + 1  # one worker thread beside this one
    assert freed == "True" and int(after) == int(before)


@needs_gomp
def test_switched_off_the_team_stays() -> None:
    before, with_team, freed, after = _run({openmp.ENV: "0"})
    assert freed == "False" and int(after) == int(with_team) == int(before) + 1


def test_an_unknown_switch_value_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(openmp.ENV, "false")
    with pytest.raises(ValueError, match=openmp.ENV):
        openmp.release_thread_team()
