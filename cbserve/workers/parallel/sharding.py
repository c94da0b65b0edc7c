"""Tensor-parallel sharding of a `transformers` decoder (Megatron style), driven by the model's
own tensor-parallel plan.

Which linear layer splits how comes from the config's `base_model_tp_plan`, the plan
`transformers` ships for Llama, Qwen2/3, Mistral, Gemma 2 and most decoders:

- ``colwise`` (q/k/v, gate/up): split by output rows; each rank holds its attention heads and
  its slice of the MLP width.
- ``rowwise`` (o_proj, down_proj): split by input columns; their partial outputs are
  all-reduced across ranks (a forward hook), the bias added by rank 0 only.
- ``replicated_with_grad_allreduce`` (Qwen3's q/k norms), ``embedding_rowwise`` and everything
  the plan does not name (embeddings, norms): replicated. Replication is always exact; it only
  costs memory.
- The LM head (``colwise_gather_output`` in the models' own plans): split by vocabulary rows
  when the vocabulary divides; each rank computes its slice of the sampled rows' logits and
  rank 0 gathers them (`VocabParallelHead`). With tied embeddings the slice is a view of the
  (replicated) input embedding: no memory at all, and a third of the head's work per rank.

With `quantization`, each rank quantizes its own shard once it is made (`quantize_shard`): its
layers hold their part of the whole model's blocks (`kernels/quantized.BlockShard`), split along
whole blocks of 32 input features (`check_block_alignment` refuses a tp_size that would cut one).

A model without a plan whose layers have q/k/v/o_proj and gate/up/down_proj linears gets the
Llama plan. Other styles (fused ``packed_colwise`` projections, MoE experts, ...) are refused,
naming the module, before any weight moves.

We read the plan but not `transformers`' tensor-parallel implementation: that one makes every
parameter a DTensor and routes each layer through DTensor dispatch (a per-op cost on small CPU
batches, weights the CPU kernels cannot pack), runs its collectives on its own device mesh
rather than the engine's bounded groups, and needs the process group before the model is
loaded. Plain tensors and two all-reduces per layer serve inference better.

A shard is a model whose config states the per-shard head counts, so the attention modules,
`ModelShape` and the paged KV cache (kv heads / N) all agree without special cases. It is made
either from a model in memory (`shard_model`: views of the caller's tensors, the caller's model
untouched) or straight from a checkpoint (`loading.load_shard`: only this rank's slices are
read). Either way it carries a `ShardSpec` (`model.cbserve_shard`).
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cbserve.kernels.quantized import BLOCK, QUANTIZED_AS, BlockShard, QuantizedLinear, quantize_model

logger = logging.getLogger(__name__)

COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"
# transformers' style names -> what a rank does with the module.
STYLES = {"colwise": COLWISE, "rowwise": ROWWISE, "replicated_with_grad_allreduce": REPLICATE,
          "embedding_rowwise": REPLICATE, "colwise_gather_output": REPLICATE}
LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
SHARD_ATTR = "cbserve_shard"


@dataclass(frozen=True)
class ShardSpec:
    """What a shard is: rank `rank` of `world`, loaded from `source` (a checkpoint folder the
    other ranks can read their own shards from; None for a shard of a model in memory)."""

    rank: int
    world: int
    source: str | None = None
    dtype: torch.dtype | None = None


def shard_spec(model: nn.Module) -> ShardSpec | None:
    return getattr(model, SHARD_ATTR, None)


def is_shard(model: nn.Module) -> bool:
    """Already one rank's shard (a model loaded with world 1 is whole, and is sharded as any other)."""
    spec = shard_spec(model)
    return spec is not None and spec.world > 1


def valid_tp_sizes(num_kv_heads: int) -> list[int]:
    return [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]


def _text_config(model: nn.Module):
    return model.config.get_text_config()


def _plan(model: nn.Module) -> dict[str, str]:
    plan = getattr(_text_config(model), "base_model_tp_plan", None) or getattr(model.config, "base_model_tp_plan",
                                                                                 None)
    return dict(plan) if plan else LLAMA_PLAN


def tp_rules(model: nn.Module) -> dict[str, str]:
    """Module path -> COLWISE / ROWWISE / REPLICATE for every module the plan names (paths as in
    `model.named_modules()`); raises ValueError for a style this engine does not run."""
    plan = _plan(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    rules: dict[str, str] = {}
    for path, module in model.named_modules():
        relative = path[len(prefix) + 1:] if prefix and path.startswith(prefix + ".") else path
        style = plan.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), relative))
        if style is None:
            continue
        rule = STYLES.get(style)
        if rule is None:
            raise ValueError(f"tensor parallelism: {type(model).__name__}'s plan shards {path} as {style!r}, which "
                             f"cbserve does not run (it runs {sorted(STYLES)})")
        if rule != REPLICATE and not isinstance(module, (nn.Linear, QuantizedLinear)):
            raise ValueError(f"tensor parallelism: {path} is planned {style!r} but is a {type(module).__name__}, "
                             "not a Linear")
        rules[path] = rule
    return rules


def check_parallel_config(model: nn.Module, config) -> None:
    """Refuse a `ContinuousBatchingConfig` whose tensor parallelism cannot run, before any weight
    moves or process starts."""
    spec = shard_spec(model)
    if is_shard(model):
        if spec.world != config.tp_size:
            raise ValueError(f"the model is shard {spec.rank} of {spec.world} but tp_size={config.tp_size}; "
                             f"load it with world={config.tp_size}")
    else:
        done = getattr(model, QUANTIZED_AS, None)
        if done is not None:
            raise ValueError(f"tp_size={config.tp_size}: this model's layers were quantized in place by an earlier "
                             f"engine (quantization={done!r}); load the model again to shard it")
        check_tp_size(model, config.tp_size)
    if config.quantization != "none":
        check_block_alignment(model, config.tp_size)


def check_block_alignment(model: nn.Module, tp_size: int) -> None:
    """Quantized weights are split along whole blocks of `BLOCK` input features: refuse a tp_size
    that would cut a row-parallel layer's blocks (a layer too narrow for blocks stays dense
    whatever the tp_size)."""
    shards = tp_size if is_shard(model) else 1  # a shard's layers hold 1 / tp_size of the features
    for path, rule in tp_rules(model).items():
        if rule != ROWWISE:
            continue
        whole = model.get_submodule(path).in_features * shards
        if whole % BLOCK == 0 and (whole // tp_size) % BLOCK:
            raise ValueError(f"quantization with tp_size={tp_size}: {path}'s {whole} input features split "
                             f"{tp_size} ways ({whole // tp_size} each) would cut its blocks of {BLOCK}; "
                             f"choose a tp_size that divides {whole // BLOCK} blocks, or quantization='none'")


def check_tp_size(model: nn.Module, tp_size: int) -> None:
    """Refuse a `tp_size` the model cannot be split by, before any weight moves."""
    if tp_size == 1:
        return
    spec = shard_spec(model)
    if is_shard(model):
        if spec.world != tp_size:
            raise ValueError(f"the model is already shard {spec.rank} of {spec.world}, not of tp_size={tp_size}")
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
    _check_rules(model, tp_rules(model), tp_size)


def _check_rules(model: nn.Module, rules: dict[str, str], tp_size: int) -> None:
    split = {p: r for p, r in rules.items() if r != REPLICATE}
    layers = _text_config(model).num_hidden_layers
    rowwise = sum(r == ROWWISE for r in split.values())
    if not split or rowwise < layers:
        raise ValueError(
            f"tensor parallelism needs a plan splitting every layer's attention and MLP (Llama, Qwen2, Qwen3, "
            f"Mistral, Gemma 2, ...); {type(model).__name__} has {len(split)} split linears, {rowwise} of them "
            f"row-parallel, for {layers} layers"
        )
    for path, rule in split.items():
        linear = model.get_submodule(path)
        width = linear.out_features if rule == COLWISE else linear.in_features
        if width % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide {path} ({rule}, {width} features)")


def shard_config(cfg, world: int) -> None:
    """State the per-shard head counts and MLP width in `cfg` (a shard's own copy)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cfg.head_dim = head_dim  # stated, as it would no longer follow from hidden_size / heads
    cfg.num_attention_heads //= world
    cfg.num_key_value_heads = kv_heads // world
    cfg.intermediate_size //= world


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


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary rows: this rank's logits [..., vocab / world], gathered on
    rank 0 into the full [..., vocab] (the other ranks return their slice, which nobody reads).
    Tied to the input embedding, it holds no weight of its own and reads a view of its rows."""

    def __init__(self, weight: torch.Tensor | None, tied: nn.Module | None, vocab_size: int, rank: int,
                 world: int) -> None:
        super().__init__()
        self.vocab_size, self.rank, self.world = vocab_size, rank, world
        n = vocab_size // world
        self.start, self.stop = rank * n, (rank + 1) * n
        self._tied = [tied] if tied is not None else []  # a list: not registered as a submodule
        if weight is not None:
            self.weight = _param(weight.detach()[self.start : self.stop])
        self.quantized: QuantizedLinear | None = None  # its rows on quantized blocks (`quantize`)
        self.group: dist.ProcessGroup | None = None
        self.gather = False  # set by `install_all_reduce` once the group exists

    def reads(self, module: nn.Module) -> bool:
        """Whether this head's weight is a view of `module`'s (the tied input embedding)."""
        return bool(self._tied) and self._tied[0] is module

    def local_weight(self) -> torch.Tensor:
        return self._tied[0].weight[self.start : self.stop] if self._tied else self.weight

    def quantize(self, blocks: torch.Tensor, fmt: str, batch_invariant: bool) -> None:
        """Run this rank's rows on `blocks` (quantization); the dense weight (or tie) is dropped."""
        self.quantized = QuantizedLinear(blocks, fmt, self.local_weight().shape[1], batch_invariant=batch_invariant)
        self._tied = []
        if "weight" in self._parameters:
            del self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = (self.quantized(x) if self.quantized is not None else F.linear(x, self.local_weight())).contiguous()
        if not self.gather:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else local

    def extra_repr(self) -> str:
        return f"vocab rows [{self.start}, {self.stop}) of {self.vocab_size}, tied={bool(self._tied)}"


def _split_head(model: nn.Module, rank: int, world: int) -> None:
    """Replace the LM head by this rank's `VocabParallelHead` when the vocabulary divides."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if type(head) is not nn.Linear or head.bias is not None or head.out_features % world:
        return  # replicated: exact, only more memory
    tied = head.weight is embedding.weight or bool(getattr(model.config, "tie_word_embeddings", False))
    model.set_output_embeddings(VocabParallelHead(None if tied else head.weight, embedding if tied else None,
                                                  head.out_features, rank, world))


def vocab_parallel_head(model: nn.Module) -> VocabParallelHead | None:
    head = model.get_output_embeddings()
    return head if isinstance(head, VocabParallelHead) else None


def _shrink_module_attrs(model: nn.Module, rules: dict[str, str], world: int) -> None:
    """Older attention / MLP modules state their head counts and width as attributes."""
    parents = {path.rpartition(".")[0] for path, rule in rules.items() if rule != REPLICATE}
    for path in parents:
        module = model.get_submodule(path)
        for name in ("num_heads", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, getattr(module, name) // world)


def shard_model(model: nn.Module, rank: int, world: int, inplace: bool = False) -> nn.Module:
    """This rank's shard of `model`: a copy (sharing its tensors, or `model` itself when
    `inplace`) with split linears and a config of per-shard head counts. `check_tp_size` must
    have passed. Works on meta tensors too (`loading.load_shard` shards before reading)."""
    rules = tp_rules(model)
    if inplace:
        shard = model
    else:
        memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
        shard = copy.deepcopy(model, memo)
    shard_config(_text_config(shard), world)
    for path, rule in rules.items():
        if rule == COLWISE:
            _split_rows(shard.get_submodule(path), rank, world)
        elif rule == ROWWISE:
            _split_cols(shard.get_submodule(path), rank, world)
    _shrink_module_attrs(shard, rules, world)
    _split_head(shard, rank, world)
    source = getattr(shard_spec(model), "source", None)
    setattr(shard, SHARD_ATTR, ShardSpec(rank, world, source, next(model.parameters()).dtype))
    return shard


def block_shard(shard: nn.Module) -> BlockShard:
    """How `shard`'s quantized layers split the whole model's blocks (`kernels/quantized.py`)."""
    spec = shard_spec(shard)
    rules = tp_rules(shard)
    head = next((path for path, module in shard.named_modules() if isinstance(module, VocabParallelHead)), None)
    return BlockShard(spec.rank, spec.world, frozenset(p for p, r in rules.items() if r == COLWISE),
                      frozenset(p for p, r in rules.items() if r == ROWWISE), head)


def quantize_shard(shard: nn.Module, quantization: str, batch_invariant: bool | None) -> None:
    """Quantize this rank's shard in place (before its all-reduce hooks go on): its layers'
    blocks are the whole model's, split along whole blocks."""
    if quantization != "none":
        quantize_model(shard, quantization, batch_invariant, block_shard(shard))


def _all_reduce(group: dist.ProcessGroup | None):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    return hook


class _HeadGather:
    """Switches a `VocabParallelHead`'s gather on; `remove()` switches it off (a hook's handle)."""

    def __init__(self, head: VocabParallelHead, group: dist.ProcessGroup | None) -> None:
        self.head = head
        head.group, head.gather = group, True

    def remove(self) -> None:
        self.head.gather = False


def install_all_reduce(shard: nn.Module, group: dist.ProcessGroup | None) -> list:
    """Sum the partial outputs of every row-parallel linear across ranks (forward hooks) and
    gather a vocabulary-parallel head's logits on rank 0; returns handles to `remove()`."""
    hook = _all_reduce(group)
    handles: list = [shard.get_submodule(path).register_forward_hook(hook)
                     for path, rule in tp_rules(shard).items() if rule == ROWWISE]
    head = vocab_parallel_head(shard)
    if head is not None:
        handles.append(_HeadGather(head, group))
    return handles


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's unique parameters (tied weights once)."""
    seen: dict[int, int] = {}
    for t in model.parameters():
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
