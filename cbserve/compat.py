"""`cbserve.attach(model)`: transformers' continuous-batching methods of a model, run by cbserve.

After `attach(model)`, code written for transformers' engine runs unchanged:
`model.generate_batch(...)`, `model.init_continuous_batching(...)`,
`model.continuous_batching_context_manager(...)` and
`model.destroy_cached_continuous_batching_manager()` take transformers' arguments, with its
defaults, and return what it returns (outputs keyed "req_0", ...); the managers are cbserve's.
Only this model instance changes (its instance attributes shadow the class's methods);
`detach(model)` removes them.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig

from cbserve import api
from cbserve.manager import ContinuousBatchingManager
from cbserve.outputs import GenerationOutput

logger = logging.getLogger(__name__)

METHODS = ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager",
           "destroy_cached_continuous_batching_manager")


def init_continuous_batching(
    self: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: Any = None,
    workload_hints: Any = None,
) -> ContinuousBatchingManager:
    """transformers' `init_continuous_batching`: a manager (not started), or the one kept on the model."""
    return api.init_continuous_batching(self, generation_config, continuous_batching_config, workload_hints)


def destroy_cached_continuous_batching_manager(self: torch.nn.Module) -> None:
    """Destroy the manager kept on the model (if any) and free its cache."""
    api.destroy_cached_continuous_batching_manager(self)


@contextmanager
def continuous_batching_context_manager(
    self: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: Any = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: Any = None,
) -> Iterator[ContinuousBatchingManager]:
    """transformers' context manager: a started manager, stopped on exit (`block`, `timeout`),
    then destroyed unless `persistent_manager`."""
    with api.continuous_batching(self, generation_config, continuous_batching_config, persistent_manager,
                                 block=block, timeout=timeout, warmup=warmup, workload_hints=workload_hints) as manager:
        yield manager


def generate_batch(
    self: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: Any = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """transformers' `generate_batch`: outputs keyed "req_0", ... in input order, failed requests
    included (status FAILED). `max_new_tokens` is the one keyword transformers reads from `kwargs`;
    others are ignored, as there, with a warning here, but cbserve's `lora` (its LoRA adapters)."""
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    lora = kwargs.pop("lora", None)
    if kwargs:
        logger.warning("generate_batch ignores %s (transformers reads only max_new_tokens from its kwargs)",
                       sorted(kwargs))
    return api.generate_batch(self, inputs, generation_config, continuous_batching_config, progress_bar,
                              record_timestamps, persistent_manager, warmup, max_new_tokens, lora)


_FUNCTIONS = {
    "generate_batch": generate_batch,
    "init_continuous_batching": init_continuous_batching,
    "continuous_batching_context_manager": continuous_batching_context_manager,
    "destroy_cached_continuous_batching_manager": destroy_cached_continuous_batching_manager,
}


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model`'s continuous-batching methods cbserve's (this instance only); returns `model`."""
    for name in METHODS:
        object.__setattr__(model, name, types.MethodType(_FUNCTIONS[name], model))
    return model


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `attach`: the model's class methods (transformers' engine) again."""
    for name in METHODS:
        model.__dict__.pop(name, None)
    return model

