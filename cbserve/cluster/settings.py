"""The `args` of `build_app`: one validated pydantic model, read from `ray_config.yaml`.

The serving parts (generation defaults, limits, routing) are defined in `cbserve.serving.front.service_args`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, FieldSerializationInfo, field_serializer, field_validator, model_validator

from cbserve.config import ContinuousBatchingConfig
from cbserve.serving.front.service_args import (
    EmbeddingsConfig,
    GenerationDefaults,
    LimitsConfig,
    RoutingConfig,
    Strict,
)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What Serve's proxy, the ingress and Ray's own processes take of a CPU node while 32 streams run
# (measured on 2 cores: README, "CPU budget").
RESERVED_CPUS = 0.5
API_KEY_ENV = "CBSERVE_API_KEY"
DEFAULT_STAGING_GIB = 0.25  # cpu_offload.staging_gib
# ContinuousBatchingConfig fields each replica sets from the top-level settings (tp_size, cpu_offload).
CLUSTER_OWNED_ENGINE_FIELDS = ("tp_size", "tp_launcher", "cpu_offload_space", "node_kv_pool")


class CpuOffloadConfig(Strict):
    """Host memory (GiB) that KV pages are evicted to, set per node and shared by its replicas."""

    per_node_gib: float = Field(0.0, ge=0.0, description="default budget of every node; 0 disables")
    by_node: dict[str, float] = Field(
        default_factory=dict, description="budget of particular nodes, keyed by node IP or node id"
    )
    node_pool: bool = Field(
        False, description="true: a node's budget is one KV pool shared by its replicas (pages keyed by prefix "
                           "hash: a prefix computed by one replica is copied, not recomputed, by the others); "
                           "false: each replica gets a private share of it"
    )
    staging_gib: float = Field(
        DEFAULT_STAGING_GIB, gt=0.0, description="with node_pool: each replica's own host pool, where pulled pages are staged "
                                  "and preempted requests' pages wait (on top of the node's budget)"
    )

    @field_validator("by_node")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        for node, gib in v.items():
            if gib < 0:
                raise ValueError(f"cpu_offload.by_node[{node!r}] must be >= 0, got {gib}")
        return v

    @model_validator(mode="after")
    def _node_pool_settings_used(self) -> CpuOffloadConfig:
        # By value, not by fields set: a dump of the args (every default written out) reads back.
        if self.staging_gib != DEFAULT_STAGING_GIB and not self.node_pool:
            raise ValueError("cpu_offload.staging_gib is used only with node_pool: true")
        if self.node_pool and self.per_node_gib == 0 and not any(self.by_node.values()):
            raise ValueError("cpu_offload.node_pool needs a budget: per_node_gib > 0 or a by_node entry > 0")
        return self


class WorkerConfig(Strict):
    num_replicas: int = Field(1, ge=1, description="fixed replica count when autoscaling is null")
    autoscaling: dict[str, Any] | None = Field(
        None, description="Serve autoscaling_config: min_replicas, max_replicas, target_ongoing_requests, ..."
    )
    # Autoscaling also on the engine's signals (`cluster/autoscaling.py`); null turns a signal off.
    target_kv_usage: float | None = Field(
        0.8, gt=0.0, le=1.0, description="add replicas while the mean KV usage is above this share"
    )
    target_waiting_requests: float | None = Field(
        2.0, ge=0.0, description="add replicas while the engines queue more than this many requests each"
    )
    num_cpus: float | Literal["auto"] = Field(
        "auto", description="CPUs per tensor-parallel rank (= its torch threads on a CPU node); auto: 1 with "
                            "GPUs, else the node's CPUs less reserved_cpus, shared by the ranks"
    )
    reserved_cpus: float = Field(
        RESERVED_CPUS, ge=0.0, description="with num_cpus auto on a CPU node: the node's CPUs left to Serve's "
                                           "proxy, the ingress and Ray itself"
    )
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs per tensor-parallel rank")
    max_ongoing_requests: int = Field(256, ge=1, description="requests one replica accepts at once")
    # Serve's `max_queued_requests`, counted at each caller (ingress replica): beyond
    # max_ongoing_requests x replicas, this many wait; more are refused at once (overload).
    max_queued_requests: int = Field(
        512, ge=-1, description="requests each ingress replica queues for the workers; -1 = unbounded"
    )
    overload_status_code: Literal[503, 429] = Field(503, description="HTTP status of a refused (overload) request")
    retry_after_s: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="Retry-After of an overload refusal")
    graceful_shutdown_wait_loop_s: float = Field(1.0, gt=0.0)
    graceful_shutdown_timeout_s: float = Field(
        120.0, gt=0.0, description="how long in-flight requests may still run when a replica is stopped"
    )
    teardown_timeout_s: float = Field(
        30.0, gt=0.0, description="then: stopping the manager, freeing the KV cache, reaping tensor-parallel ranks"
    )
    health_check_period_s: float = Field(10.0, gt=0.0)
    stream_interval_ms: float = Field(
        0.0, ge=0.0, allow_inf_nan=False,
        description="a stream's new tokens go out at most this often; 0: every engine step (Ray Serve LLM: 50)",
    )

    @field_validator("num_cpus")
    @classmethod
    def _non_negative_cpus(cls, v: float | str) -> float | str:
        if v != "auto" and v < 0:
            raise ValueError(f"num_cpus must be >= 0 or 'auto', got {v}")
        return v

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_limit(cls, v: int) -> int:
        if v == 0:
            raise ValueError("max_queued_requests must be >= 1, or -1 for no limit; 0 would refuse everything "
                             "beyond max_ongoing_requests without queueing, which Serve does not support")
        return v

    @field_validator("autoscaling")
    @classmethod
    def _check_autoscaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from ray.serve.config import AutoscalingConfig

            AutoscalingConfig(**v)  # raises naming the bad field
        return v


class MigrationConfig(Strict):
    """Stream migration (`cluster/migration.py`): a choice whose worker replica fails or drains
    mid-stream is continued on another one, in the same client stream."""

    max_attempts: int = Field(3, ge=0, le=10, description="continuations tried per choice; 0 turns migration off "
                                                             "(the client gets the failure as an error)")


class ClusterArgs(Strict):
    """Every field of `applications[].args` in `ray_config.yaml`."""

    model: str | None = Field(None, description="HF id or local folder; null = the default model")
    served_model_name: str | None = Field(None, description="name clients pass as `model`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="auto: bfloat16 on a CPU with native bfloat16 dot products (avx512_bf16, AMX), "
                               "else float32 (ray_config.yaml's choice); float32 is the default of build_app"
    )
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per worker replica")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters every worker replica loads at start (vLLM's --lora-modules): "
        "name clients pass as `model` -> PEFT adapter folder; needs engine.enable_lora"
    )
    lora_runtime_updates: bool = Field(
        False, description="true: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING) load and unload adapters while serving; they need the API key"
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters a worker replica keeps in host memory (vLLM's --max-cpu-loras), least "
        "recently used idle ones unloaded past it; a replica loads an adapter the first time it is sent one of its "
        "requests; null: engine.max_loras, or the number of lora_modules if more"
    )
    engine: ContinuousBatchingConfig = Field(
        default_factory=ContinuousBatchingConfig, description="the engine's settings; each replica adds the fields "
        "the cluster owns (CLUSTER_OWNED_ENGINE_FIELDS, `engine_replica.engine_config`)"
    )
    generation: GenerationDefaults = Field(default_factory=GenerationDefaults)
    embeddings: EmbeddingsConfig = Field(default_factory=EmbeddingsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    cpu_offload: CpuOffloadConfig = Field(default_factory=CpuOffloadConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    ingress_replicas: int = Field(1, ge=1)
    ingress_placement: Literal["auto", "worker", "own"] = Field(
        "auto", description="worker: the ingress runs inside each worker replica (one process hop less); own: "
                            "a deployment of its own, which routes by prompt prefix; auto: worker when there is "
                            "a single worker replica and a single ingress replica"
    )
    api_key: str | None = Field(None, description=f"required bearer token; also read from ${API_KEY_ENV}")
    api_keys: list[str] = Field(
        default_factory=list, description="more accepted bearer tokens, one per tenant: each key gets an equal share "
        "of the engines (scheduler/fair_share.py)"
    )
    metrics_require_api_key: bool = Field(
        False, description="True: GET /metrics needs the API key too (only /health stays open)"
    )

    @field_serializer("engine")
    def _engine_as_given(self, engine: ContinuousBatchingConfig, info: FieldSerializationInfo) -> dict[str, Any]:
        # The fields the YAML set, not every default: the cluster-owned ones among those would be
        # refused when the dump is read back (a dump of the args is the args again).
        return engine.model_dump(mode=info.mode, exclude_unset=True)

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_leaves_out_the_cluster_fields(cls, value: Any) -> Any:
        # Before the engine's own checks, which would otherwise name a rule of the field instead.
        given = value.model_fields_set if isinstance(value, ContinuousBatchingConfig) else value
        for owned in CLUSTER_OWNED_ENGINE_FIELDS:
            if isinstance(given, (dict, set)) and owned in given:
                raise ValueError(f"engine.{owned} is set by the cluster; use the top-level setting instead")
        return value

    @model_validator(mode="after")
    def _check_cluster(self) -> ClusterArgs:
        if self.cpu_offload.node_pool and self.tp_size > 1:
            raise ValueError(f"cpu_offload.node_pool works with tp_size 1 only, got tp_size {self.tp_size}")
        for field, used in (("lora_modules", bool(self.lora_modules)),
                            ("lora_runtime_updates", self.lora_runtime_updates)):
            if used and not self.engine.enable_lora:
                raise ValueError(f"{field} needs engine.enable_lora: true")
        clash = {self.model_name, self.model} & self.lora_modules.keys()
        if clash:
            raise ValueError(f"lora_modules: {min(clash)!r} is the base model's name; give the adapter another")
        return self

    @property
    def ingress_in_worker(self) -> bool:
        if self.ingress_placement != "auto":
            return self.ingress_placement == "worker"
        w = self.worker
        most = int(w.autoscaling.get("max_replicas", 1)) if w.autoscaling else w.num_replicas
        return most == 1 and self.ingress_replicas == 1

    @property
    def host_loras(self) -> int:
        """Adapters a worker replica keeps in host memory (`max_cpu_loras`)."""
        return self.max_cpu_loras or max(self.engine.max_loras, len(self.lora_modules))

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        return os.path.basename(self.model.rstrip("/")) or self.model

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    def resolved_api_keys(self) -> list[str]:
        """Every accepted key: `api_key` (or $CBSERVE_API_KEY) and `api_keys`."""
        first = self.resolved_api_key()
        return list(dict.fromkeys(([first] if first else []) + self.api_keys))

    @field_validator("api_keys")
    @classmethod
    def _keys_not_empty(cls, v: list[str]) -> list[str]:
        if any(not key.strip() for key in v):
            raise ValueError("api_keys: every key must be a non-empty string")
        return v


def cpus_per_rank(args: ClusterArgs, node_cpus: float | None = None) -> float:
    """`worker.num_cpus`, with "auto" worked out for a node of `node_cpus` CPUs (default: this
    machine's): 1 per rank with GPUs (a GPU node's model does not run on its CPUs), else every CPU
    but `reserved_cpus`, shared by the tensor-parallel ranks."""
    w = args.worker
    if w.num_cpus != "auto":
        return float(w.num_cpus)
    if w.num_gpus > 0:
        return 1.0
    cpus = float(node_cpus if node_cpus is not None else os.cpu_count() or 1)
    return max(1.0, cpus - w.reserved_cpus) / args.tp_size


def with_cpus(args: ClusterArgs, node_cpus: float | None = None) -> ClusterArgs:
    """`args` with `worker.num_cpus` a number (`cpus_per_rank`)."""
    if args.worker.num_cpus != "auto":
        return args
    worker = args.worker.model_copy(update={"num_cpus": cpus_per_rank(args, node_cpus)})
    return args.model_copy(update={"worker": worker})


def torch_threads(args: ClusterArgs, node_cpus: float | None = None) -> int:
    """Torch threads of a rank on a CPU node: the CPUs it was given, a part-CPU counted whole
    (the part the proxy and ingress take is short and bursty; the model's threads fill it)."""
    return max(1, math.ceil(cpus_per_rank(args, node_cpus) - 1e-6))


# The environment of the Ray processes on the request path: engine replicas (and their
# tensor-parallel ranks), ingress replicas, the batch job's engine actors. Ray starts its workers
# at nice 15, below its own daemons (raylet, GCS, dashboard, agents, at 0): on a CPU node each
# wake-up of one of those took a core from a torch thread, and a parallel region waits for its
# slowest thread. An ingress left at 15 beside engines at 0 starves on a busy node (its streams,
# and the cancellation of those whose clients left). Ray's job manager sets the same variable
# for the drivers it starts.
MODEL_PROCESS_ENV = {"RAY_worker_niceness": "0"}

# Serve replicas that run the model also run their request code on Serve's main event loop
# rather than on a loop of its own thread (Serve's default, part of its RAY_SERVE_THROUGHPUT_OPTIMIZED
# mode): a streamed token crosses one thread less. Nothing of theirs blocks that loop for long:
# the model loads and the engine stops in worker threads, the engine steps in its own.
MODEL_REPLICA_ENV = {**MODEL_PROCESS_ENV, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def runtime_env(env_vars: dict[str, str]) -> dict[str, Any]:
    """A Ray `runtime_env` setting `env_vars` (merged by Ray with the job's own runtime_env)."""
    return {"env_vars": dict(env_vars)}
