"""The ingress inside the engine replica: one Serve replica that answers HTTP and gRPC and runs
the model (`ClusterArgs.ingress_placement`; by default whenever the worker deployment has one
replica, so there is nothing to route).

    Serve's proxy  --ASGI messages-->  LLMWorker replica: OpenAIIngress routes + EngineReplica

Compared with an ingress deployment of its own, a token crosses one process hop instead of two,
and no `WorkerEvent` is pickled: the ingress's code runs unchanged against `LocalReplicas`, an
in-process stand-in for its `DeploymentHandle` to the engine replicas. That stand-in keeps what
the handle and Serve gave the separate ingress: a choice beyond `max_ongoing_requests` waits, one
beyond `max_queued_requests` more is refused at once with `BackPressureError` (so the client gets
the same 503 + Retry-After in OpenAI's shape), and cancelling a choice cancels its engine request.
Routes other than generation (`/health`, `/metrics`, ...) are never held back by that limit.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cbserve.cluster.engine_replica import EngineReplica
from cbserve.cluster.ingress import OpenAIIngress
from cbserve.cluster.settings import ClusterArgs, WorkerConfig
from cbserve.serving.protocol import WorkerEvent, WorkerRequest

logger = logging.getLogger(__name__)

# Serve's own limit on the replica's concurrent HTTP calls is the choices' limit plus this many,
# so that health checks, metrics and models are answered even when generation is full.
OTHER_ROUTES_HEADROOM = 100


class Admission:
    """Serve's admission of one replica, for choices: `max_ongoing` run at once, `max_queued`
    more wait (-1: any number), the rest are refused."""

    def __init__(self, worker: WorkerConfig):
        self._w = worker
        self._slots = asyncio.Semaphore(worker.max_ongoing_requests)
        self.waiting = 0

    def check(self) -> None:
        """Refuse now (`BackPressureError`) when every slot is taken and the queue is full."""
        w = self._w
        if self._slots.locked() and 0 <= w.max_queued_requests <= self.waiting:
            raise BackPressureError(self.waiting, w.max_queued_requests, w.overload_status_code, w.retry_after_s)

    async def enter(self) -> None:
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self._slots.release()


class LocalStream:
    """A streaming call to the engine in this process, as `DeploymentResponseGenerator` is one to
    a replica: async-iterable, `cancel()` cancels the request. Holds an admission slot from its
    first item until it ends, is closed or cancelled."""

    def __init__(self, events: AsyncIterator[WorkerEvent], admission: Admission, cancel: Callable[[], None]):
        self._events = events
        self._admission = admission
        self._cancel = cancel
        self._state = "new"  # -> "running" (holds a slot) -> "done"

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> WorkerEvent:
        if self._state == "new":
            await self._admission.enter()
            self._state = "running"
        if self._state == "done":
            raise StopAsyncIteration
        try:
            return await self._events.__anext__()
        except BaseException:  # the end, an error, or the caller cancelled: the slot goes back
            self._finish()
            raise

    def _finish(self) -> None:
        if self._state == "running":
            self._admission.leave()
        self._state = "done"

    def cancel(self) -> None:
        self._cancel()
        running = getattr(self._events, "ag_running", False)
        self._finish()
        if not running:  # else whoever is iterating it sees the abort and ends
            asyncio.ensure_future(self._events.aclose())


class _LocalMethod:
    def __init__(self, replicas: LocalReplicas, name: str, stream: bool):
        self._replicas, self._name, self._stream = replicas, name, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._replicas.engine
        if self._stream:
            return self._replicas.open_stream(self._name, *args, **kwargs)
        return _call(getattr(engine, self._name), args, kwargs)


async def _call(method: Any, args: tuple, kwargs: dict) -> Any:
    result = method(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


class LocalReplicas:
    """What `OpenAIIngress` uses of its `DeploymentHandle` (`options(stream=True,
    method_name=...)`, `<method>.remote(...)`), served by the engine replica in this process."""

    def __init__(self, engine: EngineReplica, worker: WorkerConfig):
        self.engine = engine
        self.admission = Admission(worker)

    def options(self, stream: bool = False, method_name: str = "__call__", **_: Any) -> _LocalMethod:
        return _LocalMethod(self, method_name, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _LocalMethod(self, name, stream=False)

    def open_stream(self, name: str, req: WorkerRequest, *args: Any, **kwargs: Any) -> LocalStream:
        self.admission.check()
        events = getattr(self.engine, name)(req, *args, **kwargs)
        manager = self.engine.manager
        return LocalStream(events, self.admission, lambda: manager and manager.cancel_request(req.request_id))


class IngressWorker(OpenAIIngress):
    """The `LLMWorker` deployment with the ingress inside: HTTP/gRPC routes of `OpenAIIngress`,
    and the `EngineReplica` methods that handles, Serve's controller and the batch job call."""

    async def __init__(self, args: ClusterArgs, board: DeploymentHandle | None = None):
        # On Serve's main loop (`settings.MODEL_REPLICA_ENV`): the model loads in a worker thread.
        self.engine = await asyncio.to_thread(EngineReplica, args, board)
        await super().__init__(LocalReplicas(self.engine, args.worker), board, args)

    async def generate(self, req: WorkerRequest) -> AsyncIterator[WorkerEvent]:
        async for ev in self.engine.generate(req):
            yield ev

    def end_streams(self) -> int:
        return self.engine.end_streams()

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    def ping(self) -> str:
        return self.engine.ping()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def record_routing_stats(self) -> dict[str, Any]:
        return await self.engine.record_routing_stats()

    def check_health(self) -> None:
        self.engine.check_health()

    def __getattr__(self, name: str) -> Any:
        """Any other public method of the engine replica (`record_autoscaling_stats`, ...)."""
        engine = self.__dict__.get("engine")
        if name.startswith("_") or engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    async def __del__(self) -> None:
        await super().__del__()
        engine = getattr(self, "engine", None)
        if engine is not None:  # in a worker thread: the loop streams the last events meanwhile
            await asyncio.to_thread(engine.__del__)
