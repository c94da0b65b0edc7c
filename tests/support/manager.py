"""The manager tests' shared pieces: a hang guard (autouse where imported), managers built on
the tiny float64 Llama and destroyed after each test, greedy references and blocking getters."""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve import GenerationOutput
from cbserve.manager import ContinuousBatchingManager
from tests.support.tiny_models import reference_generate, tiny_model

TIMEOUT = 30.0  # for every blocking get
TEST_ALARM_S = 120  # per test, a guard against hangs (no pytest-timeout here)


def alarm_guard(seconds: int):
    """An autouse fixture (active in each module that imports it) that fails a test still running
    after `seconds` with a TimeoutError, instead of letting it hang the suite."""

    @pytest.fixture(autouse=True)
    def hang_guard() -> Iterator[None]:
        def on_alarm(signum, frame):  # runs in the main thread, interrupting a blocked wait
            raise TimeoutError(f"test still running after {seconds} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return hang_guard


hang_guard = alarm_guard(TEST_ALARM_S)


@functools.cache
def engine_model(arch: str = "llama", dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The model managers run on (its attention is swapped while an engine lives)."""
    return tiny_model(arch, dtype)


@functools.cache
def ref_model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    return tiny_model(arch, dtype)  # same seed, same weights, never touched by an engine


@functools.cache
def reference(prompt: tuple[int, ...], max_new: int, arch: str = "llama",
              dtype: torch.dtype = torch.float64) -> tuple[list[int], list[float]]:
    return reference_generate(ref_model(arch, dtype), list(prompt), max_new)


def ref_tokens(prompt: list[int], max_new: int, **kwargs) -> list[int]:
    return reference(tuple(prompt), max_new, **kwargs)[0]


def greedy_config(max_new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)


def engine_config(**overrides) -> cbserve.ContinuousBatchingConfig:
    cfg = {"page_size": 16, "num_blocks": 128, "max_batch_tokens": 128}
    cfg.update(overrides)
    return cbserve.ContinuousBatchingConfig(**cfg)


MakeManager = Callable[..., ContinuousBatchingManager]


@pytest.fixture
def make_manager() -> Iterator[MakeManager]:
    """Builds (and by default starts) managers; destroys them after the test, newest first,
    so each engine gives the model back the attention it found."""
    managers: list[ContinuousBatchingManager] = []

    def make(max_new: int = 8, model: torch.nn.Module | None = None, start: bool = True,
             generation_config: GenerationConfig | None = None, **cfg) -> ContinuousBatchingManager:
        manager = cbserve.init_continuous_batching(model or engine_model(),
                                                   generation_config or greedy_config(max_new),
                                                   engine_config(**cfg))
        managers.append(manager)
        if start:
            manager.start()
        return manager

    yield make
    for manager in reversed(managers):
        manager.destroy()


def get(manager: ContinuousBatchingManager, request_id: str | None = None) -> GenerationOutput:
    out = manager.get_result(request_id, timeout=TIMEOUT)
    assert out is not None, f"no output for {request_id} within {TIMEOUT} s"
    return out


def get_final(manager: ContinuousBatchingManager, request_id: str) -> GenerationOutput:
    while not (out := get(manager, request_id)).is_finished():
        pass
    return out


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def assert_all_pages_free(manager: ContinuousBatchingManager) -> None:
    stats = manager.stats()
    assert stats["live_requests"] == 0, stats
    assert stats["running"] == stats["waiting"] == 0, stats
    assert stats["free_pages"] == stats["total_pages"], stats


@contextlib.contextmanager
def paused(manager: ContinuousBatchingManager) -> Iterator[None]:
    """Hold the loop's lock (reentrant, so add_request still works here): requests added
    inside reach the loop together, whatever the machine's load."""
    with manager._cond:
        yield
