"""Tensor parallelism over quantized weights (issue 29): each rank's shard runs on its part of the
whole model's blocks, split along whole blocks (`kernels/quantized.BlockShard`, applied by
`sharding.quantize_shard`):

- the shards' blocks put side by side are the whole model's, bitwise: rows of column-parallel
  layers and of the vocabulary-parallel head, blocks of each row of row-parallel layers, for
  `quantization='int8'` on tiny models (tied head included) and for the default model's own GGUF
  blocks (`quantization='auto'`, q/k rows un-permuted with the whole model's head counts);
- tp_size=2 with int8 gives tp_size=1's greedy tokens and log-probabilities (float32 noise);
  the default model under tp_size=3 with 'auto', each rank reading its shard from the checkpoint
  and its blocks from the GGUF file, gives tp_size=1's tokens;
- a tp_size that would cut a row-parallel layer's blocks is refused, naming the layer, before
  any rank starts.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.kernels import cpu_kernels
from cbserve.kernels.quantized import BLOCK_BYTES, QuantizedEmbedding, QuantizedLinear, quantize_model
from cbserve.workers.parallel.sharding import (
    COLWISE,
    ROWWISE,
    quantize_shard,
    shard_model,
    tp_rules,
    vocab_parallel_head,
)
from tests.support.tiny_models import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason=cpu_kernels.unavailable_reason()
                                or "kernels available")


def _tied_llama() -> torch.nn.Module:
    model = tiny_model("llama", torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model


def _blocks_side_by_side(whole: torch.nn.Module, shards: list[torch.nn.Module]) -> int:
    """Assert that the shards' blocks, joined along their split, are the whole model's; returns how
    many layers were compared."""
    compared = 0
    for path, rule in tp_rules(shards[0]).items():
        if rule not in (COLWISE, ROWWISE):
            continue
        want = whole.get_submodule(path)
        parts = [shard.get_submodule(path) for shard in shards]
        assert isinstance(want, QuantizedLinear) and all(isinstance(p, QuantizedLinear) for p in parts), path
        if rule == COLWISE:
            joined = torch.cat([p.blocks for p in parts])
        else:
            per_row = [p.blocks.reshape(p.out_features, -1, BLOCK_BYTES[p.fmt]) for p in parts]
            joined = torch.cat(per_row, dim=1).reshape(want.out_features, -1)
        assert torch.equal(joined, want.blocks), path
        compared += 1
    heads = [vocab_parallel_head(shard) for shard in shards]
    assert all(h is not None and h.quantized is not None for h in heads)
    assert torch.equal(torch.cat([h.quantized.blocks for h in heads]), whole.get_output_embeddings().blocks)
    embedding = whole.get_input_embeddings()
    for shard in shards:  # replicated, quantized where the whole model's is
        assert type(shard.get_input_embeddings()) is type(embedding)
        if isinstance(embedding, QuantizedEmbedding):
            assert torch.equal(shard.get_input_embeddings().blocks, embedding.blocks)
    return compared + 1


@pytest.mark.parametrize("make", [lambda: tiny_model("llama", torch.float32), lambda: tiny_model("qwen2", torch.float32),
                                  _tied_llama], ids=["llama", "qwen2", "llama-tied"])
def test_int8_shards_hold_the_whole_models_blocks_split(make) -> None:
    whole, dense = make(), make()
    quantize_model(whole, "int8", False)
    shards = [shard_model(dense, rank, 2) for rank in range(2)]
    for shard in shards:
        quantize_shard(shard, "int8", False)
    assert _blocks_side_by_side(whole, shards) == 7 * whole.config.num_hidden_layers + 1
    head = vocab_parallel_head(shards[1])
    if whole.config.tie_word_embeddings:  # one copy: the head's blocks view the embedding's rows
        embedding = shards[1].get_input_embeddings()
        assert head.quantized.blocks.untyped_storage().data_ptr() == embedding.blocks.untyped_storage().data_ptr()
    assert all(type(m) is not torch.nn.Linear for shard in shards for m in shard.modules())
    assert sum(type(m) is torch.nn.Linear for m in dense.modules()) == 7 * dense.config.num_hidden_layers + 1


@pytest.fixture(scope="module")
def default_gguf() -> str:
    try:
        from cbserve.models import default_gguf_path

        return str(default_gguf_path())
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.mark.slow
def test_auto_shards_hold_the_gguf_files_blocks_split(default_gguf) -> None:
    """The default model's own blocks (Q4_1 layers, Q8_0 tied embedding) split over 3 ranks (its 3
    KV heads): q/k rows are un-permuted with the whole model's head counts before the split."""
    whole, _ = cbserve.load_model(dtype=torch.float32)
    dense, _ = cbserve.load_model(dtype=torch.float32)
    quantize_model(whole, "auto", False)
    shards = [shard_model(dense, rank, 3) for rank in range(3)]
    for shard in shards:
        quantize_shard(shard, "auto", False)
    assert _blocks_side_by_side(whole, shards) == 7 * whole.config.num_hidden_layers + 1
    layer = shards[2].model.layers[0]
    assert layer.self_attn.o_proj.fmt == "q4_1" and layer.self_attn.o_proj.in_features == 192
    assert vocab_parallel_head(shards[2]).quantized.fmt == "q8_0"


def test_a_tp_size_that_cuts_blocks_is_refused_before_any_rank_starts() -> None:
    model = tiny_model("llama", torch.float32, num_key_value_heads=4)  # o_proj: 64 inputs, 16 per rank of 4
    before = multiprocessing.active_children()
    config = cbserve.ContinuousBatchingConfig(tp_size=4, quantization="int8", num_blocks=16)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj's 64 input features split 4 ways "
                                         r"\(16 each\) would cut its blocks of 32"):
        cbserve.generate_batch(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=2), config, progress_bar=False)
    assert multiprocessing.active_children() == before
    assert all(type(m) is not QuantizedLinear for m in model.modules())


def _greedy(max_new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)


def _run(model: torch.nn.Module, prompts: list[list[int]], max_new: int, **config) -> list:
    config = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=192, max_batch_tokens=32,
                                              return_logprobs=True, **config)
    return list(cbserve.generate_batch(model, prompts, _greedy(max_new), config, progress_bar=False).values())


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: tiny_model("llama", torch.float32), lambda: tiny_model("qwen2", torch.float32),
                                  _tied_llama], ids=["llama", "qwen2", "llama-tied"])
def test_int8_under_tp2_equals_tp1(make) -> None:
    """Chunked prefills (prompts over the 32-token budget) and decodes, every row count's kernel."""
    prompts = random_prompts([1, 5, 17, 40, 100], seed=1)
    want = _run(make(), prompts, 12, quantization="int8")
    got = _run(make(), prompts, 12, quantization="int8", tp_size=2)
    for w, g in zip(want, got):
        assert g.generated_tokens == w.generated_tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@pytest.mark.slow
def test_default_model_auto_under_tp3_equals_tp1(default_gguf) -> None:
    """Rank 0's shard from `load_model_shard`; ranks 1 and 2 read theirs from the same dequantized
    checkpoint and their blocks from the GGUF file the checkpoint came from."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 28, 30, 216, 33, 30, 1145, 2, 77, 90]]
    whole, _ = cbserve.load_model(dtype=torch.float32)
    want = _run(whole, prompts, 8, quantization="auto")
    shard, _ = cbserve.load_model_shard(None, 0, 3, dtype=torch.float32, tokenizer=False)
    got = _run(shard, prompts, 8, quantization="auto", tp_size=3)
    assert isinstance(shard.model.layers[0].mlp.down_proj, QuantizedLinear)
    for w, g in zip(want, got):
        assert g.generated_tokens == w.generated_tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)


@pytest.mark.slow
def test_lora_over_int8_under_tp2_equals_tp1() -> None:
    """Adapters over quantized shards: each projection wrapped alone (a shard's q/k/v and gate/up
    stay unfused: transformers' forward, which TP's hooks need, calls them one by one)."""
    pytest.importorskip("peft")
    import copy

    from cbserve.workers.factory import build_engine
    from tests.support.lora_adapters import ADAPTERS, NAMES, adapter_dir, base_model

    folders = {name: adapter_dir("llama", name) for name in ADAPTERS}
    prompts = random_prompts([3, 40, 17, 9], seed=3)

    def run(tp_size: int) -> list:
        config = cbserve.ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=32,
                                                  return_logprobs=True, tp_size=tp_size, enable_lora=True,
                                                  max_loras=2, quantization="int8")
        engine = build_engine(copy.deepcopy(base_model("llama")).float(), _greedy(8), config)
        try:
            for name, folder in folders.items():
                engine.load_lora(name, folder)
            requests = [engine.make_request(p, f"r{i}", lora=NAMES[i % len(NAMES)]) for i, p in enumerate(prompts)]
            for request in requests:
                engine.add_request(request)
            while engine.has_work:
                engine.step()
            return requests
        finally:
            engine.release_model()

    want, got = run(1), run(2)
    for w, g in zip(want, got):
        assert g.generated == w.generated, g.request_id
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
