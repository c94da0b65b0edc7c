"""Where a batch job's requests run: a pool of engine actors started by the job, or a running Serve app.

Both run a request through the same path as a Serve engine replica (`EngineReplica.generate`:
tokenize, submit to the manager, detokenize, stop strings) and fold its `WorkerEvent`s into a
`ChoiceResult` (`cbserve.serving.front.replies.fold`, the fold every front uses):

- `EnginePool`: `replicas` Ray actors, each owning an `EngineReplica` (one model and one
  continuous-batching manager); a request goes to the actor with the fewest in flight and its
  events are folded inside the actor, so one Ray call carries one whole result.
- `ServeBackend`: the engine replicas (`LLMWorker` deployment) of a running Serve app, through a
  deployment handle (`handle.options(stream=True).generate`); Serve's request router (prefix
  affinity, least outstanding requests) picks the replica; a line whose replica fails mid-way is
  continued on another one (stream migration), not started over. An `EnginePool` actor folds its
  lines inside itself: a line it loses is run again from the start (the job's retries).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from cbserve.cluster.migration import MigratingChoice
from cbserve.cluster.settings import MODEL_PROCESS_ENV, ClusterArgs, MigrationConfig, runtime_env
from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import error_event
from cbserve.serving.front.replies import ChoiceResult, fold
from cbserve.serving.protocol import WorkerEvent, WorkerRequest

logger = logging.getLogger(__name__)


class RetryableError(Exception):
    """The request may succeed if sent again (a replica died, was draining, or was unreachable)."""


class Backend(Protocol):
    has_chat_template: bool
    default_concurrency: int
    engines: list[dict[str, Any]]  # what `start` found, for the summary

    async def start(self) -> None: ...

    async def run(self, req: WorkerRequest) -> ChoiceResult: ...

    async def close(self) -> None: ...


def _task_failure(where: str, exc: Exception) -> Exception:
    """What a failed remote call means to the line: the `InvalidRequestError` that the remote code
    raised (a `RayTaskError` carries it as its `cause`) is the line's refusal; anything else may
    pass on another try, and names the remote exception rather than Ray's traceback."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, InvalidRequestError):
        return InvalidRequestError(cause.field, cause.message)
    return RetryableError(f"{where} failed: {type(cause).__name__}: {cause}")


# -- mode 1: engine actors started by the job ----------------------------------------------------


class EngineActor:
    """A Ray actor (made one in `EnginePool.start`) owning one `EngineReplica`."""

    def __init__(self, args: ClusterArgs):
        from cbserve.cluster.engine_replica import EngineReplica

        self._replica = EngineReplica(args)

    def info(self) -> dict[str, Any]:
        return self._replica.describe()

    def stats(self) -> dict[str, Any]:
        return self._replica.stats()

    async def run(self, req: WorkerRequest) -> ChoiceResult:
        try:
            return await self._run(req)
        except InvalidRequestError as exc:  # sent back as a 400 result: the exception does not unpickle
            return ChoiceResult(error=error_event(400, exc.message, exc.field))

    async def _run(self, req: WorkerRequest) -> ChoiceResult:
        return await fold(self._replica.generate(req))


class EnginePool:
    """`replicas` engine actors; with `tp_size > 1`, each in a placement group of `tp_size` bundles
    on one node (STRICT_PACK), like a Serve engine replica: the actor is rank 0 in bundle 0 and
    starts the other ranks in the other bundles (`cluster/tp_ranks.py`)."""

    def __init__(
        self,
        args: ClusterArgs,
        replicas: int,
        tp_size: int,
        cpus_per_rank: float,
        gpus_per_rank: float,
        per_replica_concurrency: int = 64,
        actor_cls: type[EngineActor] = EngineActor,
    ):
        self._args = args
        self._actor_cls = actor_cls
        self._replicas = replicas
        self._tp_size = tp_size
        self._resources = {"CPU": cpus_per_rank, "GPU": gpus_per_rank}
        self.default_concurrency = per_replica_concurrency * replicas
        self.has_chat_template = False
        self.engines: list[dict[str, Any]] = []
        self._actors: list[Any] = []
        self._groups: list[Any] = []
        self._in_flight: list[int] = []

    def _warn_if_short(self) -> None:
        import ray

        have = ray.cluster_resources()
        for name, per_rank in self._resources.items():
            need = per_rank * self._tp_size * self._replicas
            if need > have.get(name, 0.0):
                logger.warning(
                    "the engines need %g %s in all and the cluster has %g now: they wait for more",
                    need,
                    name,
                    have.get(name, 0.0),
                )

    def _new_actor(self) -> Any:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(self._actor_cls)
        options: dict[str, Any] = {
            "num_cpus": self._resources["CPU"],
            "num_gpus": self._resources["GPU"],
            "max_restarts": 1,
            "runtime_env": runtime_env(MODEL_PROCESS_ENV),
        }
        if self._tp_size > 1:
            bundle = {k: v for k, v in self._resources.items() if v > 0} or {"CPU": 0.001}
            group = placement_group([dict(bundle) for _ in range(self._tp_size)], strategy="STRICT_PACK")
            self._groups.append(group)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=0
            )
        return cls.options(**options).remote(self._args)

    async def start(self) -> None:
        from ray.exceptions import RayActorError

        self._warn_if_short()
        logger.info(
            "starting %d engine actor(s): %d rank(s) each, %s per rank",
            self._replicas,
            self._tp_size,
            self._resources,
        )
        self._actors = [self._new_actor() for _ in range(self._replicas)]
        self._in_flight = [0] * self._replicas
        try:
            infos = await asyncio.gather(*(a.info.remote() for a in self._actors))
        except RayActorError as exc:  # the constructor raised: a bad model path, engine config, ...
            raise RuntimeError(f"the engine actors could not start: {exc}") from exc
        self.has_chat_template = bool(infos[0]["has_chat_template"])
        self.engines = list(infos)

    async def run(self, req: WorkerRequest) -> ChoiceResult:
        from ray.exceptions import RayActorError, RayTaskError

        i = min(range(len(self._actors)), key=self._in_flight.__getitem__)
        self._in_flight[i] += 1
        try:
            return await self._actors[i].run.remote(req)
        except RayActorError as exc:  # died (restarting) or unreachable
            raise RetryableError(f"engine actor {i} failed: {type(exc).__name__}") from exc
        except RayTaskError as exc:  # alive, but its code raised for this request
            raise _task_failure(f"engine actor {i}", exc) from exc
        finally:
            self._in_flight[i] -= 1

    async def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:  # its other ranks are its own actors: they go with it
            ray.kill(actor)
        for group in self._groups:
            remove_placement_group(group)
        self._actors, self._groups = [], []


# -- mode 2: a running Serve app ------------------------------------------------------------------


class ServeBackend:
    def __init__(self, app_name: str, concurrency: int = 64):
        self._app = app_name
        self.default_concurrency = concurrency
        self.has_chat_template = False
        self.engines: list[dict[str, Any]] = []
        self._stream: Any = None

    def _check_app(self) -> None:
        from ray import serve
        from ray.serve.exceptions import RayServeException
        from ray.serve.schema import ApplicationStatus

        from cbserve.cluster.engine_replica import DEPLOYMENT_NAME

        try:
            apps = serve.status().applications
        except RayServeException as exc:
            raise RuntimeError(f"--serve-app: Serve is not running on this Ray cluster: {exc}") from exc
        if self._app not in apps:
            raise RuntimeError(
                f"--serve-app: no Serve application named {self._app!r} is running "
                f"(running: {sorted(apps) or 'none'})"
            )
        app = apps[self._app]
        if DEPLOYMENT_NAME not in app.deployments:
            raise RuntimeError(
                f"--serve-app: application {self._app!r} has no {DEPLOYMENT_NAME} deployment "
                f"(it has {sorted(app.deployments)}); is it a cbserve app?"
            )
        if app.status != ApplicationStatus.RUNNING:
            logger.warning("Serve application %r is %s; requests wait for its workers", self._app, app.status)

    async def start(self) -> None:
        from ray import serve

        from cbserve.cluster.engine_replica import DEPLOYMENT_NAME

        self._check_app()
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=self._app)
        self._stream = handle.options(stream=True, method_name="generate")
        try:
            described = await handle.describe.remote()
        except Exception as exc:
            raise RuntimeError(f"Serve application {self._app!r} did not answer: {exc}") from exc
        self.has_chat_template = bool(described["has_chat_template"])
        self.engines = [{"serve_app": self._app, "has_chat_template": self.has_chat_template}]
        logger.info(
            "sending requests to Serve application %r (chat template: %s)", self._app, self.has_chat_template
        )

    async def run(self, req: WorkerRequest) -> ChoiceResult:
        """The line's result; a replica that fails or drains mid-line hands it to another one,
        which continues it (stream migration, `cluster/migration.py`) instead of starting over."""
        try:
            first, gen = await self._open(req)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # backpressure, the deployment is unavailable...
            raise _task_failure("Serve call", exc) from exc
        result = ChoiceResult()
        result.add(first)
        if first.kind == "error":
            return result
        choice = MigratingChoice(req, first, gen, self._open, MigrationConfig().max_attempts)
        return await fold(choice.events(), result)

    async def _open(self, req: WorkerRequest) -> tuple[WorkerEvent, Any]:
        gen = self._stream.remote(req)
        return await gen.__anext__(), gen

    async def close(self) -> None:
        self._stream = None
