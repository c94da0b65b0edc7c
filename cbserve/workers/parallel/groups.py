"""The process groups of a tensor-parallel engine and the control channel between its ranks.

- `data`: the all-reduces inside the forward pass (NCCL on GPUs, gloo on CPUs).
- `control`: a CPU (gloo) group on which rank 0 broadcasts every message to the other ranks:
  each step's plan, heartbeats while idle, shutdown.
- `health`: a CPU group used only after a failure, for a monitored barrier that names the ranks
  that did not answer (its connections are untouched by the failed collective).

Every collective is bounded by `timeout` (the engine's `cpu_group_timeout`): a dead or hung
peer makes the others raise `TensorParallelError` within that time instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long ranks wait for each other at the monitored barrier after a failure.
HEALTH_BARRIER_S = 2.0
# Joining the group waits for every rank to import torch and transformers: on a loaded machine
# that takes far longer than a collective may, so start-up has its own bound.
STARTUP_TIMEOUT_S = 600.0
NO_TIMEOUT_S = 1800.0  # cpu_group_timeout=None: torch's own default for gloo


def data_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelError(RuntimeError):
    """A rank died, hung, or could not be reached."""


@dataclass
class Message:
    kind: str  # "setup" | "step" | "ping" | "shutdown"
    payload: Any = None


@dataclass
class OnDevice:
    """A tensor that lived on the accelerator on rank 0: each rank puts it on its own device."""

    tensor: torch.Tensor


def pack(obj: Any) -> Any:
    """A picklable copy of a step plan: tensors on CPU, accelerator ones marked `OnDevice`."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else OnDevice(obj.cpu())
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: pack(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def unpack(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, OnDevice):
        return obj.tensor.to(device)
    if isinstance(obj, dict):
        return {k: unpack(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: unpack(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


class TPGroups:
    """The three groups; every rank must build them in the same order, after
    `init_process_group`."""

    def __init__(self, rank: int, world: int, timeout: float, data_backend: str) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        td = timedelta(seconds=timeout)
        self.data = dist.new_group(backend=data_backend, timeout=td)
        self.control = dist.new_group(backend="gloo", timeout=td)
        self.health = dist.new_group(backend="gloo", timeout=td)
        # Rank 0 sends from the engine's loop thread and from the heartbeat thread.
        self._send_lock = threading.Lock()
        self.last_send = time.monotonic()
        self.failed: TensorParallelError | None = None
        # Rank 0 launching the ranks itself can say what became of their processes.
        self.peer_report: Callable[[], str] | None = None

    # -- the control channel -----------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Rank 0: broadcast one message to every rank."""
        with self._send_lock:
            if self.failed is not None:
                raise self.failed
            try:
                dist.broadcast_object_list([message], src=0, group=self.control)
            except Exception as error:
                raise self.fail(f"sending {message.kind!r} to the other ranks", error) from error
            self.last_send = time.monotonic()

    def recv(self) -> Message:
        """Ranks > 0: the next message from rank 0."""
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as error:
            raise self.fail("waiting for rank 0's next message", error) from error
        return box[0]

    # -- failures ----------------------------------------------------------------------------

    def fail(self, doing: str, error: BaseException) -> TensorParallelError:
        """The error to raise after a collective failed: which ranks answer no more (by a
        monitored barrier on the health group) and what this rank was doing."""
        if self.failed is not None:
            return self.failed
        try:
            culprits = self.unresponsive_ranks()
        except Exception as check_error:  # noqa: BLE001 - the diagnosis must not hide the failure
            culprits = f"the health check failed too ({check_error!r:.120})"
        if self.peer_report is not None:
            culprits = f"{culprits}; {self.peer_report()}"
        self.failed = TensorParallelError(
            f"tensor-parallel group failed while rank {self.rank} was {doing}: {culprits}; "
            f"cpu_group_timeout={self.timeout:g}s ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        )
        logger.error("%s", self.failed)
        return self.failed

    def unresponsive_ranks(self) -> str:
        """A health check on its own group (whose connections the failed collective did not
        break): every rank > 0 sends rank 0 a token. Rank 0 learns which ranks are dead or
        stuck, the others whether rank 0 is there; each waits at most HEALTH_BARRIER_S."""
        limit = min(HEALTH_BARRIER_S, self.timeout)
        token = torch.zeros(1)
        if self.rank != 0:
            try:
                dist.isend(token, dst=0, group=self.health).wait(timedelta(seconds=limit))
            except Exception as error:  # noqa: BLE001 - any failure is the answer
                return f"no answer from rank 0 within {limit:g}s ({str(error).splitlines()[0][:120]})"
            return "rank 0 answered the health check"
        deadline = time.monotonic() + limit
        works, silent = {}, []
        for r in range(1, self.world):
            try:  # a dead peer's closed connection may raise here already
                works[r] = dist.irecv(torch.zeros(1), src=r, group=self.health)
            except Exception:  # noqa: BLE001 - any failure is the answer
                silent.append(r)
        for r, work in works.items():
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
            except Exception:  # noqa: BLE001 - any failure is the answer
                silent.append(r)
        if not silent:
            return "every rank answered the health check (the failure was local or transient)"
        return f"no answer from rank {', '.join(map(str, sorted(silent)))} within {limit:g}s"


def destroy(groups: list[dist.ProcessGroup | None]) -> None:
    """Tear groups down (None: the default group); a failed group may refuse, which is fine
    as its ranks are gone."""
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except Exception as error:  # noqa: BLE001 - teardown after a failure
            logger.debug("destroying a process group failed: %r", error)
