"""LoRA adapters in PEFT's format: a folder with `adapter_config.json` (`peft.LoraConfig`'s fields)
and `adapter_model.safetensors` (read with `safetensors`), checked against the model they adapt.

What is served: plain LoRA (`lora_A`, `lora_B`) on the decoder layers' attention and MLP projections
(q/k/v/o, gate/up/down), scaled by `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`).
Whatever else an adapter asks for (DoRA, `modules_to_save`, biases, per-module rank or alpha
patterns, ...) is refused naming the field: serving it without would silently change its outputs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PEFT's save_pretrained names weights after the wrapped model's modules
# adapter_config.json fields that change nothing at inference (training and initialisation settings,
# metadata) or that the weights already reflect (which modules and layers were adapted). Any other
# field set to something but None, False, "none" or empty (DoRA, modules_to_save, biases, rank and
# alpha patterns, aLoRA, ...) would change what the adapter computes: refused, naming it.
NO_EFFECT = {
    "peft_type", "task_type", "base_model_name_or_path", "revision", "auto_mapping", "peft_version",
    "inference_mode", "init_lora_weights", "lora_dropout", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "layers_pattern", "layers_to_transform", "exclude_modules", "target_modules", "r",
    "lora_alpha", "use_rslora", "megatron_config", "megatron_core", "qalora_group_size", "ensure_weight_tying",
}
OFF = (None, False, "none", {}, [])

class LoraFormatError(ValueError):
    """An adapter folder cbserve cannot serve; the message names the file and field."""


@dataclass
class LoraAdapter:
    """One adapter as read: for each adapted projection (the model's module name), its factors
    `a` [r, in] and `b` [out, r] with the scaling folded into `b`."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_config(folder: Path, max_rank: int) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraFormatError(f"{folder} is not a PEFT adapter folder: no {CONFIG_FILE}")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraFormatError(f"{path}: peft_type {config['peft_type']!r} is not served, only 'LORA'")
    for field, value in config.items():
        if field not in NO_EFFECT and not any(value is off or value == off for off in OFF):
            raise LoraFormatError(f"{path}: {field}={value!r:.200} is not supported (only plain LoRA on the "
                                  "attention and MLP projections is served)")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise LoraFormatError(f"{path}: r={rank!r} must be an integer in [1, max_lora_rank={max_rank}]")
    if not isinstance(config.get("lora_alpha"), (int, float)):
        raise LoraFormatError(f"{path}: lora_alpha={config.get('lora_alpha')!r} must be a number")
    return config


def scaling(config: dict[str, Any]) -> float:
    """PEFT's scaling of the product B @ A."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def targeted(config: dict[str, Any], module: str) -> bool:
    """PEFT's matching of `target_modules`: a regex over the whole name, or a list of names that
    equal the module's name or end it."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets or ())


def read(folder: str | Path, name: str, max_rank: int, shapes: dict[str, tuple[int, int]],
         dtype: torch.dtype) -> LoraAdapter:
    """Read and check an adapter. `shapes`: the projections the engine adapts, module name ->
    (in_features, out_features)."""
    folder = Path(folder)
    config = read_config(folder, max_rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraFormatError(f"{folder}: no {WEIGHTS_FILE} (other weight formats, such as pickled .bin files, "
                              "are not read)")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise LoraFormatError(f"{weights_path}: tensor {key!r} is not a LoRA factor (lora_A / lora_B weight): "
                                  "only plain LoRA is served")
        if module not in shapes:
            raise LoraFormatError(f"{weights_path}: {key!r} adapts {module!r}, which is not one of the model's "
                                  f"decoder-layer projections the engine adapts ({', '.join(PROJECTIONS)})")
        if not targeted(config, module):
            raise LoraFormatError(f"{weights_path}: {key!r} adapts {module!r}, which target_modules="
                                  f"{config.get('target_modules')!r} does not name")
        factors.setdefault(module, {})[kind[0]] = tensor
    scale, r = scaling(config), config["r"]
    weights = {}
    for module, pair in factors.items():
        a, b = pair.get("A"), pair.get("B")
        fan_in, fan_out = shapes[module]
        if a is None or b is None or a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise LoraFormatError(f"{weights_path}: {module!r} needs lora_A [{r}, {fan_in}] and lora_B "
                                  f"[{fan_out}, {r}] (r={r}), got {None if a is None else list(a.shape)} and "
                                  f"{None if b is None else list(b.shape)}")
        weights[module] = (a.to(dtype), (b.double() * scale).to(dtype))
    if not weights:
        raise LoraFormatError(f"{weights_path}: no LoRA factors")
    return LoraAdapter(name, str(folder), r, weights)
