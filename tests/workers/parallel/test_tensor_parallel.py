"""Tensor parallelism (SPEC section 5): tp_size=2 gives tp_size=1's greedy tokens on tiny random
Llama, Qwen3 and Mistral models (float64, CPU, gloo), through cancel, stop, restart and hard
stop; a tp_size that does not divide the KV heads is refused before anything starts; a killed
or hung rank fails the live requests within cpu_group_timeout + 5 s, leaving no process behind;
CPU offload works across ranks (each rank offloads and restores its shard of the pages).

Rank processes fork from a forkserver that imports torch once: the first engine of the session
takes seconds longer than the next ones.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import os
import re
import signal
import time

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve import FinishReason, GenerationOutput, RequestStatus
from cbserve.manager import ContinuousBatchingManager
from cbserve.workers.factory import build_engine
from cbserve.workers.parallel.leader import BroadcastingRunner, TensorParallelLeader
from tests.support.manager import alarm_guard
from tests.support.tiny_models import random_prompts, tiny_model

pytestmark = pytest.mark.slow

TIMEOUT = 60.0  # every blocking get
TEST_ALARM_S = 150
LENGTHS = [1, 5, 17, 40, 100]
MAX_NEW = 12
LONG_NEW = 900  # long enough to still be generating when the test acts on it


hang_guard = alarm_guard(TEST_ALARM_S)


@functools.cache
def model_for(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


def engine_config(**overrides) -> cbserve.ContinuousBatchingConfig:
    # A small token budget: prompts prefill in chunks, mixed with decodes.
    cfg = {"page_size": 16, "num_blocks": 192, "max_batch_tokens": 32, "return_logprobs": True}
    cfg.update(overrides)
    return cbserve.ContinuousBatchingConfig(**cfg)


def greedy(max_new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)


@functools.cache
def tp1(arch: str, prompt: tuple[int, ...], max_new: int) -> tuple[list[int], list[float]]:
    """The single-process engine's greedy tokens and logprobs for one prompt."""
    engine = build_engine(model_for(arch), greedy(max_new), engine_config())
    try:
        request = engine.make_request(list(prompt), "ref")
        engine.add_request(request)
        while engine.has_work:
            engine.step()
        return request.generated, request.logprobs
    finally:
        engine.release_model()


def assert_like_tp1(arch: str, prompt: list[int], output: GenerationOutput, max_new: int = MAX_NEW,
                    logprob_abs: float = 1e-9) -> None:
    tokens, logprobs = tp1(arch, tuple(prompt), max_new)
    n = len(output.generated_tokens)
    assert output.generated_tokens == tokens[:n], f"prompt of {len(prompt)} tokens"
    assert output.logprobs == pytest.approx(logprobs[:n], abs=logprob_abs)


def final(manager: ContinuousBatchingManager, request_id: str) -> GenerationOutput:
    for output in manager.request_id_iter(request_id):
        if output.is_finished():
            return output
    raise AssertionError(f"{request_id}: no final output")


def first_tokens(manager: ContinuousBatchingManager, request_id: str, n: int) -> None:
    """Block until a streaming request has generated `n` tokens."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        output = manager.get_result(request_id, timeout=1.0)
        if output is not None:
            assert not output.is_finished(), output
            if len(output.generated_tokens) >= n:
                return
    raise AssertionError(f"{request_id}: fewer than {n} tokens within {TIMEOUT} s")


def rank_processes_gone(pids: list[int]) -> bool:
    return all(not os.path.exists(f"/proc/{pid}") for pid in pids)


def test_tp_size_must_divide_kv_heads() -> None:
    model = model_for("llama")  # 4 query heads, 2 KV heads
    before = multiprocessing.active_children()
    for make in (
        lambda cfg: cbserve.init_continuous_batching(model, greedy(4), cfg),
        lambda cfg: cbserve.generate_batch(model, [[1, 2, 3]], greedy(4), cfg, progress_bar=False),
    ):
        with pytest.raises(ValueError, match=r"2 KV heads.*sizes that would work are \[1, 2\]"):
            make(engine_config(tp_size=3))
        with pytest.raises(ValueError, match=r"2 KV heads.*\[1, 2\]"):
            make(engine_config(tp_size=4))
    assert multiprocessing.active_children() == before  # refused before any rank started
    assert model.config.num_key_value_heads == 2 and model.config._attn_implementation == "sdpa"


def test_generate_batch_tp2_equals_tp1() -> None:
    prompts = random_prompts(LENGTHS, seed=1)
    outputs = cbserve.generate_batch(model_for("llama"), prompts, greedy(MAX_NEW), engine_config(tp_size=2),
                                     progress_bar=False)
    assert list(outputs) == [f"req_{i}" for i in range(len(prompts))]
    for prompt, output in zip(prompts, outputs.values()):
        assert output.status == RequestStatus.FINISHED and len(output.generated_tokens) == MAX_NEW
        assert_like_tp1("llama", prompt, output)
    assert model_for("llama").config._attn_implementation == "sdpa"  # the caller's model is untouched


def test_embeddings_under_tp2_equal_tp1_beside_generating_requests() -> None:
    """Embedding requests (issue 31) under tensor parallelism: rank 0 pools the final hidden
    states its forward already holds whole (the last all-reduce came before the final norm)."""
    from tests.support.exactness import MAX_NEW as GENERATED
    from tests.workers.test_embeddings import reference_embedding, run_mixed

    model, prompts = model_for("llama"), random_prompts(LENGTHS, seed=2)
    # The reference runs on a copy: transformers' hidden-state capture leaves hooks on the model it
    # runs, and the shared one must stay picklable for the next tests' rank processes.
    reference_model = copy.deepcopy(model)
    embeddings, generating, _ = run_mixed(model, engine_config(tp_size=2), "mean", prompts)
    for prompt, embedding, request in zip(prompts, embeddings, generating):
        assert embedding.finish_reason == FinishReason.POOLED and request.status == RequestStatus.FINISHED
        expected = reference_embedding(reference_model, prompt, "mean")
        torch.testing.assert_close(torch.tensor(embedding.pooling.embedding, dtype=expected.dtype), expected)
        tokens, logprobs = tp1("llama", tuple(prompt), GENERATED)
        assert request.generated == tokens
        assert request.logprobs == pytest.approx(logprobs, abs=1e-9)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_tp2_equals_tp1(method: str, tmp_path) -> None:
    """Proposal rows reach the other rank like any other rows: tp_size=2 with n-gram or draft-model
    speculation (the draft, the target's whole weights, runs on rank 0) gives tp_size=1's tokens
    without it, with proposals accepted."""
    prompts = []
    for seed in (4, 7):  # prompts whose greedy outputs repeat n-grams (tests/workers/test_speculative.py)
        seg = random_prompts([12], seed=seed)[0]
        prompts.append(seg + seg[:6] + seg)
    spec = {"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": None}
    if method == "draft_model":
        model_for("llama").save_pretrained(tmp_path / "draft")
        spec["model"] = str(tmp_path / "draft")
    manager = cbserve.init_continuous_batching(model_for("llama"), greedy(32), engine_config(tp_size=2,
                                                                                            speculative=spec))
    manager.start()
    try:
        ids = [manager.add_request(p) for p in prompts]
        for prompt, rid in zip(prompts, ids):
            out = manager.get_result(rid, timeout=TIMEOUT)
            while not out.is_finished():
                out = manager.get_result(rid, timeout=TIMEOUT)
            # Logprobs are of float32 logits (`ModelRunner`): verified proposal rows take them from
            # torch's log-softmax, tp1's greedy rows from the C++ greedy kernel, whose sums round
            # differently (1 ulp seen on an AVX2 EPYC); another distribution would be off by > 1e-2.
            assert_like_tp1("llama", prompt, out, max_new=32, logprob_abs=1e-6)
        assert manager.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        manager.stop(block=True, timeout=TIMEOUT)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_manager_tp2_equals_tp1_through_cancel_stop_and_hard_stop(arch: str) -> None:
    model = model_for(arch)
    manager = cbserve.init_continuous_batching(model, greedy(MAX_NEW), engine_config(tp_size=2))
    engine = manager.engine
    assert isinstance(engine.parallel, TensorParallelLeader) and isinstance(engine.runner, BroadcastingRunner)
    assert engine.cache.num_kv_heads == 1 and engine.model.config.num_attention_heads == 2  # per shard
    pids = engine.parallel.rank_pids
    assert len(pids) == 1
    try:
        manager.start()
        prompts = random_prompts(LENGTHS, seed=2)
        # Cancel a long streaming request while the others run beside it.
        long_prompt = random_prompts([30], seed=3)[0]
        long_id = manager.add_request(long_prompt, max_new_tokens=LONG_NEW, streaming=True)
        ids = manager.add_requests(prompts)
        first_tokens(manager, long_id, 3)
        manager.cancel_request(long_id)
        cancelled = final(manager, long_id)
        assert cancelled.status == RequestStatus.CANCELLED and cancelled.finish_reason == FinishReason.CANCELLED
        assert 3 <= len(cancelled.generated_tokens) < LONG_NEW
        assert_like_tp1(arch, long_prompt, cancelled, LONG_NEW)
        for prompt, rid in zip(prompts, ids):
            output = final(manager, rid)
            assert output.status == RequestStatus.FINISHED and len(output.generated_tokens) == MAX_NEW
            assert_like_tp1(arch, prompt, output)

        # A graceful stop during generation finishes the queued and running work.
        ids = manager.add_requests(prompts[:3])
        manager.stop(timeout=TIMEOUT)
        for prompt, rid in zip(prompts, ids):
            output = final(manager, rid)
            assert output.status == RequestStatus.FINISHED
            assert_like_tp1(arch, prompt, output)

        # The ranks outlive stop(): a restarted manager serves again.
        manager.start()
        rid = manager.add_request(prompts[4])
        assert_like_tp1(arch, prompts[4], final(manager, rid))

        # A hard stop during generation fails what is live.
        rid = manager.add_request(long_prompt, max_new_tokens=LONG_NEW, streaming=True)
        first_tokens(manager, rid, 2)
        manager.stop(hard_stop=True, timeout=TIMEOUT)
        failed = final(manager, rid)
        assert failed.status == RequestStatus.FAILED and "hard-stopped" in failed.error
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
    finally:
        manager.destroy()
    assert rank_processes_gone(pids)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_lost_rank_fails_live_requests_within_the_timeout(how: signal.Signals) -> None:
    timeout = 4.0
    manager = cbserve.init_continuous_batching(model_for("llama"), greedy(MAX_NEW),
                                               engine_config(tp_size=2, cpu_group_timeout=timeout))
    pids = manager.engine.parallel.rank_pids
    try:
        manager.start()
        prompt = random_prompts([20], seed=4)[0]
        rid = manager.add_request(prompt, max_new_tokens=LONG_NEW, streaming=True)
        queued = manager.add_request(prompt, max_new_tokens=LONG_NEW)
        first_tokens(manager, rid, 3)
        os.kill(pids[0], how)
        lost = time.monotonic()
        outputs = [final(manager, rid), final(manager, queued)]
        elapsed = time.monotonic() - lost
        assert elapsed < timeout + 5, f"failure reported after {elapsed:.1f} s"
        for output in outputs:
            assert output.status == RequestStatus.FAILED, output
            assert len(output.generated_tokens) < LONG_NEW
            assert "rank 1" in output.error, output.error
            # ... and what rank 0 was doing when it found out.
            assert re.search(r"while rank 0 was (sending \w+ message \d+|running its forward pass)", output.error)
        if how == signal.SIGKILL:
            assert "SIGKILL" in outputs[0].error
        else:
            assert "no answer from rank 1" in outputs[0].error
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            manager.add_request(prompt)
        assert rank_processes_gone(pids)  # the failure already ended every rank
    finally:
        manager.destroy()
    assert rank_processes_gone(pids)


def test_tp2_offloads_and_restores_each_ranks_shard_of_the_pages() -> None:
    """A cache too small for the batch: evicted requests' pages go to every rank's host pool and
    come back (each rank its own KV heads); the tokens are those of an engine that never evicts."""
    from cbserve.workers.factory import build_engine

    prompts = random_prompts([1, 7, 33, 64, 100, 150, 300], seed=6)
    reference = cbserve.generate_batch(model_for("llama"), prompts, greedy(MAX_NEW), engine_config(),
                                       progress_bar=False)
    cfg = engine_config(tp_size=2, num_blocks=24, max_batch_tokens=64, allow_block_sharing=False,
                        cpu_offload_space=0.01)
    engine = build_engine(model_for("llama"), greedy(MAX_NEW), cfg)
    try:
        requests = [engine.make_request(p, f"req_{i}") for i, p in enumerate(prompts)]
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
        stats = engine.stats()
    finally:
        engine.release_model()
    assert stats["offloads"] > 0 and stats["restores"] == stats["offloads"] and stats["recomputes"] == 0
    for request, ref in zip(requests, reference.values()):
        assert request.generated == ref.generated_tokens, request.request_id
        assert request.logprobs == pytest.approx(ref.logprobs, abs=1e-9)


@pytest.mark.parametrize("kernel", ["auto", "torch"])  # the C++ delta kernel; the masked GEMMs
def test_lora_adapters_under_tp2_equal_peft_merged_models(kernel: str, monkeypatch) -> None:
    """Multi-LoRA (issue 33) with tp_size=2: each rank adds its shard's slice of every adapter
    (lora_B split by output rows on q/k/v and gate/up, lora_A by input columns on o_proj and
    down_proj, whose delta is all-reduced); 4 adapters through 2 slots (copies replayed by rank 1)
    beside base-model rows, then an adapter unloaded and another loaded: every request's tokens
    and logprobs equal PEFT's merged model's."""
    pytest.importorskip("peft")
    from cbserve.kernels import lora
    from tests.support.exactness import assert_matches_reference
    from tests.support.lora_adapters import ADAPTERS, NAMES, adapter_dir, base_model, reference

    monkeypatch.setenv(lora.KERNEL_ENV, kernel)  # rank processes inherit it
    folders = {name: adapter_dir("llama", name) for name in ADAPTERS}
    cfg = engine_config(tp_size=2, enable_lora=True, max_loras=2, page_size=4, num_blocks=256)
    engine = build_engine(base_model("llama"), greedy(8), cfg)
    prompts = random_prompts([3, 40, 17, 9, 60, 25, 1, 33, 12, 50], seed=3)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    requests = []
    try:
        for name, folder in folders.items():
            engine.load_lora(name, folder)
        for wave in (range(5), range(5, 10)):
            for i in wave:
                requests.append(engine.make_request(prompts[i], f"req_{i}", lora=names[i]))
                engine.add_request(requests[-1])
            while engine.has_work:
                engine.step()
        engine.unload_lora("mlp", requests)  # rank 1 forgets it; a new load is a new id it is sent
        engine.load_lora("mlp again", folders["mlp"])
        again = engine.make_request(prompts[1], "again", lora="mlp again")
        engine.add_request(again)
        while engine.has_work:
            engine.step()
        stats = engine.stats()
    finally:
        engine.release_model()
    assert stats["lora_evictions"] > 0
    refs = [reference("llama", name, tuple(p)) for p, name in zip(prompts, names)]
    assert_matches_reference(requests + [again], refs + [reference("llama", "mlp", tuple(prompts[1]))])
