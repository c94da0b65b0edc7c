"""The ranks > 0 of a tensor-parallel engine: the loop each one runs (take rank 0's step plan,
run its shard's forward, whose all-reduces meet rank 0's), and their launch, either as local
processes started by rank 0 or by an external launcher such as `torchrun`.

Local ranks are forked from a forkserver that has imported torch and transformers once, so
an engine after the first starts in a second or two instead of re-importing everything.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cbserve.kernels import paged_attention
from cbserve.workers.kv_cache import PagedKVCache
from cbserve.workers.tensor_parallel import install_all_reduce, shard_model
from cbserve.workers.tp_comm import TensorParallelError, TPGroups, destroy, unpack

logger = logging.getLogger(__name__)

# Joining the group waits for every rank to import torch and transformers: on a loaded machine
# that takes far longer than a collective may, so start-up has its own bound.
STARTUP_TIMEOUT_S = 600.0
REPORT_GRACE_S = 1.0  # how long a failure report waits for a dying rank's exit status
READY_KEY = "cbserve_tp/ready/{}"
PRELOAD = ["torch", "torch.distributed", "transformers", "cbserve.workers.tp_worker"]


def data_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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


def follow(shard: torch.nn.Module, groups: TPGroups, device: torch.device) -> Any:
    """Rank > 0: run every step rank 0 broadcasts until it shuts down; returns the shutdown
    message's payload. Raises TensorParallelError when rank 0 or a peer fails."""
    from cbserve.workers.engine import ModelShape  # engine imports are heavy; the forkserver has them

    paged_attention.register()
    shard.set_attn_implementation(paged_attention.ATTENTION_NAME)
    install_all_reduce(shard, groups.data)
    decoder = shard.get_decoder()  # the LM head is replicated: only rank 0 needs logits
    shape = ModelShape.from_model(shard)
    dtype = next(shard.parameters()).dtype
    cache: PagedKVCache | None = None
    while True:
        message = groups.recv()
        if message.kind == "step":
            plan = unpack(message.payload, device)
            plan["cb_meta"] = dataclasses.replace(plan["cb_meta"], k_caches=cache.k, v_caches=cache.v)
            try:
                with torch.inference_mode():
                    decoder(**plan)
            except TensorParallelError:
                raise
            except Exception as error:
                raise groups.fail("running its forward pass", error) from error
        elif message.kind == "setup":
            cache = PagedKVCache(shape.num_layers, message.payload["num_blocks"], message.payload["page_size"],
                                 shape.num_kv_heads, shape.head_dim, dtype, device)
            logger.info("rank %d: KV cache of %.1f MiB", groups.rank, cache.nbytes / 2**20)
        elif message.kind == "shutdown":
            return message.payload
        else:  # ping, stop, hard_stop: nothing is in flight on this rank between steps
            logger.debug("rank %d: %s", groups.rank, message.kind)


def worker_main(rank: int, world: int, port: int, packed: PackedModule, timeout: float,
                device_name: str, num_threads: int) -> None:
    """Entry point of a local rank process."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp-rank{rank} %(name)s: %(message)s")
    torch.set_num_threads(num_threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(READY_KEY.format(rank), str(os.getpid()))
    dist.init_process_group(data_backend(device), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    code = 0
    try:
        groups = TPGroups(rank, world, timeout, data_backend(device))
        follow(packed.unpack().to(device), groups, device)
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

    def __init__(self, model: torch.nn.Module, world: int, timeout: float, device: torch.device) -> None:
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
                packed = PackedModule.pack(shard_model(model, rank, world))
                proc = ctx.Process(target=worker_main, name=f"cbserve-tp-rank{rank}", daemon=True,
                                   args=(rank, world, self.store.port, packed, timeout,
                                         str(rank_device(device, rank)), threads))
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
        dist.init_process_group(data_backend(device), store=self.store, rank=0, world_size=self.world,
                                timeout=timedelta(seconds=STARTUP_TIMEOUT_S))

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
