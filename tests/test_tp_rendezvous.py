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
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank_1, args=(rendezvous.port, 1.0, queue))
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
