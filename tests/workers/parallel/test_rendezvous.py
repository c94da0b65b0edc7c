"""Rendezvous of an externally launched tensor-parallel group (issue 18): rank 0's port is bound
before it is published and stays bound until the others join (no choose-release-rebind race);
a rank that cannot reach it, or a group that does not fill up, fails within its timeout with an
error naming the rank and what it was doing."""

from __future__ import annotations

import errno
import multiprocessing
import socket
import time

import pytest
import torch
import torch.distributed as dist

from cbserve.workers.parallel.groups import TensorParallelError
from cbserve.workers.parallel.launch import Rendezvous, join_rendezvous


def _rank_1(port: int, delay: float, queue) -> None:
    try:
        time.sleep(delay)  # rank 0 published long ago: its port must still be its own
        join_rendezvous("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout=60)
        t = torch.ones(3)
        dist.all_reduce(t)
        queue.put(t.tolist())
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put(repr(error))


def test_rank_0_binds_before_publishing_and_the_others_join() -> None:
    rendezvous = Rendezvous("127.0.0.1", 2, timeout=60)
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", rendezvous.port))
    assert taken.value.errno == errno.EADDRINUSE
    _all_reduce_with_rank_1(rendezvous, delay=1.0)


def _all_reduce_with_rank_1(rendezvous: Rendezvous, delay: float) -> None:
    """Rank 0 here, rank 1 in a fresh process joining after `delay` s: both sum ones."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank_1, args=(rendezvous.port, delay, queue))
    proc.start()
    try:
        rendezvous.join(torch.device("cpu"))
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [2.0, 2.0, 2.0]
        assert queue.get(timeout=60) == [2.0, 2.0, 2.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        proc.join(30)


def test_an_unreachable_rendezvous_names_the_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 1 could not reach rank 0's rendezvous at 127.0.0.1:{port}"):
        join_rendezvous("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout=2)
    assert time.monotonic() - start < 30


def test_a_group_that_does_not_fill_up_names_the_rank_and_the_operation() -> None:
    rendezvous = Rendezvous("127.0.0.1", 2, timeout=2)
    with pytest.raises(TensorParallelError, match=r"rank 0 of 2 failed joining the tensor-parallel group at "
                                                  rf"127.0.0.1:{rendezvous.port} \(timeout 2s"):
        rendezvous.join(torch.device("cpu"))
    assert not dist.is_initialized()


def test_a_group_after_a_failed_one_forms() -> None:
    """torch names a default group after a counter that a failed start leaves behind: rank 0's
    next group must still carry the name its fresh peers use (it waited forever before)."""
    with pytest.raises(TensorParallelError):
        Rendezvous("127.0.0.1", 2, timeout=1).join(torch.device("cpu"))
    _all_reduce_with_rank_1(Rendezvous("127.0.0.1", 2, timeout=20), delay=0.0)


def _external_rank(rank: int, ports, folder: str, prompts: list[list[int]], queue) -> None:
    """One rank of an externally launched group (as the replica and a Ray rank actor would be),
    serving two engines in a row with the shard it loaded once."""
    from transformers import GenerationConfig

    import cbserve
    from cbserve.workers.parallel.loading import load_shard

    try:
        if rank == 0:
            rendezvous = Rendezvous("127.0.0.1", 2, timeout=120)
            ports.put(rendezvous.port)  # published once bound
            rendezvous.join(torch.device("cpu"))
        else:
            join_rendezvous("127.0.0.1", ports.get(timeout=120), rank, 2, torch.device("cpu"), timeout=120)
        shard = load_shard(folder, rank, 2, torch.float64)
        gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
        cfg = cbserve.ContinuousBatchingConfig(tp_size=2, tp_launcher="external", page_size=16, num_blocks=64,
                                               prepack_weights=False, return_logprobs=True)
        results = []
        # Two engines in a row, then a third on the same shards quantized by each rank (int8).
        for engine_cfg in (cfg, cfg, cfg.model_copy(update={"quantization": "int8"})):
            if rank == 0:
                outputs = cbserve.generate_batch(shard, prompts, gc, engine_cfg, progress_bar=False)
                results.append([(o.generated_tokens, o.logprobs) for o in outputs.values()])
            else:
                cbserve.serve_tensor_parallel_rank(shard, engine_cfg)
        assert not any(m._forward_hooks for m in shard.modules())  # the engines left no collective behind
        queue.put((rank, results))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(error)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_external_group_serves_engines_in_a_row_from_shards_loaded_once(tmp_path) -> None:
    from transformers import GenerationConfig

    import cbserve
    from tests.support.tiny_models import random_prompts, tiny_model

    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    prompts = random_prompts([4, 20], seed=9)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=64, prepack_weights=False, return_logprobs=True)
    reference = cbserve.generate_batch(model, prompts, gc, cfg, progress_bar=False)
    quantized = cbserve.generate_batch(model, prompts, gc, cfg.model_copy(update={"quantization": "int8"}),
                                       progress_bar=False)
    ctx = multiprocessing.get_context("spawn")
    queue, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_external_rank, args=(r, ports, str(tmp_path), prompts, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
    assert results[1] == [] and len(results[0]) == 3, results
    for engine, want in zip(results[0], (reference, reference, quantized)):
        for (tokens, logprobs), w in zip(engine, want.values()):
            assert tokens == w.generated_tokens
            assert logprobs == pytest.approx(w.logprobs, abs=1e-5)
    # The third engine's logprobs tell whether rank 1 quantized its shard: int8 moves them more.
    dense, int8 = reference["req_1"].logprobs, quantized["req_1"].logprobs
    assert max(abs(a - b) for a, b in zip(dense, int8)) > 1e-3
