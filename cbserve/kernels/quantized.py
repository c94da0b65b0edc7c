"""Linear layers and embeddings on block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1), kept as the
file stores them: 34, 18 or 20 bytes per 32 weights instead of 64 in bfloat16.

- `QuantizedLinear`: calls of up to `GEMV_ROWS` rows (decode) run the C++ kernel
  (`csrc/quant_linear_cpu.cpp`), which dequantizes each block in registers and reads the weights'
  bytes once per call: a decode step is bound by those bytes on a CPU. Larger calls (prefill and
  large decode batches, bound by arithmetic) dequantize a cache-sized tile of output features at a
  time and multiply the whole input by it with a GEMM in the input's dtype (no dequantized copy of
  the matrix is made). `batch_invariant`: the C++ kernel for every row count.
- `QuantizedEmbedding`: the rows of the looked-up tokens, dequantized.
- `quantize_dense(model)`: a dense model's linear layers quantized at load (`quantization='int8'`:
  Q8_0 blocks, int8 weights with a float16 scale per 32).
- `quantize_from_gguf(model, path)`: swaps a model's linear layers (and its input embedding) for
  these, from the GGUF file the model was dequantized from. Each swapped weight is first checked
  to dequantize to exactly the model's dense weight (catches a name or layout mismatch); a tensor
  of another format (F16, K-quants) or that does not match stays dense, and the log says which.

`quantize` / `dequantize` are plain torch: the reference of the block formats for tests, and what
quantizes a dense model's weights for them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from cbserve.kernels import cpu_isa

logger = logging.getLogger(__name__)

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
GGUF_TYPES = {8: "q8_0", 2: "q4_0", 3: "q4_1"}  # GGMLQuantizationType values
# Up to how many rows a call runs the C++ kernel (decode-sized); above, the tiled GEMMs (measured
# crossover on an AVX-512 Zen 4: ~16 rows in bfloat16, about even in float32).
GEMV_ROWS = 16
# The attribute `models.load_model` sets on a model loaded from a GGUF file: that file's path.
GGUF_SOURCE = "cb_gguf_file"
# The attribute an engine sets on a model whose layers it quantized: the `quantization` it used.
QUANTIZED_AS = "cb_quantized_as"


def kernel_isa() -> str:
    """The C++ kernel's path for this CPU ('avx512', 'avx2' or 'generic'), from the selected ISA."""
    return {"avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2"}.get(cpu_isa.selected(), "generic")


# --------------------------------------------------------------------------------- reference


def dequantize(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of `blocks` (uint8 ``[rows, in_features / 32 * bytes]``), the
    product and the offset rounded separately, as gguf-py and transformers dequantize."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, in_features // BLOCK, BLOCK_BYTES[fmt])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(rows, in_features)
    qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # values 0-15 of bytes' low then high nibbles
    if fmt == "q4_0":
        return ((q - 8) * d).reshape(rows, in_features)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).reshape(rows, in_features)


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 blocks of `weight` ``[rows, in_features]`` (in_features a multiple of 32), rounded as
    llama.cpp's reference quantizers round."""
    rows, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK} to quantize, got {k}")
    w = weight.detach().float().reshape(rows, k // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = w.abs().amax(-1, keepdim=True) / 127
        q = torch.where(d > 0, w / d, torch.zeros_like(w)).round().clamp(-127, 127).to(torch.int8)
        parts = [d.half().view(torch.uint8).reshape(rows, -1, 2), q.view(torch.uint8)]
    elif fmt == "q4_0":
        idx = w.abs().argmax(-1, keepdim=True)
        d = w.gather(-1, idx) / -8
        q = torch.where(d != 0, w / d + 8.5, torch.full_like(w, 8.0)).floor().clamp(0, 15).to(torch.uint8)
        parts = [d.half().view(torch.uint8).reshape(rows, -1, 2), q[..., :16] | (q[..., 16:] << 4)]
    elif fmt == "q4_1":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.where(d > 0, (w - lo) / d + 0.5, torch.zeros_like(w)).floor().clamp(0, 15).to(torch.uint8)
        parts = [d.half().view(torch.uint8).reshape(rows, -1, 2), lo.half().view(torch.uint8).reshape(rows, -1, 2),
                 q[..., :16] | (q[..., 16:] << 4)]
    else:
        raise ValueError(f"unknown block format {fmt!r} ({', '.join(BLOCK_BYTES)})")
    return torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()


# ---------------------------------------------------------------------------------- modules


class QuantizedLinear(torch.nn.Module):
    """`nn.Linear` on block-quantized weights; outputs in the input's dtype."""

    def __init__(self, blocks: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None = None,
                 batch_invariant: bool = False) -> None:
        super().__init__()
        if fmt not in BLOCK_BYTES:
            raise ValueError(f"unknown block format {fmt!r} ({', '.join(BLOCK_BYTES)})")
        if in_features % BLOCK or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // BLOCK * BLOCK_BYTES[fmt]:
            raise ValueError(f"blocks must be uint8 [out_features, {in_features // BLOCK * BLOCK_BYTES[fmt]}] "
                             f"for {fmt} with in_features {in_features} (a multiple of {BLOCK})")
        from cbserve.kernels import cpu_kernels

        cpu_kernels.load()
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.batch_invariant = batch_invariant
        self.isa = kernel_isa()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str, batch_invariant: bool = False) -> QuantizedLinear:
        """A dense layer's weights quantized to `fmt`."""
        return cls(quantize(linear.weight, fmt), fmt, linear.in_features, linear.bias, batch_invariant)

    def dense_weight(self) -> torch.Tensor:
        """The weights dequantized (float32)."""
        return torch.ops.cbserve_cpu.dequantize_blocks(self.blocks, self.fmt, self.in_features, self.isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= GEMV_ROWS or self.batch_invariant:
            if x.dtype in (torch.float32, torch.bfloat16):  # the kernel widens and rounds bfloat16 itself
                return torch.ops.cbserve_cpu.quant_linear(x, self.blocks, self.fmt, self.bias, self.isa)
            return torch.ops.cbserve_cpu.quant_linear(x.float(), self.blocks, self.fmt, self.bias, self.isa).to(x.dtype)
        if x.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.cbserve_cpu.quant_linear_tiled(x, self.blocks, self.fmt, self.bias, self.isa)
        bias = None if self.bias is None else self.bias.to(x.dtype)  # e.g. float64: the weights whole
        return torch.nn.functional.linear(x, self.dense_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt} "
                f"({self.blocks.numel() / 2**20:.1f} MiB), kernel {self.isa} up to {GEMV_ROWS} rows")


class QuantizedEmbedding(torch.nn.Module):
    """`nn.Embedding` on block-quantized rows; `dtype` is the model's."""

    def __init__(self, blocks: torch.Tensor, fmt: str, embedding_dim: int, dtype: torch.dtype,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.fmt, self.embedding_dim, self.dtype, self.padding_idx = fmt, embedding_dim, dtype, padding_idx
        self.num_embeddings = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.isa = kernel_isa()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        values = torch.ops.cbserve_cpu.dequantize_blocks(rows, self.fmt, self.embedding_dim, self.isa)
        return values.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt} ({self.blocks.numel() / 2**20:.1f} MiB)"


# ------------------------------------------------------------------------------- from GGUF


def _reverse_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama's q/k rows permuted for its rotary layout; transformers undoes it
    (whole rows move, so the same permutation applies to rows of blocks)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).transpose(1, 2).reshape(rows.shape)


def _candidates(raw: torch.Tensor, name: str, config, world: int = 1) -> list[torch.Tensor]:
    """The file's rows as stored, then (q/k of Llama-style models) as transformers permutes them.
    `config` may be a shard's, of 1 / `world` of the heads; the file holds them all."""
    found = [raw]
    heads = getattr(config, "num_attention_heads", None)
    if heads and (".attn_q." in name or ".attn_k." in name):
        kv = getattr(config, "num_key_value_heads", None) or heads
        found.append(_reverse_permute(raw, (heads if ".attn_q." in name else kv) * world))
    return found


@dataclass(frozen=True)
class BlockShard:
    """A tensor-parallel rank's part of each of a model's weights, in whole blocks: a slice of the
    output rows of a column-parallel layer, a slice of the blocks of every row of a row-parallel
    one (blocks never straddle ranks: `workers/parallel/sharding.check_block_alignment`); other
    layers whole. `head`: the path of a vocabulary-parallel head (`sharding.VocabParallelHead`,
    a slice of the vocabulary's rows), quantized in place by its `quantize(blocks, fmt, ...)`."""

    rank: int
    world: int
    rows: frozenset[str]  # column-parallel layers: their output features split
    columns: frozenset[str]  # row-parallel layers: their input features split
    head: str | None = None

    def take(self, module_name: str, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
        """This rank's part of `blocks` (the whole layer's, uint8 [out, in / 32 * bytes]), a copy."""
        if module_name in self.rows or module_name == self.head:
            n = blocks.shape[0] // self.world
            return blocks[self.rank * n:(self.rank + 1) * n].clone()
        if module_name in self.columns:
            per_row = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[fmt])
            n = per_row.shape[1] // self.world
            return per_row[:, self.rank * n:(self.rank + 1) * n].reshape(blocks.shape[0], -1).clone()
        return blocks


def quantize_from_gguf(model: torch.nn.Module, gguf_path: str | Path, batch_invariant: bool = False,
                       shard: BlockShard | None = None) -> int:
    """Replace `model`'s linear layers and input embedding by quantized ones read from `gguf_path`
    (the file the model was loaded from), in place; returns how many were replaced. `model` may be
    one rank's shard of the file's model: `shard` says which part of each tensor it holds."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    config = model.config
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == config.model_type), None)
    if arch is None:
        raise ValueError(f"quantization 'auto': gguf has no architecture named {config.model_type!r}")
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    dtype = next(model.parameters()).dtype
    world = shard.world if shard is not None else 1
    head = model.get_submodule(shard.head) if shard is not None and shard.head else None
    modules = list(model.named_modules())
    if head is not None:  # first: on its own blocks, it no longer reads a tied embedding's weight
        modules.sort(key=lambda item: item[1] is not head)
    replaced, kept, raws = 0, [], {}
    for module_name, module in modules:
        if module is not head and type(module) not in (torch.nn.Linear, torch.nn.Embedding):
            continue
        if head is not None and head.reads(module):
            kept.append(f"{module_name} (read whole by the vocabulary-parallel head)")
            continue
        gguf_name = names.get_name(module_name)
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if tensor is None and module_name == "lm_head" and config.tie_word_embeddings:
            tensor = tensors.get("token_embd.weight")
        fmt = GGUF_TYPES.get(int(tensor.tensor_type)) if tensor is not None else None
        if fmt is None:
            kept.append(f"{module_name} ({tensor.tensor_type.name if tensor is not None else 'not in the file'})")
            continue
        if tensor.name not in raws:  # one copy for a tied head and embedding; [rows, bytes of a row]
            raws[tensor.name] = torch.from_numpy(tensor.data.copy()).reshape(-1, tensor.data.shape[-1])
        raw = raws[tensor.name]
        dense = (module.local_weight() if module is head else module.weight).detach()
        candidates = _candidates(raw, tensor.name, config, world)
        if shard is not None:
            candidates = [shard.take(module_name, c, fmt) for c in candidates]
        blocks = next((c.contiguous() for c in candidates
                       if torch.equal(dequantize(c, fmt, dense.shape[1]).to(dense.dtype), dense)), None)
        if blocks is None:
            kept.append(f"{module_name} (its {fmt} blocks do not dequantize to the model's weights)")
            continue
        if module is head:
            head.quantize(blocks, fmt, batch_invariant)
        else:
            _replace(model, module_name, module, blocks, fmt, dtype, batch_invariant)
        replaced += 1
    if shard is None:  # a shard runs transformers' forward (all-reduce hooks), which calls each projection
        fuse_projections(model)
    if kept:
        logger.info("quantization 'auto': %d layers kept dense: %s", len(kept), ", ".join(kept))
    logger.info("quantization 'auto': %d layers run on %s's own blocks", replaced, Path(gguf_path).name)
    return replaced


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module, blocks: torch.Tensor, fmt: str,
             dtype: torch.dtype, batch_invariant: bool) -> None:
    """Put the quantized counterpart of `module` (a Linear or an Embedding) in its place."""
    if isinstance(module, torch.nn.Embedding):
        new = QuantizedEmbedding(blocks, fmt, module.embedding_dim, dtype, module.padding_idx)
    else:
        new = QuantizedLinear(blocks, fmt, module.in_features, module.bias, batch_invariant)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_model(model: torch.nn.Module, quantization: str, batch_invariant: bool | None,
                   shard: BlockShard | None = None) -> None:
    """The model's dense layers replaced by quantized ones, in place: 'auto', the GGUF file's own
    blocks; 'int8', the dense weights quantized to Q8_0 blocks. `shard`: the model is one rank's
    shard (its layers' blocks are those of the whole model's layers, split along whole blocks)."""
    done = getattr(model, QUANTIZED_AS, None)
    if done == quantization:
        return  # quantized by an earlier engine on this model
    if done is not None:
        raise ValueError(f"quantization={quantization!r}: this model's layers were replaced by an earlier engine's "
                         f"quantization={done!r} (load the model again)")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPUs only (the quantized kernels are C++ for "
                         "x86-64)")
    if quantization == "int8":  # a block of a shard's slice is the same block of the whole layer
        quantize_dense(model, "q8_0", bool(batch_invariant), shard)
    else:
        gguf = getattr(model, GGUF_SOURCE, None)
        if gguf is None:
            raise ValueError("quantization='auto' needs a model loaded from a GGUF file by cbserve.load_model "
                             f"or cbserve.load_model_shard (this {type(model).__name__} has no GGUF source)")
        quantize_from_gguf(model, gguf, bool(batch_invariant), shard)
    setattr(model, QUANTIZED_AS, quantization)


def quantize_dense(model: torch.nn.Module, fmt: str = "q8_0", batch_invariant: bool = False,
                   shard: BlockShard | None = None) -> int:
    """quantization='int8': `model`'s dense linear layers quantized to `fmt` blocks at load, in place
    (a tied input embedding shares the head's blocks); layers whose in_features is not a multiple of
    32 stay dense. `shard`: `model` is a tensor-parallel shard (whose layers quantize to their part
    of the whole layers' blocks; its vocabulary-parallel head is quantized here). Returns how many
    layers were replaced."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embedding is not None and getattr(head, "weight", None) is embedding.weight
    replaced, kept = 0, []
    parallel_head = model.get_submodule(shard.head) if shard is not None and shard.head is not None else None
    if parallel_head is not None and parallel_head.local_weight().shape[1] % BLOCK == 0:
        _quantize_parallel_head(parallel_head, model, fmt, batch_invariant)
        replaced += 1
    for module_name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        if module.in_features % BLOCK:
            kept.append(module_name)
            continue
        new = QuantizedLinear.from_linear(module, fmt, batch_invariant)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced += 1
        if tied and module is head and type(embedding) is torch.nn.Embedding:
            model.set_input_embeddings(QuantizedEmbedding(new.blocks, fmt, embedding.embedding_dim,
                                                          embedding.weight.dtype, embedding.padding_idx))
    if shard is None:  # a shard runs transformers' forward (all-reduce hooks), which calls each projection
        fuse_projections(model)
    if kept:
        logger.info("quantization to %s: %d layers kept dense (in_features not a multiple of %d): %s",
                    fmt, len(kept), BLOCK, ", ".join(kept))
    return replaced


def _quantize_parallel_head(head: torch.nn.Module, model: torch.nn.Module, fmt: str, batch_invariant: bool) -> None:
    """A vocabulary-parallel head's rows quantized as the whole head's would be: tied to the input
    embedding, that embedding is quantized too and the head's blocks view its rows (one copy)."""
    embedding = model.get_input_embeddings()
    if type(embedding) is torch.nn.Embedding and head.reads(embedding):
        blocks = quantize(embedding.weight, fmt)
        model.set_input_embeddings(QuantizedEmbedding(blocks, fmt, embedding.embedding_dim, embedding.weight.dtype,
                                                      embedding.padding_idx))
        head.quantize(blocks[head.start:head.stop], fmt, batch_invariant)
    else:
        head.quantize(quantize(head.local_weight(), fmt), fmt, batch_invariant)


def fuse_projections(model: torch.nn.Module) -> int:
    """Each Llama layer's quantized q/k/v and gate/up as one `QuantizedLinear` (the lean forward's
    fused calls, `llama_forward.FUSED`), the parts' blocks then viewing its rows: one call and one
    pass over the input instead of three or two. Returns how many groups were fused."""
    from cbserve.kernels import llama_forward

    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", None) or []:
        for module, name in ((getattr(layer, "self_attn", None), llama_forward.QKV),
                             (getattr(layer, "mlp", None), llama_forward.GATE_UP)):
            parts = [getattr(module, p, None) for p in llama_forward.FUSED[name]]
            if not all(isinstance(p, QuantizedLinear) and p.bias is None for p in parts) or len(
                    {(p.fmt, p.in_features, p.batch_invariant) for p in parts}) != 1:
                continue
            group = QuantizedLinear(torch.cat([p.blocks for p in parts]), parts[0].fmt, parts[0].in_features,
                                    batch_invariant=parts[0].batch_invariant)
            start = 0
            for part in parts:
                part.blocks = group.blocks[start:start + part.out_features]
                start += part.out_features
            setattr(module, name, group)
            fused += 1
    return fused
