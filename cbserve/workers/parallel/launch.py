"""How the ranks of a tensor-parallel engine come to exist, chosen by `tp_launcher`:

- ``spawn``: rank 0 (the caller) starts ranks 1..N-1 as local processes. When rank 0's model
  is a shard loaded from a checkpoint (`cbserve.load_model_shard`), each rank reads its own
  shard from that checkpoint (`CheckpointShard`); a model that exists only in memory is sharded
  by rank 0 and each shard handed over in shared memory (`PackedModule`). The processes are
  forked from a forkserver that has imported torch and transformers once, so an engine after
  the first starts in a second or two instead of re-importing everything.
- ``torchrun``: every rank runs the caller's script; the group is joined from torchrun's
  environment variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...).
- ``external``: the caller has already joined a `torch.distributed` group of `tp_size` ranks
  (the Ray cluster's rank actors do this, `cluster/tp_ranks.py`). `Rendezvous` and
  `join_rendezvous` make such a group without a race: rank 0 binds its store's port (chosen by
  the OS) before publishing it, and keeps it bound until every rank has joined.

None resolves to ``torchrun`` under torchrun (`TORCHELASTIC_RUN_ID` is set), else ``spawn``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cbserve.config import ContinuousBatchingConfig
from cbserve.kernels.quantized import GGUF_SOURCE
from cbserve.workers.parallel.follower import follow
from cbserve.workers.parallel.groups import (
    NO_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    TensorParallelError,
    TPGroups,
    data_backend,
    destroy,
)
from cbserve.workers.parallel.loading import load_shard
from cbserve.workers.parallel.sharding import (
    check_parallel_config,
    is_shard,
    quantize_shard,
    shard_model,
    shard_spec,
)

logger = logging.getLogger(__name__)

REPORT_GRACE_S = 1.0  # how long a failure report waits for a dying rank's exit status
READY_KEY = "cbserve_tp/ready/{}"
PRELOAD = ["torch", "torch.distributed", "transformers", "accelerate", "cbserve.workers.parallel.launch"]


def resolve_launcher(config: ContinuousBatchingConfig) -> str:
    if config.tp_launcher is not None:
        return config.tp_launcher
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "spawn"


def group_timeout(config: ContinuousBatchingConfig) -> float:
    return config.cpu_group_timeout if config.cpu_group_timeout is not None else NO_TIMEOUT_S


def launcher_rank(config: ContinuousBatchingConfig) -> int:
    """This process's rank as the launcher sees it (0 for ``spawn``: the caller is rank 0)."""
    launcher = resolve_launcher(config)
    if launcher == "external" and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0")) if launcher == "torchrun" else 0


class Rendezvous:
    """Rank 0's side of an external group's rendezvous: a TCP store listening on `port` (picked
    by the OS) from construction on, so the port can be published to the other ranks at once and
    nothing else can take it before they connect."""

    def __init__(self, address: str, world: int, timeout: float = STARTUP_TIMEOUT_S) -> None:
        self.address, self.world, self.timeout = address, world, timeout
        self.store = dist.TCPStore(address, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout))
        self.port = self.store.port

    def join(self, device: torch.device) -> None:
        """Join the group as rank 0; returns once every rank has joined."""
        _init_group(self.store, 0, self.world, device, self.timeout, f"{self.address}:{self.port}")


def join_rendezvous(address: str, port: int, rank: int, world: int, device: torch.device,
                    timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Ranks > 0: join the group whose `Rendezvous` rank 0 published at `address:port`."""
    where = f"{address}:{port}"
    try:
        store = dist.TCPStore(address, port, world, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as error:
        raise TensorParallelError(f"rank {rank} could not reach rank 0's rendezvous at {where} within {timeout:g}s "
                                  f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from error
    _init_group(store, rank, world, device, timeout, where)


def _reset_group_names() -> None:
    """torch names a default group after a per-process counter that only a successful teardown
    of the previous default group resets: after a failed one, rank 0 of a new group would use
    another name than its fresh peers and wait for them forever. No group is live here."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and getattr(world, "group_count", 0):
        logger.debug("resetting torch's process group counter (%d) left by an earlier group", world.group_count)
        world.group_count = 0


def _init_group(store: dist.Store, rank: int, world: int, device: torch.device, timeout: float, where: str) -> None:
    if not dist.is_initialized():
        _reset_group_names()
    try:
        dist.init_process_group(data_backend(device), store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except Exception as error:
        raise TensorParallelError(f"rank {rank} of {world} failed joining the tensor-parallel group at {where} "
                                  f"(timeout {timeout:g}s; {type(error).__name__}: "
                                  f"{str(error).splitlines()[0][:200]})") from error


def join_launched_group(config: ContinuousBatchingConfig, device: torch.device) -> TPGroups:
    """``torchrun`` / ``external``: this process's groups in the group its launcher made."""
    world = config.tp_size
    if resolve_launcher(config) == "torchrun" and not dist.is_initialized():
        dist.init_process_group(data_backend(device), timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    if not dist.is_initialized():
        raise RuntimeError("tp_launcher='external' needs a torch.distributed group joined before the engine is built")
    if dist.get_world_size() != world:
        raise ValueError(f"tp_size={world} but the launcher started {dist.get_world_size()} ranks; "
                         f"launch as many processes as tp_size")
    return TPGroups(dist.get_rank(), world, group_timeout(config), data_backend(device))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Local rank r's device: the GPU r places after rank 0's (NCCL needs one GPU per rank)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", ((device.index or 0) + rank) % torch.cuda.device_count())


@dataclass
class PackedModule:
    """A module on its way to a rank process: its tensors on the meta device, their data in one
    flat host buffer per dtype. Pickled tensor by tensor, a model would need one shared-memory
    descriptor each, and the forkserver passes at most 256 (SmolLM2 has 272 tensors)."""

    module: torch.nn.Module
    flat: dict[torch.dtype, torch.Tensor]
    # (module path, attribute, is a parameter, index of the unique tensor)
    entries: list[tuple[str, str, bool, int]]
    # per unique tensor: (dtype, offset, shape)
    tensors: list[tuple[torch.dtype, int, tuple[int, ...]]]

    @classmethod
    def pack(cls, module: torch.nn.Module) -> PackedModule:
        """Consumes `module` (its tensors are replaced by meta ones)."""
        unique: dict[int, int] = {}
        sources: list[torch.Tensor] = []
        entries: list[tuple[str, str, bool, int]] = []
        for path, sub in module.named_modules():
            for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in unique:  # tied weights travel once
                        unique[id(t)] = len(sources)
                        sources.append(t)
                    entries.append((path, name, is_param, unique[id(t)]))
        sizes: dict[torch.dtype, int] = {}
        tensors = []
        for t in sources:
            tensors.append((t.dtype, sizes.get(t.dtype, 0), tuple(t.shape)))
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
        flat = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}
        for t, (dtype, offset, _) in zip(sources, tensors):
            flat[dtype][offset : offset + t.numel()].copy_(t.detach().reshape(-1))
        for path, name, is_param, _ in entries:
            sub = module.get_submodule(path)
            table = sub._parameters if is_param else sub._buffers
            meta = table[name].detach().to("meta")
            table[name] = torch.nn.Parameter(meta, requires_grad=False) if is_param else meta
        return cls(module, flat, entries, tensors)

    def materialize(self, rank: int, world: int, device: torch.device) -> torch.nn.Module:
        return self.unpack().to(device)

    def unpack(self) -> torch.nn.Module:
        views: dict[tuple[int, bool], torch.Tensor] = {}
        for path, name, is_param, index in self.entries:
            if (index, is_param) not in views:
                dtype, offset, shape = self.tensors[index]
                t = self.flat[dtype][offset : offset + math.prod(shape)].view(shape)
                views[index, is_param] = torch.nn.Parameter(t, requires_grad=False) if is_param else t
            sub = self.module.get_submodule(path)
            (sub._parameters if is_param else sub._buffers)[name] = views[index, is_param]
        return self.module


@dataclass(frozen=True)
class CheckpointShard:
    """A rank's shard to be read by the rank itself from the checkpoint rank 0's came from (and
    the GGUF file that checkpoint was dequantized from, if any: quantization='auto' reads it)."""

    folder: str
    dtype: torch.dtype
    gguf: str | None = None

    def materialize(self, rank: int, world: int, device: torch.device) -> torch.nn.Module:
        shard = load_shard(self.folder, rank, world, self.dtype, device)
        if self.gguf is not None:
            setattr(shard, GGUF_SOURCE, self.gguf)
        return shard


def shard_source(model: torch.nn.Module, rank: int, world: int) -> CheckpointShard | PackedModule:
    """How rank `rank` gets its shard of rank 0's `model`: read from the checkpoint when the model
    came from one, else sliced here and handed over in shared memory."""
    spec = shard_spec(model)
    if spec is not None and spec.source is not None:
        return CheckpointShard(spec.source, spec.dtype, getattr(model, GGUF_SOURCE, None))
    return PackedModule.pack(shard_model(model, rank, world))


def worker_main(rank: int, world: int, port: int, packed: CheckpointShard | PackedModule, timeout: float,
                device_name: str, num_threads: int, quantization: tuple[str, bool | None]) -> None:
    """Entry point of a local rank process; `quantization`: the engine's (quantization, batch_invariant)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp-rank{rank} %(name)s: %(message)s")
    torch.set_num_threads(num_threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:  # before saying ready: rank 0 waits for that, bounded by STARTUP_TIMEOUT_S, watching this process
        shard = packed.materialize(rank, world, device)
        quantize_shard(shard, *quantization)
    except Exception:
        logger.exception("tensor-parallel rank %d could not load its shard", rank)
        raise SystemExit(1) from None
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(READY_KEY.format(rank), str(os.getpid()))
    _init_group(store, rank, world, device, STARTUP_TIMEOUT_S, f"127.0.0.1:{port}")
    code = 0
    try:
        groups = TPGroups(rank, world, timeout, data_backend(device))
        follow(shard, groups, device)
    except TensorParallelError:
        code = 1  # logged where raised
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        destroy([None])
    raise SystemExit(code)


class LocalRanks:
    """Ranks 1..N-1 as local processes; rank 0 is the calling process."""

    def __init__(self, model: torch.nn.Module, world: int, timeout: float, device: torch.device,
                 quantization: tuple[str, bool | None] = ("none", False)) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        threads = max(1, torch.get_num_threads() // world)
        self.procs: list[mp.Process] = []
        self._lock = threading.Lock()
        try:
            for rank in range(1, world):
                packed = shard_source(model, rank, world)
                proc = ctx.Process(target=worker_main, name=f"cbserve-tp-rank{rank}", daemon=True,
                                   args=(rank, world, self.store.port, packed, timeout,
                                         str(rank_device(device, rank)), threads, quantization))
                proc.start()
                self.procs.append(proc)
                del packed
            self._wait_ready()
        except BaseException:
            self.stop(grace=0.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = set(range(1, self.world))
        while pending:
            for rank in sorted(pending):
                proc = self.procs[rank - 1]
                if self.store.check([READY_KEY.format(rank)]):
                    pending.discard(rank)
                elif not proc.is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} died while starting "
                                              f"(exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks {sorted(pending)} did not start within "
                                          f"{STARTUP_TIMEOUT_S:g}s")
            if pending:
                time.sleep(0.05)

    def init_group(self, device: torch.device) -> None:
        _init_group(self.store, 0, self.world, device, STARTUP_TIMEOUT_S, f"127.0.0.1:{self.store.port}")

    def report(self) -> str:
        """What became of each rank's process, for error messages."""
        states = []
        # A peer whose socket just reset is usually exiting: give it a moment to be reaped, so
        # the message names its fate (killed by a signal, exit code) rather than "alive".
        deadline = time.monotonic() + REPORT_GRACE_S
        for rank, proc in enumerate(self.procs, start=1):
            proc.join(max(0.0, deadline - time.monotonic()))
            code = proc.exitcode
            if code is None:
                states.append(f"rank {rank} (pid {proc.pid}) alive")
            elif code < 0:
                states.append(f"rank {rank} (pid {proc.pid}) killed by {signal.Signals(-code).name}")
            else:
                states.append(f"rank {rank} (pid {proc.pid}) exited with code {code}")
        return ", ".join(states)

    def stop(self, grace: float) -> None:
        """Wait up to `grace` seconds for the ranks to exit (they were told to), then kill the
        rest: after a failure (grace 0) a hung rank would never exit, and a stopped one would
        not even see SIGTERM."""
        with self._lock:
            deadline = time.monotonic() + grace
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self.procs:
                if proc.is_alive():
                    if grace > 0:
                        logger.warning("killing tensor-parallel process %s (pid %s): it did not exit within %gs",
                                       proc.name, proc.pid, grace)
                    proc.kill()
            for proc in self.procs:
                proc.join()


def serve_tensor_parallel_rank(model: torch.nn.Module, config: ContinuousBatchingConfig) -> object:
    """Ranks > 0 under ``torchrun`` or an ``external`` launcher: follow rank 0's engine until it
    shuts down; returns what rank 0 sent with the shutdown (the outputs, for `generate_batch`)."""
    check_parallel_config(model, config)
    device = next(model.parameters()).device
    groups = join_launched_group(config, device)
    if groups.rank == 0:
        raise RuntimeError("rank 0 runs the engine (a manager or generate_batch), not serve_tensor_parallel_rank")
    if is_shard(model) and shard_spec(model).rank != groups.rank:
        raise ValueError(f"rank {groups.rank} was given shard {shard_spec(model).rank}; load shard {groups.rank}")
    try:
        shard = model if is_shard(model) else shard_model(model, groups.rank, config.tp_size)
        quantize_shard(shard, config.quantization, config.batch_invariant)
        return follow(shard, groups, device)
    finally:
        destroy([groups.data, groups.control, groups.health])
