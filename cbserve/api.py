"""Entry points: `generate_batch` (offline, blocks until every prompt is done) and the
manager's constructors (online)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.manager import ContinuousBatchingManager
from cbserve.outputs import GenerationOutput
from cbserve.workers import offline


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = True,
) -> dict[str, GenerationOutput]:
    """Run every prompt through the engine; returns outputs keyed "req_0", "req_1", ... in
    input order. Invalid prompts raise `ValueError` before anything runs."""
    return offline.generate(model, inputs, generation_config, continuous_batching_config, progress_bar)


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> ContinuousBatchingManager:
    """Build a manager (not started) owning an engine for `model`."""
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config)


@contextmanager
def continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager; on exit it is stopped (finishing its work), then destroyed unless
    `persistent_manager`, in which case it stays on the model for the next context."""
    manager = getattr(model, "_cbserve_manager", None) if persistent_manager else None
    if manager is None:
        manager = init_continuous_batching(model, generation_config, continuous_batching_config)
        if persistent_manager:
            model._cbserve_manager = manager
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()
        if not persistent_manager:
            manager.destroy()
