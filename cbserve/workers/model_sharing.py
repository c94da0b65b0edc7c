"""The model stays the user's while an engine holds it.

An engine switches the model's attention implementation to cbserve's (`kernels/paged_attention.py`,
under its name `cbserve_paged`) and, on a CPU, swaps its linear layers for packed ones. Two things
keep the model usable meanwhile:

- the attention and mask functions registered under that name fall back to the implementation
  the model had before (sdpa, eager, flash, ...) outside the engine's own forward passes, so a plain
  `model(...)` or `model.generate(...)`, from any thread, returns what it returns without cbserve
  (the engine's passes are told apart by their `cb_meta` argument and, for the mask, which builds
  before any layer runs, by a thread-local flag the engine sets around its forward);
- `take_attention` / `give_back_attention` track the engines holding a model: the last one out
  gives it back its own implementation (the manager's stop() and pause()).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cbserve.kernels import paged_attention

ATTENTION_NAME = paged_attention.ATTENTION_NAME

_local = threading.local()  # .in_forward: this thread runs an engine's forward pass
_lock = threading.Lock()
# id(config) -> (the config, the implementation it had before the first engine took it)
_own: dict[int, tuple[weakref.ref, str]] = {}
# id(model) -> (the model, the engines holding it)
_holders: dict[int, tuple[weakref.ref, weakref.WeakSet]] = {}


@contextmanager
def engine_forward() -> Iterator[None]:
    """Marks this thread's forward passes as the engine's: the mask function builds no mask."""
    previous = getattr(_local, "in_forward", False)
    _local.in_forward = True
    try:
        yield
    finally:
        _local.in_forward = previous


def in_engine_forward() -> bool:
    return getattr(_local, "in_forward", False)


def own_implementation(config: Any) -> str | None:
    """The attention implementation `config` had before an engine took its model; None if unknown."""
    entry = _own.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def _own_attention(module: torch.nn.Module, own: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is not in the registry: each modeling file has its own (Gemma 2's soft-caps, ...).
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own == "eager" or own not in ALL_ATTENTION_FUNCTIONS and own != "paged|eager":
        if eager is None:
            raise RuntimeError(f"{type(module).__name__}: no eager attention function to fall back to outside the "
                               f"cbserve engine ({type(module).__module__} defines no eager_attention_forward)")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(own, eager)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine's paged attention inside its steps (`cb_meta` given), the model's own elsewhere."""
    own = own_implementation(getattr(module, "config", None))
    if kwargs.get("cb_meta") is not None or own is None:  # the engine's pass (or nothing to fall back to)
        return paged_attention.paged_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _own_attention(module, own)(module, query, key, value, attention_mask, **kwargs)


def mask(*args, **kwargs) -> Any:
    """No mask inside the engine's passes (the attention reads block tables); the model's own mask
    function elsewhere."""
    own = None if in_engine_forward() else own_implementation(kwargs.get("config"))
    if own is None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if own not in ALL_MASK_ATTENTION_FUNCTIONS:  # what transformers does for such an implementation
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[own](*args, **kwargs)


_disabled_attention = torch.compiler.disable(attention_forward)  # per-step Python control flow


def register() -> None:
    """Register the two functions under cbserve's attention name (over the kernels' own entries)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    paged_attention.register()
    AttentionInterface.register(ATTENTION_NAME, _disabled_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, mask)


def _forget(table: dict, key: int) -> Callable[[Any], None]:
    return lambda _: table.pop(key, None)


def _configs(model: torch.nn.Module) -> list[Any]:
    from transformers import PretrainedConfig

    found = {id(model.config): model.config} if isinstance(getattr(model, "config", None), PretrainedConfig) else {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            found.setdefault(id(config), config)
    return list(found.values())


def take_attention(model: torch.nn.Module, holder: object) -> str:
    """Switch `model` to cbserve's attention for `holder` (an engine); returns the implementation
    it had. Several engines may hold one model: see `give_back_attention`."""
    register()
    previous = model.config._attn_implementation
    with _lock:
        entry = _holders.get(id(model))
        if entry is None or entry[0]() is not model:
            entry = (weakref.ref(model, _forget(_holders, id(model))), weakref.WeakSet())
            _holders[id(model)] = entry
        if not entry[1]:
            for config in _configs(model):
                implementation = config._attn_implementation
                if implementation != ATTENTION_NAME:  # else the entry of an earlier engine holds
                    _own[id(config)] = (weakref.ref(config, _forget(_own, id(config))), implementation)
            model.set_attn_implementation(ATTENTION_NAME)
        entry[1].add(holder)
    return previous


def give_back_attention(model: torch.nn.Module, holder: object) -> None:
    """`holder` lets go of `model`; once no live engine holds it (one dropped without giving it
    back counts no more), the model gets its own attention implementation back."""
    with _lock:
        entry = _holders.get(id(model))
        if entry is None or entry[0]() is not model:
            return
        entry[1].discard(holder)
        if entry[1]:
            return
        own = own_implementation(model.config)
        if own is not None and model.config._attn_implementation == ATTENTION_NAME:
            model.set_attn_implementation(own)
