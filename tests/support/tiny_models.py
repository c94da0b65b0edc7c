"""Tiny random-weight causal LMs built from `transformers` configs: fast and download-free."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 256
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


def tiny_config(arch: str, **overrides):
    if arch == "llama":
        cfg = LlamaConfig(**COMMON)
    elif arch == "qwen2":
        cfg = Qwen2Config(**COMMON)
    elif arch == "qwen3":
        cfg = Qwen3Config(**COMMON, head_dim=16)
    elif arch == "mistral":
        cfg = MistralConfig(**COMMON, sliding_window=None)
    elif arch == "gemma2":
        cfg = Gemma2Config(**COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    attn = "eager" if arch == "gemma2" else "sdpa"  # transformers has no SDPA for soft-capping
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation=attn)
    # Larger random weights than the default init make logits less flat, so greedy choices
    # are decided by clear margins and a broken attention shows up in the tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_generate(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """`model.generate()` on this prompt alone, greedy: tokens and their log-probabilities."""
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs
