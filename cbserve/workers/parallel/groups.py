"""The process groups of a tensor-parallel engine and the control channel between its ranks.

- `data`: the all-reduces inside the forward pass (NCCL on GPUs, gloo on CPUs).
- `control`: a CPU (gloo) group on which rank 0 broadcasts every message to the other ranks:
  each step, heartbeats while idle, setup and shutdown. Every message is one broadcast of a
  fixed-size int64 tensor (`CAPACITY` slots) whose header states its kind, its length and its
  sequence number; a step's integer inputs fill the rest (`step_codec.py`), a longer step sends
  its remainder in a second broadcast, and only setup and shutdown follow with a pickled object.
  Nothing is pickled per step, and no accelerator tensor is copied back to the host.
- `health`: a CPU group used only after a failure, for a monitored barrier that names the ranks
  that did not answer (its connections are untouched by the failed collective).

Every collective is bounded by `timeout` (the engine's `cpu_group_timeout`): a dead or hung
peer makes the others raise `TensorParallelError` within that time instead of waiting forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cbserve.errors import EngineFault

logger = logging.getLogger(__name__)

# How long ranks wait for each other at the monitored barrier after a failure.
HEALTH_BARRIER_S = 2.0
# Joining the group waits for every rank to import torch and transformers: on a loaded machine
# that takes far longer than a collective may, so start-up has its own bound.
STARTUP_TIMEOUT_S = 600.0
NO_TIMEOUT_S = 1800.0  # cpu_group_timeout=None: torch's own default for gloo

# The control channel's messages: int64 tensors of CAPACITY slots, HEADER of them a header.
CAPACITY = 8192  # 64 KiB: a decode step of hundreds of requests; longer steps take two broadcasts
HEADER = 16
KIND, LENGTH, SEQUENCE = 0, 1, 2  # header slots of the channel; the rest belong to the message
PICKLED = HEADER - 1  # slot saying a pickled object follows (kinds other than "step")
KINDS = ("ping", "step", "setup", "shutdown", "lora")  # lora: adapters for the next step (lora_slots.py)


def data_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelError(EngineFault):
    """A rank died, hung, or could not be reached."""

    public = "the tensor-parallel group of the replica serving this request failed"


@dataclass
class Message:
    kind: str  # "ping" | "step" | "setup" | "shutdown"
    # A step: its int64 tensor (`step_codec`); other kinds: any picklable object, or None.
    payload: Any = None


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
        # Rank 0's message buffers, in turn: a step's broadcast completes while rank 0 runs its own
        # forward pass (the first all-reduce waits for the other ranks anyway); before a buffer is
        # filled again, the broadcast that read it two messages ago is waited for.
        self._out = [torch.zeros(CAPACITY, dtype=torch.int64) for _ in range(2)]
        self._sent: list[tuple[Any, str] | None] = [None, None]
        self._turn = 0
        self._in = torch.zeros(CAPACITY, dtype=torch.int64)  # the others'
        self.sequence = 0  # of the last message sent or received
        self.last_send = time.monotonic()
        self.failed: TensorParallelError | None = None
        # Rank 0 launching the ranks itself can say what became of their processes.
        self.peer_report: Callable[[], str] | None = None

    # -- the control channel -----------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Rank 0: broadcast one message to every rank (returns before it has left, see `_out`)."""
        with self._send_lock:
            if self.failed is not None:
                raise self.failed
            self.sequence += 1
            doing = f"sending {message.kind} message {self.sequence} to the other ranks"
            if message.kind == "step":
                flat, pickled = message.payload, False
            else:
                flat, pickled = torch.zeros(HEADER, dtype=torch.int64), message.payload is not None
                flat[PICKLED] = int(pickled)
            flat[KIND], flat[LENGTH], flat[SEQUENCE] = KINDS.index(message.kind), flat.numel(), self.sequence
            head = min(flat.numel(), CAPACITY)
            turn, self._turn = self._turn, self._turn ^ 1
            self._wait_sent(turn)  # the broadcast that last read this buffer is done
            self._out[turn][:head] = flat[:head]
            self._sent[turn] = (self._broadcast(self._out[turn], doing, async_op=True), doing)
            if flat.numel() > CAPACITY or pickled:  # rare: setup, shutdown, very long steps
                self._wait_sent(turn)
                if flat.numel() > CAPACITY:
                    self._broadcast(flat[CAPACITY:], doing + " (its remainder)")
                if pickled:
                    self._broadcast_object(message.payload, doing + " (its payload)")
            self.last_send = time.monotonic()

    def _wait_sent(self, turn: int) -> None:
        """Wait (bounded by the timeout) until buffer `turn`'s broadcast has left rank 0."""
        sent, self._sent[turn] = self._sent[turn], None
        if sent is not None:
            work, doing = sent
            try:
                work.wait(timedelta(seconds=self.timeout))
            except Exception as error:
                raise self.fail(doing, error) from error

    def flush(self) -> None:
        """Rank 0: wait until every message sent has left (before tearing the groups down)."""
        with self._send_lock:
            for turn in (0, 1):
                self._wait_sent(turn)

    def recv(self) -> Message:
        """Ranks > 0: the next message from rank 0. A step's payload is a view of a buffer the
        next call reuses."""
        expected = self.sequence + 1
        doing = f"waiting for rank 0's message {expected}"
        self._broadcast(self._in, doing)
        kind, length, sequence = self._in[:3].tolist()
        if sequence != expected or not 0 <= kind < len(KINDS):
            raise self.fail(doing, RuntimeError(f"got message {sequence} of kind {kind}: the ranks are out of step"))
        self.sequence = sequence
        flat = self._in[:length]
        if length > CAPACITY:
            flat = torch.cat([self._in, torch.empty(length - CAPACITY, dtype=torch.int64)])
            self._broadcast(flat[CAPACITY:], f"receiving the remainder of rank 0's message {sequence}")
        if KINDS[kind] == "step":
            return Message("step", flat)
        payload = None
        if flat[PICKLED]:
            payload = self._broadcast_object(None, f"receiving the payload of rank 0's message {sequence}")
        return Message(KINDS[kind], payload)

    def _broadcast(self, tensor: torch.Tensor, doing: str, async_op: bool = False) -> Any:
        try:
            return dist.broadcast(tensor, src=0, group=self.control, async_op=async_op)
        except Exception as error:
            raise self.fail(doing, error) from error

    def _broadcast_object(self, obj: Any, doing: str) -> Any:
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as error:
            raise self.fail(doing, error) from error
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
