"""Tensor-parallel sharding of a `transformers` decoder (Megatron style).

Attention: q/k/v projections split by heads (output rows), o_proj by its input columns; MLP:
gate/up split by output rows, down_proj by input columns. The outputs of o_proj and down_proj
are partial sums, all-reduced across ranks. Embeddings, norms and the LM head are replicated.

A shard is a copy of the model whose config states the per-shard head counts, so the attention
modules, `ModelShape` and the paged KV cache (kv heads / N) all agree without special cases.
The user's model is never modified: replicated tensors and row slices are shared with it
(views), column slices are copied so that their matmuls read contiguous memory.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


def valid_tp_sizes(num_kv_heads: int) -> list[int]:
    return [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]


def _text_config(model: nn.Module):
    return model.config.get_text_config()


def _layers(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    attn = [m for m in model.modules() if all(isinstance(getattr(m, p, None), nn.Linear) for p in ATTENTION_PROJS)]
    mlp = [m for m in model.modules() if all(isinstance(getattr(m, p, None), nn.Linear) for p in MLP_PROJS)]
    return attn, mlp


def check_parallel_config(model: nn.Module, config) -> None:
    """Refuse a `ContinuousBatchingConfig` whose tensor parallelism cannot run, before any weight
    moves or process starts."""
    check_tp_size(model, config.tp_size)
    if config.cpu_offload_space != 0:
        raise ValueError("cpu_offload_space must be 0 with tp_size > 1: offloading pages across ranks is not "
                         "supported yet")


def check_tp_size(model: nn.Module, tp_size: int) -> None:
    """Refuse a `tp_size` the model cannot be split by, before any weight moves."""
    if tp_size == 1:
        return
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if kv_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's {kv_heads} KV heads (num_key_value_heads={kv_heads}); "
            f"tp_size must divide it: sizes that would work are {valid_tp_sizes(kv_heads)}"
        )
    intermediate = getattr(cfg, "intermediate_size", None)
    if intermediate is None or intermediate % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's MLP width (intermediate_size={intermediate})"
        )
    attn, mlp = _layers(model)
    layers = cfg.num_hidden_layers
    if len(attn) != layers or len(mlp) != layers:
        raise ValueError(
            f"tensor parallelism needs separate q/k/v/o_proj and gate/up/down_proj linears in every layer "
            f"(Llama, Qwen2, Qwen3, Mistral, ...); {type(model).__name__} has {len(attn)} such attention and "
            f"{len(mlp)} such MLP modules for {layers} layers"
        )


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _split_rows(linear: nn.Linear, rank: int, world: int) -> None:
    """Column-parallel: this rank's output features (a view, no copy)."""
    n = linear.out_features // world
    linear.weight = _param(linear.weight.detach()[rank * n : (rank + 1) * n])
    if linear.bias is not None:
        linear.bias = _param(linear.bias.detach()[rank * n : (rank + 1) * n])
    linear.out_features = n


def _split_cols(linear: nn.Linear, rank: int, world: int) -> None:
    """Row-parallel: this rank's input features; the bias is added once, by rank 0."""
    n = linear.in_features // world
    linear.weight = _param(linear.weight.detach()[:, rank * n : (rank + 1) * n].contiguous())
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = n


def shard_model(model: nn.Module, rank: int, world: int) -> nn.Module:
    """This rank's shard: a copy of `model` (sharing its tensors) with split projections and
    a config of per-shard head counts. `check_tp_size` must have passed."""
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    shard = copy.deepcopy(model, memo)
    cfg = _text_config(shard)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cfg.head_dim = head_dim  # stated, as it would no longer follow from hidden_size / heads
    cfg.num_attention_heads //= world
    cfg.num_key_value_heads = kv_heads // world
    cfg.intermediate_size //= world
    attn, mlp = _layers(shard)
    for module in attn:
        for name in ("q_proj", "k_proj", "v_proj"):
            _split_rows(getattr(module, name), rank, world)
        _split_cols(module.o_proj, rank, world)
        for name in ("num_heads", "num_attention_heads", "num_key_value_heads"):  # older module attrs
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, getattr(module, name) // world)
    for module in mlp:
        _split_rows(module.gate_proj, rank, world)
        _split_rows(module.up_proj, rank, world)
        _split_cols(module.down_proj, rank, world)
        if isinstance(getattr(module, "intermediate_size", None), int):
            module.intermediate_size //= world
    return shard


def _all_reduce(group: dist.ProcessGroup | None):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    return hook


def install_all_reduce(shard: nn.Module, group: dist.ProcessGroup | None) -> list:
    """Sum the partial outputs of every o_proj and down_proj across ranks (forward hooks)."""
    attn, mlp = _layers(shard)
    hook = _all_reduce(group)
    return [m.o_proj.register_forward_hook(hook) for m in attn] + [m.down_proj.register_forward_hook(hook)
                                                                  for m in mlp]
