"""The engine replica: each replica of the `LLMWorker` deployment owns one model and one
continuous-batching manager. The batch job's engine actors own one too (`cbserve/batch`).

With `tp_size > 1` the replica is rank 0 of a tensor-parallel group whose other ranks are Ray
actors in the replica's placement group (`tp_ranks.py`).

`generate` is a streaming method (called with `handle.options(stream=True)`); when the caller
cancels the call (client gone, timeout), the request is cancelled in the engine and its KV pages
are freed. On scale-down Serve stops routing to the replica, waits for its ongoing requests
(`graceful_shutdown_timeout_s`), then calls `__del__`, which stops the manager within
`teardown_timeout_s` (Serve's kill comes after both: `app.shutdown_budget_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cbserve.cluster.adapters import ReplicaAdapters
from cbserve.cluster.autoscaling import KV_USAGE, RUNNING, WAITING
from cbserve.cluster.offload import offload_settings
from cbserve.cluster.settings import ClusterArgs, cpus_per_rank, torch_threads, with_cpus
from cbserve.cluster.tp_ranks import RankGroup, load_on_device
from cbserve.config import ContinuousBatchingConfig, with_fields
from cbserve.errors import InvalidRequestError
from cbserve.serving import tokenization
from cbserve.serving.api_errors import ABORTED, APIError, error_event
from cbserve.serving.constraints import Grammars
from cbserve.serving.front.metrics import kv_usage
from cbserve.serving.protocol import WorkerEvent, WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, manager_generation_config, run_request

logger = logging.getLogger(__name__)

# The deployment's name, as `serve status`, handles and the batch job's `--serve-app` see it.
DEPLOYMENT_NAME = "LLMWorker"
STOPPING = f"the server is stopping: {ABORTED}"
TEARDOWN_SHARE_STOP = 0.5  # of teardown_timeout_s for the manager's last requests; the rest reaps TP ranks


def eos_ids(model: Any, tokenizer: Any) -> int | list[int] | None:
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    return eos if eos is not None else getattr(tokenizer, "eos_token_id", None)


def max_replicas(args: ClusterArgs) -> int:
    auto = args.worker.autoscaling
    return int(auto.get("max_replicas", 1)) if auto else args.worker.num_replicas


def per_replica_resources(args: ClusterArgs) -> dict[str, float]:
    w = args.worker
    return {"CPU": cpus_per_rank(args) * args.tp_size, "GPU": w.num_gpus * args.tp_size}


def engine_config(args: ClusterArgs) -> ContinuousBatchingConfig:
    """The engine config of one replica: `args.engine` with what the cluster sets."""
    tp = args.tp_size
    fields: dict[str, Any] = {"per_request_processors": True, "return_logprobs": True, "tp_size": tp}
    fields.update(offload_settings(args.cpu_offload, per_replica_resources(args), max_replicas(args)))
    if tp > 1:  # the replica and its rank actors join their group themselves (`tp_ranks.py`)
        fields["tp_launcher"] = "external"
    return with_fields(args.engine, **fields)


def _budget_threads(args: ClusterArgs) -> None:
    """On a CPU node the model's torch threads are the CPUs this replica was given (Ray sets
    OMP_NUM_THREADS to a whole number, 1 for a part-CPU); a GPU node's CPUs only feed the GPU."""
    if args.worker.num_gpus > 0:
        return
    import torch

    threads = torch_threads(args)
    if torch.get_num_threads() != threads:
        logger.info("torch threads: %d -> %d (worker.num_cpus %g)", torch.get_num_threads(), threads,
                    args.worker.num_cpus)
        torch.set_num_threads(threads)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - constructed outside Serve (tests, batch engine actors)
        return "local"


class EngineReplica:
    """One model and its manager; served as `EngineDeployment` (or inside `IngressWorker`)."""

    def __init__(self, args: ClusterArgs, board: DeploymentHandle | None = None):
        import cbserve

        self.args = with_cpus(args)  # build_app gave a number; else this node's CPUs
        self._board = board
        self.ranks: RankGroup | None = None
        self.replica = _replica_id()
        self.stopping = False  # end_streams() was called: the server is going away
        self._streams: set[str] = set()  # request ids of the streams running here
        engine = engine_config(self.args)
        self.offload_gib = engine.cpu_offload_space
        self.node_kv_pool = engine.node_kv_pool
        _budget_threads(self.args)
        if self.args.tp_size > 1:  # the other ranks load their copy while this one does
            w = self.args.worker
            self.ranks = RankGroup(self.args.model, self.args.dtype, self.args.tp_size, engine, w.num_cpus,
                                   w.num_gpus, name=None if self.replica == "local" else f"cbserve-{self.replica}")
        model, self.tokenizer = load_on_device(self.args.model, self.args.dtype, 0, self.args.tp_size)
        if self.ranks is not None:
            self.ranks.join()
        eos = eos_ids(model, self.tokenizer)
        self.manager = cbserve.init_continuous_batching(
            model,
            # The model's sampling defaults for what a request leaves out (every request names its
            # max_new_tokens: that default is unused).
            generation_config=manager_generation_config(model, eos),
            continuous_batching_config=engine,
        )
        self.adapters = ReplicaAdapters(self.manager, self.args.host_loras)
        for name, path in self.args.lora_modules.items():  # held by every replica from the start
            self.adapters.adopt(name, path)
        self.manager.start()
        self.info = ModelInfo(
            eos_token_id=eos,
            max_context=self.manager.max_sequence_tokens,
            default_max_tokens=self.args.generation.max_tokens,
            grammars=Grammars(self.tokenizer, int(model.config.vocab_size), eos, config=self.manager.config),
        )
        self.vocab_size = int(model.config.vocab_size)
        logger.info("engine replica %s ready: %s", self.replica, self.args.model_name)

    async def generate(self, req: WorkerRequest) -> AsyncIterator[WorkerEvent]:
        if self.stopping:
            yield error_event(503, STOPPING)
            return
        lora = req.sampling.lora
        if lora is not None:
            try:
                await self.adapters.acquire(lora, req.lora_path)
            except InvalidRequestError as exc:
                yield error_event(400, exc.message, exc.field)
                return
            except APIError as exc:
                yield error_event(exc.status, exc.message)
                return
        interval_s = self.args.worker.stream_interval_ms / 1000
        self._streams.add(req.request_id)
        try:
            async for ev in run_request(self.manager, self.tokenizer, self.info, req, self.replica, interval_s):
                yield ev
        finally:
            self._streams.discard(req.request_id)
            if lora is not None:
                self.adapters.release(lora)

    async def check_adapter(self, path: str) -> dict[str, Any]:
        """`POST /v1/load_lora_adapter` reaching one replica: the folder is read here, and let go
        (the replica the router picks for the adapter's first request loads it). A refusal comes
        back as {"error": {field, message}}."""
        try:
            await self.adapters.check(path)
        except InvalidRequestError as exc:
            return {"error": {"field": exc.field, "message": exc.message}}
        return {"replica": self.replica}

    def end_streams(self) -> int:
        """The server is stopping (Ctrl-C on `cluster/run.py`): end every stream now, each with an
        explicit end (its client gets the `ABORTED` error, then `[DONE]`), and refuse new ones.
        Returns how many streams were running."""
        if not self.stopping:
            logger.info("engine replica %s: the server is stopping; ending %d streams", self.replica,
                        len(self._streams))
        self.stopping = True
        for rid in list(self._streams):
            self.manager.cancel_request(rid)
        return len(self._streams)

    def tokenize(self, work: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /tokenize (`serving/tokenization.py`); a refusal as {"error": {field, message}}."""
        try:
            return tokenization.tokenize(self.tokenizer, self.info.max_context, work).model_dump()
        except InvalidRequestError as exc:
            return {"error": {"field": exc.field, "message": exc.message}}

    def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        try:
            return tokenization.detokenize(self.tokenizer, self.vocab_size, tokens).model_dump()
        except InvalidRequestError as exc:
            return {"error": {"field": exc.field, "message": exc.message}}

    def tokenizer_info(self) -> dict[str, Any]:
        return tokenization.tokenizer_info(self.tokenizer, self.info.max_context)

    def describe(self) -> dict[str, Any]:
        """What a client of the deployment may need to know before sending requests."""
        return {
            "has_chat_template": getattr(self.tokenizer, "chat_template", None) is not None,
            "tp_ranks": 1 + (len(self.ranks.actors) if self.ranks is not None else 0),
            "replica": self.replica,
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
            "cpu_offload_gib": float(self.offload_gib),
            "node_kv_pool": self.node_kv_pool,
        }

    def ping(self) -> str:
        return self.replica

    def stats(self) -> dict[str, Any]:
        return {**self.manager.stats(), **self.adapters.stats(), "replica": self.replica}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, averaged by its controller for
        `autoscaling.EngineAutoscalingPolicy`."""
        s = self.manager.stats() if self.manager is not None else {}
        return {WAITING: float(s.get("waiting", 0)), RUNNING: float(s.get("running", 0)), KV_USAGE: kv_usage(s)}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve's controller; also pushes the full stats to the stats board."""
        s = self.stats()
        if self._board is not None:
            reply = self._board.report.remote(self.replica, s)
            asyncio.ensure_future(self._follow_board(reply))
        return {"running": s.get("running", 0), "waiting": s.get("waiting", 0), "kv_usage": kv_usage(s),
                "loras": self.adapters.names(), "lora_room": self.adapters.room()}

    async def _follow_board(self, reply: Any) -> None:
        """The board's answer to a report: end the streams when the server is stopping; let go of
        the adapters clients can no longer name."""
        try:
            answer = await asyncio.wait_for(reply, timeout=10)
        except Exception as exc:  # noqa: BLE001 - the board is advisory; the next report asks again
            logger.debug("stats board report failed: %r", exc)
            return
        if answer["stopping"]:
            self.end_streams()
        self.adapters.retain(answer["adapters"])

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: its manager is stopped, its batching loop
        died, or its engine is broken (a tensor-parallel rank died or hung: the engine then
        refuses every request, so the replica must go)."""
        if self.manager is None:
            raise RuntimeError("the replica's manager is stopped")
        self.manager.check_health()

    def __del__(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is None:
            return
        logger.info("engine replica %s shutting down", self.replica)
        if self._board is not None:
            try:
                self._board.forget.remote(self.replica)
            except Exception as exc:  # noqa: BLE001 - the board drops stale replicas anyway
                logger.debug("could not remove %s from the stats board: %r", self.replica, exc)
        # Serve has waited for this replica's streams (graceful_shutdown_timeout_s) and kills it
        # teardown_timeout_s later (`app.shutdown_budget_s`): every wait here fits in that.
        deadline = time.monotonic() + self.args.worker.teardown_timeout_s
        try:
            manager.stop(block=True, timeout=TEARDOWN_SHARE_STOP * self.args.worker.teardown_timeout_s)
        finally:
            manager.destroy(timeout=0)  # what is left now ends with an explicit error
            self.manager = None
            if self.ranks is not None:
                self.ranks.stop(timeout=max(0.0, deadline - time.monotonic()))


class EngineDeployment(EngineReplica):
    """`EngineReplica` as a Serve deployment (`app.py`). Its replica runs request code on Serve's
    main event loop (`settings.MODEL_REPLICA_ENV`), where Serve also calls the constructor and
    `__del__`: loading the model and stopping the engine go to a worker thread, so that the loop
    keeps answering Serve's controller (and keeps streaming the last requests) meanwhile."""

    async def __init__(self, args: ClusterArgs, board: DeploymentHandle | None = None):
        await asyncio.to_thread(super().__init__, args, board)

    async def __del__(self) -> None:
        await asyncio.to_thread(super().__del__)

    async def __call__(self, request: Any) -> Any:
        """HTTP reaching an engine replica, which has no routes. It happens while a redeploy moves
        the ingress into the worker (`ingress_placement: auto`, max_replicas going to 1): Serve's
        proxy then routes to the `LLMWorker` deployment, whose replicas of the previous version are
        engines alone until they are replaced. Refused explicitly: a 503 to retry."""
        return APIError(503, "the server is being redeployed; retry the request", code="redeploying",
                        retry_after_s=self.args.worker.retry_after_s).response()
