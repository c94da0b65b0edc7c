"""Sharded loading (issue 18): each tensor-parallel rank reads only its shard from the checkpoint.

- The shard read from a checkpoint equals the in-memory shard of the same model, tensor by
  tensor, for every family with a `base_model_tp_plan` (Llama, Qwen2, Qwen3, Mistral, Gemma 2),
  and holds only its share of the split weights (parameter bytes per rank).
- tp_size=2 engines built from a rank-0 shard give tp_size=1's greedy tokens and logprobs
  (float64), the other rank reading its own shard from the checkpoint (never pickled from rank 0).
- The default model with tp_size 3: each rank's parameters are the replicated embedding plus a
  third of the rest.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.workers.parallel.launch import CheckpointShard, PackedModule, shard_source
from cbserve.workers.parallel.loading import BAND_BYTES, Checkpoint, load_shard
from cbserve.workers.parallel.sharding import (
    VocabParallelHead,
    check_tp_size,
    parameter_bytes,
    shard_model,
    shard_spec,
    tp_rules,
)
from tests.support.tiny_models import random_prompts, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2"]
MAX_NEW = 10


@functools.cache
def checkpoint(arch: str, root: str) -> Path:
    folder = Path(root) / arch
    if not folder.exists():
        tiny_model(arch).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("tp-checkpoints"))


def expected_bytes(model: torch.nn.Module, rank: int, world: int) -> int:
    """Replicated tensors whole, split linears' weights (and column-parallel biases) / world, a
    row-parallel bias on rank 0 only; the LM head split by vocabulary unless tied."""
    rules = tp_rules(model)
    total = 0
    seen: set[int] = set()
    for path, module in model.named_modules():
        for name, t in module._parameters.items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            nbytes = t.numel() * t.element_size()
            rule = rules.get(path, "lm_head" if module is model.get_output_embeddings() else None)
            if rule in ("colwise", "lm_head") or (rule == "rowwise" and name == "weight"):
                total += nbytes // world
            elif rule == "rowwise":  # bias
                total += nbytes if rank == 0 else 0
            else:
                total += nbytes
    return total


@pytest.mark.parametrize("arch", FAMILIES)
def test_checkpoint_shard_equals_the_in_memory_shard_and_holds_its_share(arch: str, root: str) -> None:
    model = tiny_model(arch)
    folder = checkpoint(arch, root)
    for rank in range(2):
        shard = load_shard(folder, rank, 2, torch.float64)
        reference = shard_model(model, rank, 2)
        assert shard_spec(shard).source == str(folder) and shard_spec(shard).world == 2
        params, ref_params = dict(shard.named_parameters()), dict(reference.named_parameters())
        assert params.keys() == ref_params.keys()
        for name, p in params.items():
            assert torch.equal(p, ref_params[name]), name
        for name, b in reference.named_buffers():
            assert torch.equal(dict(shard.named_buffers())[name], b), name
        assert shard.config.num_key_value_heads == 1 and shard.config.num_attention_heads == 2
        assert isinstance(shard.get_output_embeddings(), VocabParallelHead)
        assert parameter_bytes(shard) == expected_bytes(model, rank, 2)
        assert parameter_bytes(shard) < 0.7 * parameter_bytes(model)
    assert model.config.num_key_value_heads == 2  # the in-memory model was not touched


def test_column_slices_are_read_a_band_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row-parallel slice reads the rows in bands: the bytes read at once stay bounded."""
    import safetensors.torch

    full = torch.arange(64 * 48, dtype=torch.float32).view(64, 48)
    safetensors.torch.save_file({"w": full, "b": torch.ones(3)}, tmp_path / "model.safetensors")
    monkeypatch.setattr("cbserve.workers.parallel.loading.BAND_BYTES", 10 * 48 * 4)
    reads: list[int] = []
    ckpt = Checkpoint(tmp_path)
    original = ckpt._read
    ckpt._read = lambda *a: reads.append(a[2]) or original(*a)
    assert torch.equal(ckpt.columns("w", 16, 32), full[:, 16:32])
    assert max(reads) == 10 * 48 and sum(reads) == 64 * 48
    assert torch.equal(ckpt.rows("w", 8, 12), full[8:12]) and reads[-1] == 4 * 48
    assert torch.equal(ckpt.rows("b"), torch.ones(3))
    assert BAND_BYTES >= 1 << 20


def test_rank_processes_read_their_own_shard(root: str) -> None:
    shard = load_shard(checkpoint("llama", root), 0, 2, torch.float64)
    source = shard_source(shard, 1, 2)
    assert source == CheckpointShard(str(checkpoint("llama", root)), torch.float64)  # a path, not weights
    in_memory = shard_source(tiny_model("llama"), 1, 2)
    assert isinstance(in_memory, PackedModule)  # a model that exists only in memory is handed over


def test_unsupported_plans_and_mismatched_shards_are_refused(root: str) -> None:
    model = tiny_model("llama")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.gate_proj": "packed_colwise"}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj as 'packed_colwise'"):
        check_tp_size(model, 2)
    shard = load_shard(checkpoint("llama", root), 1, 2, torch.float64)
    with pytest.raises(ValueError, match="shard 1 of 2"):
        check_tp_size(shard, 4)
    with pytest.raises(ValueError, match="needs shard 0, not shard 1"):
        cbserve.generate_batch(shard, [[1, 2, 3]], None, cbserve.ContinuousBatchingConfig(tp_size=2),
                               progress_bar=False)


def greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)


def config(**overrides) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=96, max_batch_tokens=32, return_logprobs=True,
                                            **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_tp2_from_checkpoint_shards_equals_tp1(arch: str, root: str) -> None:
    prompts = random_prompts([1, 6, 19, 45], seed=5)
    reference = cbserve.generate_batch(tiny_model(arch), prompts, greedy(), config(), progress_bar=False)
    shard = load_shard(checkpoint(arch, root), 0, 2, torch.float64)
    outputs = cbserve.generate_batch(shard, prompts, greedy(), config(tp_size=2), progress_bar=False)
    for ref, out in zip(reference.values(), outputs.values()):
        assert out.generated_tokens == ref.generated_tokens and len(out.generated_tokens) == MAX_NEW
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-9)
    # The caller's shard can serve a second engine: the first one left no hooks behind.
    again = cbserve.generate_batch(shard, prompts[:1], greedy(), config(tp_size=2), progress_bar=False)
    assert again["req_0"].generated_tokens == reference["req_0"].generated_tokens


@pytest.mark.default_model
def test_default_model_tp3_shards_hold_a_third_of_the_split_weights() -> None:
    from cbserve.models import checkpoint_folder, load_model_shard

    full = Checkpoint(checkpoint_folder(None))
    total = sum(full.rows(name).numel() * 4 for name in full.entries)
    embedding = full.rows("model.embed_tokens.weight").numel() * 4
    for rank in range(3):
        shard, tokenizer = load_model_shard(None, rank, 3, dtype=torch.float32, tokenizer=rank == 0)
        assert (tokenizer is not None) == (rank == 0)
        nbytes = sum(p.numel() * p.element_size() for p in shard.parameters())
        # The embedding (tied to the LM head) is replicated; everything else is split but the norms.
        assert embedding + (total - embedding) / 3 <= nbytes < embedding + (total - embedding) / 3 + 2**20
