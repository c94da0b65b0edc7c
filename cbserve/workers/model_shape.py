"""The few numbers of a model's architecture the engine sizes its cache and checks requests by."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _vocab_size(head: torch.nn.Module) -> int:
    # A tensor-parallel head split by vocabulary rows states the whole vocabulary.
    return getattr(head, "vocab_size", None) or getattr(head, "out_features", None) or head.weight.shape[0]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        cfg = model.config.get_text_config()
        num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window,) * num_layers
        return cls(
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=_vocab_size(model.get_output_embeddings()),
            max_context=getattr(cfg, "max_position_embeddings", None) or 2**31,
            sliding_windows=windows,
        )

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.sliding_windows)
