"""Rank 0 of a tensor-parallel engine. The engine core is given a `TensorParallelLeader`
(composition): the leader starts or joins the other ranks (`launch.py`), shards the model, wraps
the engine's runner so that each step's prepared inputs are broadcast before rank 0's own
forward pass, pings idle ranks, and tears them down.

Rank 0 alone holds the requests, the scheduler, the block manager and the sampler; the other
ranks hold a model shard and a KV cache of the same pages (their share of the KV heads), and
learn of submissions and cancellations through the step plans they change. Control messages
(plans, heartbeats, shutdown) go over a CPU gloo group whose collectives are bounded by
`cpu_group_timeout`; see `groups.py`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from cbserve.config import ContinuousBatchingConfig
from cbserve.scheduler.host_pages import KVTransfer
from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.kv.host_pool import HostKVPool
from cbserve.workers.model_runner import ModelRunner
from cbserve.workers.parallel import step_codec
from cbserve.workers.parallel.groups import (
    Message,
    TensorParallelError,
    TPGroups,
    data_backend,
    destroy,
)
from cbserve.workers.parallel.launch import LocalRanks, group_timeout, join_launched_group, resolve_launcher
from cbserve.workers.parallel.sharding import (
    check_parallel_config,
    install_all_reduce,
    is_shard,
    quantize_shard,
    shard_model,
    shard_spec,
)
from cbserve.workers.sizing import DEFAULT_MEMORY_PERCENT

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0


class BroadcastingRunner:
    """Rank 0's runner: the engine's own runner (same cache, same compiled forward) whose
    prepared inputs also go to every other rank, as one int64 tensor (`step_codec`) built from
    the host tensors the runner made (captured on their way to the device), together with the
    KV transfers rank 0 ran since the last step."""

    def __init__(self, runner: ModelRunner, groups: TPGroups) -> None:
        self.inner, self.groups = runner, groups
        self.transfers: list[KVTransfer] = []  # run on rank 0, not yet sent
        self._host: list[torch.Tensor] | None = None
        to_device = runner._to_device

        def capture(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            self._host = parts
            return to_device(parts)

        runner._to_device = capture

    def __getattr__(self, name: str) -> Any:  # forward, graphs, kernels, ...: the inner runner's
        return getattr(self.inner, name)

    def prepare(self, batch: list, in_flight: None = None) -> tuple[dict, list]:
        """Build the step's inputs and hand them to every rank, whose forward then runs in
        lockstep with this one (the all-reduces pair up). No async batching (refused by the config)."""
        self._host = None
        kwargs, sampled = self.inner.prepare(batch)
        if self._host is None:
            raise RuntimeError("tensor parallelism: the runner's prepare() did not pass its inputs through _to_device")
        lora, lora_step = self.inner.lora, None
        if lora is not None:  # the adapters the step's copies need go first; rows and copies with the step
            adapters = lora.sync()
            if adapters is not None:
                self.groups.send(Message("lora", adapters))
            lora_step = step_codec.LoraStep(lora.batch.rows, lora.step_copies)
        flat = step_codec.encode(self._host, kwargs["cb_meta"], self.transfers, lora_step)
        self.transfers, self._host = [], None
        self.groups.send(Message("step", flat))
        return kwargs, sampled

    def run(self, kwargs: dict) -> torch.Tensor:
        try:
            return self.inner.run(kwargs)
        except TensorParallelError:
            raise
        except Exception as error:  # the ranks are out of lockstep now, whatever the cause
            raise self.groups.fail("running its forward pass", error) from error


def _heartbeat(groups: TPGroups, stop: threading.Event, on_failure) -> None:
    """Ping the other ranks while rank 0 is idle, so their wait for the next message (bounded
    by the timeout) only expires when rank 0 is really gone or stuck."""
    interval = min(groups.timeout / 4, 5.0)
    while not stop.wait(interval / 4):
        if time.monotonic() - groups.last_send < interval:
            continue
        try:
            groups.send(Message("ping"))
        except TensorParallelError:
            on_failure()
            return


class _Ranks:
    """What rank 0 must tear down: the heartbeat, the other ranks, the groups. Kept apart from
    the leader so that a forgotten engine is shut down by `weakref.finalize`."""

    def __init__(self, groups: TPGroups, local: LocalRanks | None) -> None:
        self.groups, self.local = groups, local
        self.stop_heartbeat = threading.Event()
        self.heartbeat = threading.Thread(target=_heartbeat, args=(groups, self.stop_heartbeat, self.abort),
                                          name="cbserve-tp-heartbeat", daemon=True)
        self.closed = False
        self._lock = threading.Lock()

    def abort(self) -> None:
        """After a failure: end the local ranks now (a hung one never would)."""
        if self.local is not None:
            self.local.stop(grace=0.0)

    def close(self, result: Any = None) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.stop_heartbeat.set()
        if self.heartbeat.is_alive():
            self.heartbeat.join()
        try:
            self.groups.send(Message("shutdown", result))
        except Exception as error:  # noqa: BLE001 - a failed group: the local ranks are killed below
            logger.debug("shutdown not delivered: %r", error)
        if self.local is not None:
            self.local.stop(grace=SHUTDOWN_GRACE_S)
        # The spawned group is ours to destroy; a launcher's default group stays its own.
        destroy([self.groups.data, self.groups.control, self.groups.health]
                + ([None] if self.local is not None else []))


def _start_group(model: torch.nn.Module, config: ContinuousBatchingConfig,
                 device: torch.device) -> tuple[TPGroups, LocalRanks | None]:
    world, timeout = config.tp_size, group_timeout(config)
    if resolve_launcher(config) != "spawn":
        groups = join_launched_group(config, device)
        if groups.rank != 0:
            raise RuntimeError(f"rank {groups.rank}: the engine runs on rank 0; other ranks call "
                               "cbserve.serve_tensor_parallel_rank(model, config)")
        return groups, None
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tp_size={world} needs {world} GPUs (one per rank); "
                         f"this machine has {torch.cuda.device_count()}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already initialized in this process: pass "
                           "tp_launcher='external' to use it, or 'torchrun'")
    local = LocalRanks(model, world, timeout, device, (config.quantization, config.batch_invariant))
    try:
        local.init_group(device)
        groups = TPGroups(0, world, timeout, data_backend(device))
    except BaseException:
        local.stop(grace=0.0)
        raise
    groups.peer_report = local.report
    return groups, local


class TensorParallelLeader:
    """Rank 0's side of the group. `model` is either rank 0's shard (`cbserve.load_model_shard`;
    the other ranks then read theirs from the same checkpoint) or a whole model, which is not
    modified: `shard` is then rank 0's view of it."""

    def __init__(self, model: torch.nn.Module, config: ContinuousBatchingConfig) -> None:
        check_parallel_config(model, config)  # before any weight moves or process starts
        if is_shard(model) and shard_spec(model).rank != 0:
            raise ValueError(f"the engine runs on rank 0 and needs shard 0, not shard {shard_spec(model).rank}")
        self.world = config.tp_size
        self.device = next(model.parameters()).device
        groups, local = _start_group(model, config, self.device)
        self.groups = groups
        self._ranks = _Ranks(groups, local)
        self._finalizer = weakref.finalize(self, self._ranks.close)
        try:
            self.shard = model if is_shard(model) else shard_model(model, 0, self.world)
            quantize_shard(self.shard, config.quantization, config.batch_invariant)
            self._hooks = install_all_reduce(self.shard, groups.data)
        except BaseException:
            self.abort()
            self.close()
            raise

    def engine_config(self, config: ContinuousBatchingConfig) -> ContinuousBatchingConfig:
        """Rank 0's engine config. Every rank has a host pool of the same pages (its shard of
        each), all in the host's memory: together they take `cpu_offload_space` (or the safety
        threshold of free memory). On a CPU the ranks' caches share the host's memory too, so
        together they take one engine's share."""
        update: dict[str, float] = {}
        if config.cpu_offload_space:
            update["cpu_offload_space"] = config.cpu_offload_space / self.world
        if config.cpu_offload_space is None:
            update["cpu_offload_space_safety_threshold"] = config.cpu_offload_space_safety_threshold / self.world
        if self.device.type == "cpu" and config.num_blocks is None:
            update["max_memory_percent"] = (config.max_memory_percent or DEFAULT_MEMORY_PERCENT["cpu"]) / self.world
        return config.model_copy(update=update) if update else config

    @property
    def rank_pids(self) -> list[int]:
        return self._ranks.local.pids if self._ranks.local is not None else []

    def wrap_runner(self, runner: ModelRunner) -> BroadcastingRunner:
        self.runner = BroadcastingRunner(runner, self.groups)
        return self.runner

    def wrap_host_pool(self, pool: HostKVPool | None) -> HostKVPool | None:
        """Rank 0's host pool: the transfers it runs also go to the other ranks, with the next step
        (each rank copies its own shard of the pages, before that step's forward pass)."""
        if pool is None:
            return None
        self.host_pool = pool
        execute = pool.execute

        def broadcasting_execute(transfers: list[KVTransfer]) -> None:
            execute(transfers)
            self.runner.transfers.extend(transfers)

        pool.execute = broadcasting_execute
        return pool

    def start(self, cache: PagedKVCache) -> None:
        """The engine is built: the other ranks allocate the same pages (and host pool) and take
        rank 0's attention kernels; the heartbeat starts."""
        pool = getattr(self, "host_pool", None)
        lora = self.runner.inner.lora
        self.groups.send(Message("setup", {"num_blocks": cache.num_blocks, "page_size": cache.page_size,
                                           "host_blocks": pool.num_blocks if pool is not None else 0,
                                           "kernels": self.runner.inner.kernels,
                                           "lora": (lora.max_loras, lora.max_rank) if lora is not None else None}))
        fair_threads = max(1, (os.cpu_count() or 1) // self.world)
        if self.device.type == "cpu" and torch.get_num_threads() > fair_threads:
            logger.warning("%d ranks share %d CPUs and rank 0 uses %d torch threads: oversubscribed threads "
                           "spin; consider torch.set_num_threads(%d)", self.world, os.cpu_count(),
                           torch.get_num_threads(), fair_threads)
        self._ranks.heartbeat.start()
        logger.info("tensor parallel: %d ranks, %s, cpu_group_timeout=%gs", self.world,
                    data_backend(self.device), self.groups.timeout)

    def check_health(self) -> None:
        if self.groups.failed is not None:
            raise RuntimeError(f"the tensor-parallel group failed: {self.groups.failed}")

    def abort(self) -> None:
        self._ranks.abort()

    def close(self, result: Any = None) -> None:
        """Shut the other ranks down (sending them `result`) and free the groups; the shard
        (the caller's, when it passed one) loses its all-reduce hooks."""
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        self._ranks.close(result)
