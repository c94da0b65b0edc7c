"""One rank's shard read straight from a safetensors checkpoint, never the whole model.

The model is built on the meta device (no memory), sharded there by the plan
(`sharding.shard_model`), and each parameter is then read from the checkpoint as the slice this
rank keeps: a row range of a column-parallel weight is one contiguous read; a column range of a
row-parallel weight is read a band of rows at a time, keeping only the columns; replicated
tensors are read whole. Files are read with plain positioned reads, not memory-mapped: a mapped
checkpoint counts every touched page in the process's resident memory until it is closed (a
row-parallel slice touches every page of its tensor), which would defeat the point. Peak
memory is therefore the shard itself plus one band (`BAND_BYTES`).

The default model (a GGUF file) is first dequantized once into `cbserve.models`' cache folder
by `load_model_shard`, and sharded from that safetensors copy.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch
from torch import nn

from cbserve.workers.parallel.sharding import (
    COLWISE,
    REPLICATE,
    ROWWISE,
    SHARD_ATTR,
    ShardSpec,
    VocabParallelHead,
    check_tp_size,
    shard_model,
    tp_rules,
)

logger = logging.getLogger(__name__)

BAND_BYTES = 16 << 20  # rows read at once for a column slice
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class Checkpoint:
    """The tensors of a safetensors checkpoint folder (one file or an index of several), read by
    slices."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.folder} holds no .safetensors checkpoint")
        # name -> (file, dtype, shape, byte offset of the data)
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}
        for name in files:
            path = self.folder / name
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                self.entries[key] = (path, DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                     8 + size + entry["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def _read(self, path: Path, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = bytearray(count * dtype.itemsize)
        view, done = memoryview(buffer), 0
        with open(path, "rb", buffering=0) as f:
            while done < len(buffer):
                n = os.preadv(f.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{path}: unexpected end of file at byte {offset + done}")
                done += n
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype) if buffer else torch.empty(0, dtype=dtype)

    def rows(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (all of it by default): one contiguous read."""
        path, dtype, shape, offset = self.entries[name]
        if not shape:
            return self._read(path, offset, 1, dtype).reshape(())
        start, stop = start or 0, shape[0] if stop is None else stop
        row = math.prod(shape[1:])
        return self._read(path, offset + start * row * dtype.itemsize, (stop - start) * row,
                          dtype).view(stop - start, *shape[1:])

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of 2-D tensor `name`, read a band of rows at a time."""
        path, dtype, shape, offset = self.entries[name]
        rows, cols = shape
        out = torch.empty(rows, stop - start, dtype=dtype)
        band = max(1, BAND_BYTES // max(1, cols * dtype.itemsize))
        for first in range(0, rows, band):
            last = min(rows, first + band)
            chunk = self._read(path, offset + first * cols * dtype.itemsize, (last - first) * cols, dtype)
            out[first:last] = chunk.view(last - first, cols)[:, start:stop]
        return out


def _slice(checkpoint: Checkpoint, key: str, rule: str, is_weight: bool, shape: tuple[int, ...],
           rank: int) -> torch.Tensor:
    if rule == COLWISE:
        return checkpoint.rows(key, rank * shape[0], (rank + 1) * shape[0])
    if rule == ROWWISE and is_weight:
        return checkpoint.columns(key, rank * shape[1], (rank + 1) * shape[1])
    return checkpoint.rows(key)  # replicated; a row-parallel bias lives on rank 0 only


def _checkpoint_key(checkpoint: Checkpoint, names: list[str], prefix: str) -> str | None:
    for name in names:
        for key in (name, name.removeprefix(prefix + ".") if prefix else name):
            if key in checkpoint:
                return key
    return None


def materialize(model: nn.Module, checkpoint: Checkpoint, rank: int, device: torch.device) -> None:
    """Replace every meta parameter of the (sharded) `model` by this rank's slice of its
    checkpoint tensor; tied parameters are read once and stay tied."""
    rules = tp_rules(model)
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, pname, f"{path}.{pname}" if path else pname))
                params[id(p)] = p
    prefix = getattr(model, "base_model_prefix", "") or ""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    skipped = False
    for pid, group in owners.items():
        meta = params[pid]
        names = [name for _, _, name in group]
        key = _checkpoint_key(checkpoint, names, prefix)
        if key is None and tied.intersection(names):
            skipped = True  # tied to a parameter that is read: tie_weights() below
            continue
        if key is None:
            raise KeyError(f"{checkpoint.folder} has no tensor for {' / '.join(names)}")
        module_path, _, pname = names[0].rpartition(".")
        rule = COLWISE if isinstance(group[0][0], VocabParallelHead) else rules.get(module_path, REPLICATE)
        tensor = _slice(checkpoint, key, rule, pname == "weight", tuple(meta.shape), rank)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise ValueError(f"{key}: the checkpoint's slice has shape {tuple(tensor.shape)}, the shard expects "
                             f"{tuple(meta.shape)} (a config that does not match the checkpoint?)")
        value = nn.Parameter(tensor.to(device=device, dtype=meta.dtype), requires_grad=False)
        for module, name, _ in group:
            module._parameters[name] = value
    if skipped:
        model.tie_weights()


def load_shard(folder: str | os.PathLike[str], rank: int, world: int, dtype: torch.dtype,
               device: torch.device | str | None = None) -> nn.Module:
    """Rank `rank` of `world`'s shard of the causal LM in `folder` (config.json + safetensors),
    in `dtype` on `device` (CPU by default), in eval mode, marked with its `ShardSpec`."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    device = torch.device(device or "cpu")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # buffers (RoPE frequencies) are computed, not read
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if world > 1:
        check_tp_size(model, world)
        shard_model(model, rank, world, inplace=True)
    materialize(model, Checkpoint(folder), rank, device)
    model.to(device)  # the buffers
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise ValueError(f"{folder}: not loaded from the checkpoint: {left[:5]}")
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    model.config._name_or_path = str(folder)
    setattr(model, SHARD_ATTR, ShardSpec(rank, world, str(folder), dtype))
    logger.info("rank %d of %d: shard of %s loaded (%.1f MiB)", rank, world, folder.name,
                sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    return model.eval()
