"""Rank 0 of a tensor-parallel engine: an `EngineCore` over shard 0 whose runner broadcasts each
step's prepared inputs to the other ranks before running its own forward pass.

Rank 0 alone holds the requests, the scheduler, the block manager and the sampler; the other
ranks hold a model shard and a KV cache of the same pages (their share of the KV heads), and
learn of submissions and cancellations through the step plans they change. Control messages
(plans, heartbeats, shutdown) go over a CPU gloo group whose collectives are bounded by
`cpu_group_timeout`; see `tp_comm`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.outputs import GenerationOutput
from cbserve.scheduler.request import Request
from cbserve.scheduler.scheduler import ScheduledRequest
from cbserve.workers.engine import DEFAULT_MEMORY_PERCENT, EngineCore
from cbserve.workers.model_runner import ModelRunner
from cbserve.workers.tensor_parallel import check_tp_size, install_all_reduce, shard_model
from cbserve.workers.tp_comm import Message, TensorParallelError, TPGroups, destroy, pack
from cbserve.workers.tp_worker import STARTUP_TIMEOUT_S, LocalRanks, data_backend, follow

logger = logging.getLogger(__name__)

NO_TIMEOUT_S = 1800.0  # cpu_group_timeout=None: torch's own default for gloo
SHUTDOWN_GRACE_S = 10.0


def group_timeout(config: ContinuousBatchingConfig) -> float:
    return config.cpu_group_timeout if config.cpu_group_timeout is not None else NO_TIMEOUT_S


def launched_externally() -> bool:
    """Under torchrun (or a process group the caller set up), every rank runs the caller's script."""
    return dist.is_initialized() or "TORCHELASTIC_RUN_ID" in os.environ


def _external_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _join_external(world: int, timeout: float, device: torch.device) -> TPGroups:
    if not dist.is_initialized():
        dist.init_process_group(data_backend(device), timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    if dist.get_world_size() != world:
        raise ValueError(f"tp_size={world} but the launcher started {dist.get_world_size()} ranks; "
                         f"launch as many processes as tp_size")
    return TPGroups(dist.get_rank(), world, timeout, data_backend(device))


def _check(model: torch.nn.Module, config: ContinuousBatchingConfig) -> None:
    check_tp_size(model, config.tp_size)
    if config.cpu_offload_space != 0:
        raise ValueError("cpu_offload_space must be 0 with tp_size > 1: offloading pages across ranks is not "
                         "supported yet")


class TPModelRunner(ModelRunner):
    """Rank 0's runner: the engine's own runner (same cache, same compiled forward) whose
    prepared inputs also go to every other rank."""

    groups: TPGroups

    @classmethod
    def wrap(cls, runner: ModelRunner, groups: TPGroups) -> TPModelRunner:
        wrapped = cls.__new__(cls)
        wrapped.__dict__.update(runner.__dict__)
        wrapped.groups = groups
        return wrapped

    def prepare(self, batch: list[ScheduledRequest], in_flight: None = None) -> tuple[dict, list[ScheduledRequest]]:
        """Build the step's inputs and hand them to every rank, whose forward then runs in
        lockstep with this one (the all-reduces pair up). No async batching (refused by the config)."""
        kwargs, sampled = super().prepare(batch)
        plan = {k: v for k, v in kwargs.items() if k != "logits_to_keep"}
        plan["cb_meta"] = dataclasses.replace(kwargs["cb_meta"], k_caches=[], v_caches=[])
        self.groups.send(Message("step", pack(plan)))
        return kwargs, sampled

    def run(self, kwargs: dict) -> torch.Tensor:
        try:
            return super().run(kwargs)
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
    the engine so that a forgotten engine is shut down by `weakref.finalize`."""

    def __init__(self, groups: TPGroups, local: LocalRanks | None, own_default_group: bool) -> None:
        self.groups, self.local, self.own_default_group = groups, local, own_default_group
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
        destroy([self.groups.data, self.groups.control, self.groups.health]
                + ([None] if self.own_default_group else []))


class TensorParallelEngine(EngineCore):
    """`EngineCore` with `tp_size` ranks. The caller's model is not modified."""

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig | None = None,
        config: ContinuousBatchingConfig | None = None,
        max_total_tokens_hint: int | None = None,
        num_requests_hint: int | None = None,
    ) -> None:
        config = config or ContinuousBatchingConfig()
        _check(model, config)  # before any weight moves or process starts
        world, timeout = config.tp_size, group_timeout(config)
        device = next(model.parameters()).device
        local: LocalRanks | None = None
        ranks: _Ranks | None = None
        try:
            if launched_externally():
                groups = _join_external(world, timeout, device)
                if groups.rank != 0:
                    raise RuntimeError(f"rank {groups.rank}: under torchrun the engine runs on rank 0; other "
                                       "ranks call cbserve.serve_tensor_parallel_rank(model, config)")
            else:
                if device.type == "cuda" and torch.cuda.device_count() < world:
                    raise ValueError(f"tp_size={world} needs {world} GPUs (one per rank); "
                                     f"this machine has {torch.cuda.device_count()}")
                if dist.is_initialized():
                    raise RuntimeError("a torch.distributed group is already initialized in this process")
                local = LocalRanks(model, world, timeout, device)
                local.init_group(device)
                groups = TPGroups(0, world, timeout, data_backend(device))
                groups.peer_report = local.report
            ranks = _Ranks(groups, local, own_default_group=local is not None)
            shard = shard_model(model, 0, world)
            install_all_reduce(shard, groups.data)
            if device.type == "cpu" and config.num_blocks is None:
                # The ranks' caches share the host's memory: together they take one engine's share.
                share = (config.max_memory_percent or DEFAULT_MEMORY_PERCENT["cpu"]) / world
                config = config.model_copy(update={"max_memory_percent": share})
            super().__init__(shard, generation_config or model.generation_config, config,
                             max_total_tokens_hint, num_requests_hint)
            self.runner = TPModelRunner.wrap(self.runner, groups)
            groups.send(Message("setup", {"num_blocks": self.cache.num_blocks, "page_size": self.cache.page_size}))
        except BaseException:
            if ranks is not None:
                ranks.abort()
                ranks.close()
            elif local is not None:
                local.stop(grace=0.0)
            raise
        self.groups = groups
        self._ranks = ranks
        fair_threads = max(1, (os.cpu_count() or 1) // world)
        if device.type == "cpu" and torch.get_num_threads() > fair_threads:
            logger.warning("%d ranks share %d CPUs and rank 0 uses %d torch threads: oversubscribed threads "
                           "spin; consider torch.set_num_threads(%d)", world, os.cpu_count(),
                           torch.get_num_threads(), fair_threads)
        ranks.heartbeat.start()
        self._finalizer = weakref.finalize(self, ranks.close)
        logger.info("tensor parallel: %d ranks, %s, cpu_group_timeout=%gs", world, data_backend(device), timeout)

    @property
    def rank_pids(self) -> list[int]:
        return self._ranks.local.pids if self._ranks.local is not None else []

    def make_request(self, *args, **kwargs) -> Request:
        if self.groups.failed is not None:  # refused at the boundary: the group is gone
            raise RuntimeError(f"the tensor-parallel group failed: {self.groups.failed}")
        return super().make_request(*args, **kwargs)

    def step(self) -> list[Request]:
        try:
            return super().step()
        except TensorParallelError:
            self._ranks.abort()
            raise

    def release_model(self, result: Any = None) -> None:
        """Shut the other ranks down (sending them `result`) and free the groups."""
        super().release_model()
        self._ranks.close(result)


def serve_tensor_parallel_rank(model: torch.nn.Module, config: ContinuousBatchingConfig) -> Any:
    """Ranks > 0 under torchrun: follow rank 0's engine until it shuts down; returns what rank 0
    sent with the shutdown (the outputs, for `generate_batch`)."""
    _check(model, config)
    device = next(model.parameters()).device
    groups = _join_external(config.tp_size, group_timeout(config), device)
    if groups.rank == 0:
        raise RuntimeError("rank 0 runs the engine (a manager or generate_batch), not serve_tensor_parallel_rank")
    try:
        return follow(shard_model(model, groups.rank, config.tp_size), groups, device)
    finally:
        destroy([groups.data, groups.control, groups.health])


def generate_batch_tp(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None,
    config: ContinuousBatchingConfig,
    progress_bar: bool,
) -> dict[str, GenerationOutput]:
    """`generate_batch` with `tp_size` ranks. Under torchrun every rank calls it with the same
    arguments and gets the same outputs."""
    if launched_externally() and _external_rank() != 0:
        return serve_tensor_parallel_rank(model, config)
    gc = generation_config or model.generation_config
    default_new = gc.max_new_tokens if gc.max_new_tokens is not None else 20
    engine = TensorParallelEngine(model, gc, config, sum(len(p) + default_new for p in inputs), len(inputs))
    from cbserve.api import run_to_completion

    outputs: dict[str, GenerationOutput] | None = None
    try:
        outputs = run_to_completion(engine, inputs, progress_bar)
        return outputs
    finally:
        engine.release_model(outputs if launched_externally() else None)
