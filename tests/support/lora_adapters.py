"""Random PEFT LoRA adapters of the tiny models, saved in PEFT's format, and the references of
PEFT's merged models (`merge_and_unload`) for them."""

from __future__ import annotations

import copy
import functools
import tempfile

import torch

from tests.support.tiny_models import reference_generate, tiny_model

MAX_NEW = 8
# Four adapters of different ranks, scalings and targets (each with random, nonzero lora_B).
ADAPTERS = {
    "all": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"]},
    "attn": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]},
    "mlp": {"r": 2, "lora_alpha": 6, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "ko": {"r": 16, "lora_alpha": 16, "target_modules": "model.layers.1.self_attn.(k|o)_proj"},
}
NAMES = [None, *ADAPTERS]  # None: the base model


@functools.cache
def base_model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


@functools.cache
def adapter_dir(arch: str, name: str) -> str:
    """A random PEFT adapter saved with `save_pretrained` into a folder of its own."""
    import peft

    config = peft.LoraConfig(lora_dropout=0.0, **ADAPTERS[name])
    model = peft.get_peft_model(copy.deepcopy(base_model(arch)), config)
    torch.manual_seed(sorted(ADAPTERS).index(name) + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0, 0.3)
    folder = tempfile.mkdtemp(prefix=f"cbserve-lora-{arch}-{name}-")
    model.save_pretrained(folder)
    return folder


@functools.cache
def merged_model(arch: str, name: str | None) -> torch.nn.Module:
    import peft

    if name is None:
        return base_model(arch)
    return peft.PeftModel.from_pretrained(copy.deepcopy(base_model(arch)), adapter_dir(arch, name)).merge_and_unload()


@functools.cache
def reference(arch: str, name: str | None, prompt: tuple[int, ...], max_new: int = MAX_NEW
              ) -> tuple[list[int], list[float]]:
    return reference_generate(merged_model(arch, name), list(prompt), max_new)
