"""`build_app(args)`: the Serve application of `ray_config.yaml` (`import_path: cbserve.cluster.app:build_app`).

    ingress (FastAPI + gRPC)  --handle, PrefixAffinityRouter-->  engine replicas (one manager each;
            \\--> StatsBoard <-- replicas push their engine stats     the `LLMWorker` deployment)

or, with one worker replica (`ClusterArgs.ingress_in_worker`), the ingress inside it
(`colocated.py`): Serve's proxy --> `LLMWorker` (ingress routes + engine) --> StatsBoard.

Every field of `args` is documented on `ClusterArgs` (`settings.py`) and in the README.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from cbserve.cluster.colocated import OTHER_ROUTES_HEADROOM, IngressWorker
from cbserve.cluster.engine_replica import DEPLOYMENT_NAME, EngineDeployment
from cbserve.cluster.ingress import OpenAIIngress
from cbserve.cluster.ray_compat import DEFAULT_ROUTER_CLASS
from cbserve.cluster.settings import (
    MODEL_PROCESS_ENV,
    MODEL_REPLICA_ENV,
    ClusterArgs,
    WorkerConfig,
    cpus_per_rank,
    runtime_env,
    with_cpus,
)
from cbserve.cluster.stats_board import StatsBoard
from cbserve.serving.front.service_args import RoutingConfig

logger = logging.getLogger(__name__)

ROUTER_CLASS = "cbserve.cluster.router:PrefixAffinityRouter"
AUTOSCALING_POLICY = "cbserve.cluster.autoscaling:EngineAutoscalingPolicy"


def shutdown_budget_s(w: WorkerConfig) -> float:
    return w.graceful_shutdown_timeout_s + w.graceful_shutdown_wait_loop_s + w.teardown_timeout_s


def autoscaling_config(w: WorkerConfig) -> dict[str, Any]:
    """`worker.autoscaling`, with the engine-signal policy unless it names a policy of its own."""
    auto = dict(w.autoscaling or {})
    if "policy" not in auto and (w.target_kv_usage is not None or w.target_waiting_requests is not None):
        auto["policy"] = {
            "policy_function": AUTOSCALING_POLICY,
            "policy_kwargs": {"target_kv_usage": w.target_kv_usage,
                              "target_waiting_requests": w.target_waiting_requests},
        }
    return auto


def router_class(routing: RoutingConfig) -> str:
    if routing.request_router_class:
        return routing.request_router_class
    return ROUTER_CLASS if routing.enabled else DEFAULT_ROUTER_CLASS


def router_kwargs(routing: RoutingConfig) -> dict[str, Any]:
    if routing.request_router_class:
        return dict(routing.request_router_kwargs)
    if not routing.enabled:
        return {}
    return {"load_factor": routing.load_factor, "imbalance_threshold": routing.imbalance_threshold,
            "key_chunks": routing.key_chunks, "virtual_nodes": routing.virtual_nodes,
            "adapter_load_factor": routing.adapter_load_factor}


def worker_options(args: ClusterArgs) -> dict[str, Any]:
    w, routing = args.worker, args.routing
    router = RequestRouterConfig(
        request_router_class=router_class(routing),
        request_router_kwargs=router_kwargs(routing),
        request_routing_stats_period_s=routing.stats_period_s,
        request_routing_stats_timeout_s=max(routing.stats_period_s, 5.0),
    )
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": w.max_ongoing_requests,
        # Overload: beyond max_ongoing_requests x replicas, each caller queues at most this many;
        # more get BackPressureError at once (the ingress turns it into a 503/429 with Retry-After).
        "max_queued_requests": w.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=w.overload_status_code, retry_after_s=w.retry_after_s),
        "graceful_shutdown_wait_loop_s": w.graceful_shutdown_wait_loop_s,
        # Serve kills a stopping replica this long after asking it to stop: its in-flight requests
        # get graceful_shutdown_timeout_s (Serve polls every wait loop), then `__del__` its teardown.
        "graceful_shutdown_timeout_s": shutdown_budget_s(w),
        "health_check_period_s": w.health_check_period_s,
        "request_router_config": router,
    }
    if w.autoscaling is not None:
        opts["autoscaling_config"] = autoscaling_config(w)
    else:
        opts["num_replicas"] = w.num_replicas
    cpus = cpus_per_rank(args)
    resources = {"CPU": cpus, "GPU": w.num_gpus}
    opts["ray_actor_options"] = {"num_cpus": cpus, "num_gpus": w.num_gpus,
                                 "runtime_env": runtime_env(MODEL_REPLICA_ENV)}
    if args.tp_size > 1:
        # One bundle per tensor-parallel rank, packed on one node; the replica actor takes the
        # first bundle and starts the other ranks in the rest (`tp_ranks.py`).
        bundle = {k: v for k, v in resources.items() if v > 0} or {"CPU": 0.001}
        opts["placement_group_bundles"] = [dict(bundle) for _ in range(args.tp_size)]
        opts["placement_group_strategy"] = "STRICT_PACK"
    return opts


def colocated_options(args: ClusterArgs) -> dict[str, Any]:
    """The worker deployment with the ingress inside (`colocated.py`): the replica admits choices
    itself (`Admission`, answering overload in OpenAI's shape), so Serve's own limits only have to
    stay above it; Serve's default router balances replicas (there is no prefix to route by)."""
    w, opts = args.worker, worker_options(args)
    queued = w.max_queued_requests if w.max_queued_requests >= 0 else 10_000
    opts["max_ongoing_requests"] = w.max_ongoing_requests + queued + OTHER_ROUTES_HEADROOM
    opts["max_queued_requests"] = -1  # else a burst waiting to be routed at the proxy is refused in plain text
    router = opts["request_router_config"]
    if router.request_router_class == ROUTER_CLASS:  # it routes by the prompt, which Serve's proxy never reads
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=DEFAULT_ROUTER_CLASS,
            request_routing_stats_period_s=router.request_routing_stats_period_s,  # the replica pushes stats then
            request_routing_stats_timeout_s=router.request_routing_stats_timeout_s,
        )
    return opts


def largest_node_cpus() -> float | None:
    """CPUs of the largest alive node of the Ray cluster this runs in (None outside Ray): where
    `worker.num_cpus: auto` is worked out (one worker replica per CPU node, less what Serve needs)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=None) or None
    except Exception as exc:  # noqa: BLE001 - then this machine's CPU count
        logger.warning("could not read the Ray cluster's nodes: %r", exc)
        return None


def build_app(args: dict[str, Any] | ClusterArgs | None = None) -> Application:
    """The app for `args`: `applications[].args` of a Serve config (plain data, parsed here, once),
    or `ClusterArgs` already parsed. Every deployment gets the parsed object (Ray pickles `.bind()`'s
    arguments), never a dump to parse again."""
    parsed = args if isinstance(args, ClusterArgs) else ClusterArgs(**(args or {}))
    cfg = with_cpus(parsed, largest_node_cpus())
    board = serve.deployment(StatsBoard).options(
        name="StatsBoard", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
        logging_config={"enable_access_log": False},  # replicas report every stats period
    ).bind(adapters=cfg.lora_modules)
    logger.info("cbserve app: model %s, tp_size %d, worker %s, %g CPUs per rank, ingress %s", cfg.model_name,
                cfg.tp_size, cfg.worker.autoscaling or f"{cfg.worker.num_replicas} replica(s)", cfg.worker.num_cpus,
                "in the worker" if cfg.ingress_in_worker else "own deployment")
    if cfg.ingress_in_worker:
        return serve.deployment(IngressWorker).options(**colocated_options(cfg)).bind(cfg, board)
    replicas = serve.deployment(EngineDeployment).options(**worker_options(cfg)).bind(cfg, board)
    return serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        num_replicas=cfg.ingress_replicas,
        # On the request path too: at Ray's default priority, below the engines, it would starve
        # on a busy node (streams, and the cancellation of the ones whose clients left).
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env(MODEL_PROCESS_ENV)},
        max_ongoing_requests=10_000,
    ).bind(replicas, board, cfg)
