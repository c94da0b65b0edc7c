"""torch.compile of the model's forward, by compile level or explicit configs.

Two paths are compiled separately: decode-only batches and varlen (prefill or mixed) batches.
Level 1: mode "default", dynamic shapes; 2: "max-autotune-no-cudagraphs", dynamic; 3: the same,
static. Explicit `varlen_compile_config` / `decode_compile_config` (torch.compile keyword
arguments) win over the level. The attention function is excluded from the graph (it holds
per-step Python control flow); everything between attention calls is compiled and fused.

Eager (no compile config) on a CPU, a Llama model runs `kernels/llama_forward.py`'s lean forward
on its own weights instead of transformers' (fused projections and elementwise ops; see there).

With static shapes, the token count is padded up to a bucket (a multiple of
`q_padding_interval_size`, else the next power of two) so that a new step size does not
recompile; padded rows carry no K/V and are never sampled.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cbserve.kernels import llama_forward

logger = logging.getLogger(__name__)

LEVELS: dict[int, dict[str, Any]] = {
    1: {"mode": "default", "dynamic": True},
    2: {"mode": "max-autotune-no-cudagraphs", "dynamic": True},
    3: {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
}


def resolve(level: int, explicit: dict[str, Any] | None) -> dict[str, Any] | None:
    """torch.compile kwargs for one path, or None for eager."""
    if explicit is not None:
        return dict(explicit)
    return dict(LEVELS[level]) if level > 0 else None


def bucket(n: int, interval: int) -> int:
    """The padded size of a static-shape dimension of `n` elements."""
    if interval > 0:
        return -(-n // interval) * interval
    return 1 << max(n - 1, 0).bit_length()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of a transformers model: its longest ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError("cannot compile: no nn.ModuleList of decoder layers in the model")
    return max(lists, key=len)


class CompiledForward:
    """Calls the model's forward with its decoder layers compiled per path when configured.

    Regional compilation: each decoder layer is compiled, not the whole model, so the layers
    share one compiled graph (weights are graph inputs) and the graph break at our attention
    call stays inside each layer instead of multiplying resume frames across the model.
    """

    def __init__(self, model: torch.nn.Module, varlen: dict[str, Any] | None, decode: dict[str, Any] | None,
                 q_padding_interval: int = 0) -> None:
        self.model = model
        self.q_padding_interval = q_padding_interval
        self.configs = {"varlen": varlen, "decode": decode}
        self.path = "varlen"
        self.layers = decoder_layers(model) if self.enabled else []
        self._eager = [layer.forward for layer in self.layers]
        self._compiled = {
            path: [torch.compile(fwd, **kwargs) for fwd in self._eager] if kwargs is not None else None
            for path, kwargs in self.configs.items()
        }
        self.lean = None
        self.hidden: torch.Tensor | None = None  # the last call's `pooled_rows` hidden states
        if not self.enabled:
            reason = llama_forward.unsupported_reason(model)
            self.lean = None if reason else llama_forward.LlamaForward(model)
            logger.info("forward pass: %s", f"transformers' ({reason})" if reason else "the lean Llama forward")
        self.install()
        for path, kwargs in self.configs.items():
            if kwargs is not None:
                logger.info("compiling the %s path's decoder layers with %s", path, kwargs)

    def _dispatcher(self, eager, index: int):
        def forward(*args, **kwargs):
            compiled = self._compiled[self.path]
            if compiled is None or kwargs.get("cb_meta") is None:  # a plain forward of the model's owner
                return eager(*args, **kwargs)
            return compiled[index](*args, **kwargs)

        return forward

    def install(self) -> None:
        """Route the layers' forward through the compiled paths (undone by `restore`)."""
        for layer, eager, index in zip(self.layers, self._eager, range(len(self.layers))):
            layer.forward = self._dispatcher(eager, index)

    def restore(self) -> None:
        """Give the layers back their eager forward."""
        for layer, eager in zip(self.layers, self._eager):
            layer.forward = eager

    @property
    def enabled(self) -> bool:
        return any(kwargs is not None for kwargs in self.configs.values())

    def static(self, path: str) -> bool:
        kwargs = self.configs[path]
        return kwargs is not None and kwargs.get("dynamic") is False

    def __call__(self, kwargs: dict, decode_only: bool, pooled_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of the kept rows; with `pooled_rows`, `hidden` is then those rows' final
        hidden states (after the model's last norm), [rows, hidden] (`pooling.py`)."""
        self.path = "decode" if decode_only else "varlen"
        num_sampled = kwargs["logits_to_keep"].numel()
        if self.static(self.path):
            kwargs = self._pad(kwargs)
        if self.lean is not None:
            logits, self.hidden = self.lean(kwargs, pooled_rows)
            return logits[0, :num_sampled]
        if pooled_rows is None:
            self.hidden = None
            return self.model(**kwargs).logits[0, :num_sampled]
        taken: list[torch.Tensor] = []
        # The base model's output is its last (normed) hidden state, whatever the architecture.
        hook = self.model.base_model.register_forward_hook(lambda _m, _a, out: taken.append(out[0][0, pooled_rows]))
        try:
            logits = self.model(**kwargs).logits[0, :num_sampled]
        finally:
            hook.remove()
        self.hidden = taken[0]
        return logits

    def _pad(self, kwargs: dict) -> dict:
        """Pad tokens and sampled rows to their buckets (static shapes)."""
        ids, pos, keep = kwargs["input_ids"], kwargs["position_ids"], kwargs["logits_to_keep"]
        t, s = ids.shape[1], keep.numel()
        tp, sp = bucket(t, self.q_padding_interval), bucket(s, 0)
        if tp > t:
            ids = torch.nn.functional.pad(ids, (0, tp - t))
            pos = torch.nn.functional.pad(pos, (0, tp - t))
        if sp > s:
            keep = torch.cat([keep, keep[-1:].expand(sp - s)])
        return {**kwargs, "input_ids": ids, "position_ids": pos, "logits_to_keep": keep}
