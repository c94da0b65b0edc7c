"""The tensor-parallel step broadcast without pickling (issue 18): every step of a run, encoded
from rank 0's host inputs into one int64 tensor and decoded as another rank does, rebuilds the
same forward kwargs and attention metadata as rank 0's runner (field by field, so a field added
to the metadata later and not carried fails here), for the sdpa, cpu and reference backends,
through decode fast-path, mixed and chunked-prefill steps; KV transfers travel with them. The
control channel carries long steps (over its fixed capacity) and pickled payloads intact.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.kernels.paged_attention import AttentionMetadata, KernelInputs, PrefillChunk
from cbserve.scheduler.host_pages import KVTransfer
from cbserve.workers.factory import build_engine
from cbserve.workers.parallel import step_codec
from tests.support.tiny_models import random_prompts, tiny_model


def same(a, b, where: str) -> None:
    """Equal values, tensors equal in dtype and content, dataclasses field by field."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, (AttentionMetadata, KernelInputs, PrefillChunk)):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.name not in ("k_caches", "v_caches", "_decode_kv", "_kv"):
                same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


TRANSFERS = [KVTransfer("offload", (3, 4, 9), (0, 1, 2)), KVTransfer("restore", (7,), (5,))]


@pytest.mark.parametrize("backend", ["sdpa", "cpu", "reference"])
def test_every_step_decodes_to_rank_0s_inputs(backend: str) -> None:
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    cfg = cbserve.ContinuousBatchingConfig(page_size=8, num_blocks=128, max_batch_tokens=24, attention_backend=backend,
                                           prepack_weights=False, max_blocks_per_request=16)
    engine = build_engine(tiny_model("llama"), gc, cfg)
    runner = engine.runner
    host: list = []
    to_device = runner._to_device
    runner._to_device = lambda parts: host.append(parts) or to_device(parts)
    prepare, seen = runner.prepare, []

    def checking_prepare(batch, in_flight=None):
        kwargs, sampled = prepare(batch, in_flight)
        flat = step_codec.encode(host.pop(), kwargs["cb_meta"], TRANSFERS)
        decoded, transfers, _ = step_codec.decode(flat, engine.device, engine.cache.k, engine.cache.v, cfg.page_size,
                                               runner.kernels)
        assert transfers == TRANSFERS
        for key in ("input_ids", "position_ids", "logits_to_keep", "use_cache"):
            same(kwargs[key], decoded[key], key)
        same(kwargs["cb_meta"], decoded["cb_meta"], "cb_meta")
        assert decoded["cb_meta"].k_caches is engine.cache.k
        meta = kwargs["cb_meta"]
        seen.append((meta.fast_decode, bool(meta.prefills), bool(meta.num_decodes)))
        return kwargs, sampled

    runner.prepare = checking_prepare
    try:
        for i, prompt in enumerate(random_prompts([3, 30, 50, 7, 90], seed=3)):
            engine.add_request(engine.make_request(prompt, f"r{i}"))
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    assert (True, False, True) in seen  # a decode-only step on the fast path
    assert (False, True, True) in seen  # prefill chunks beside decodes
    assert (False, True, False) in seen  # prefill only


def test_transfers_round_trip_alone() -> None:
    ints = step_codec._transfer_ints(TRANSFERS).tolist()
    assert step_codec.decode_transfers(ints) == TRANSFERS
    assert step_codec.decode_transfers([]) == []


def _channel_rank(rank: int, port: int, capacity: int, queue) -> None:
    import torch.distributed as dist

    from cbserve.workers.parallel import groups as g

    g.CAPACITY = capacity  # a small channel: most messages overflow into a second broadcast
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = g.TPGroups(rank, 2, 30.0, "gloo")
        steps = [torch.arange(n, dtype=torch.int64) * 7 for n in (16, 20, capacity, capacity + 1, 3 * capacity)]
        if rank == 0:
            for flat in steps:
                tp.send(g.Message("step", flat.clone()))
                tp.send(g.Message("ping"))
            tp.send(g.Message("setup", {"num_blocks": 5, "nested": [1, "two"]}))
            tp.send(g.Message("shutdown"))
            tp.flush()
        else:
            got = []
            while (m := tp.recv()).kind != "shutdown":
                got.append((m.kind, m.payload.clone() if m.kind == "step" else m.payload))
            kinds = [k for k, _ in got]
            assert kinds == ["step", "ping"] * len(steps) + ["setup"], kinds
            for flat, (_, payload) in zip(steps, got[::2]):
                assert payload[3:].tolist() == flat[3:].tolist()  # slots 0-2 are the channel's header
                assert payload[1] == flat.numel()
            assert got[-1][1] == {"num_blocks": 5, "nested": [1, "two"]}
            assert tp.sequence == 2 * len(steps) + 2
        queue.put((rank, "ok"))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(error)))
    finally:
        dist.destroy_process_group()


def test_channel_carries_long_steps_and_pickled_payloads() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_channel_rank, args=(r, port, 64, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {0: "ok", 1: "ok"}, results
