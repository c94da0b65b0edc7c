"""`bench/linear_ceiling.py` (issue 28): the workload's token counts, the layer shapes the lean
forward runs, and a rate measured through `PackedLinear` on a tiny config."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_linear_ceiling", ROOT / "bench" / "linear_ceiling.py")
ceiling = importlib.util.module_from_spec(_spec)
sys.modules["bench_linear_ceiling"] = ceiling
_spec.loader.exec_module(ceiling)


def test_token_counts_are_the_workloads() -> None:
    work = ceiling.common.make_workload("mixed", list(range(10, 500)), None, 0)
    assert ceiling.workload_tokens("mixed", 0, 256, 128) == (sum(map(len, work.prompts)), sum(work.lengths))
    assert ceiling.workload_tokens("decode", 0, 256, 128) == (128 * 16, 128 * 128)
    # bench/peers.py's served load: every request --prompt-tokens -> --max-tokens
    assert ceiling.workload_tokens("served", 0, 300, 50) == (300, 50)


def test_layer_shapes_are_the_fused_linears() -> None:
    # SmolLM2-135M: hidden 576, 9 heads of 64, 3 KV heads, intermediate 1,536
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    assert ceiling.layer_shapes(config) == [(576, 576 + 2 * 192), (576, 576), (576, 2 * 1536), (1536, 576)]


def test_rates_are_measured_for_each_row_count() -> None:
    import torch

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=256)
    best, rates = ceiling.best_rate(config, torch.float32, [1, 16], repeat=1)
    assert set(rates) == {1, 16} and all(r > 0 for r in rates.values()) and best == max(rates.values())
