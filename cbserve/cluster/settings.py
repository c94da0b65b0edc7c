"""The `args` of `build_app`: one validated pydantic model, read from `ray_config.yaml`."""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEY_ENV = "CBSERVE_API_KEY"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationDefaults(_Strict):
    """Used when a request leaves a field out."""

    max_tokens: int = Field(256, ge=1, description="max_tokens when the request gives none")
    temperature: float = Field(1.0, ge=0.0, description="OpenAI's default is 1.0")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off")


class LimitsConfig(_Strict):
    max_tokens: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest HTTP request body")
    max_n: int = Field(8, ge=1, description="largest `n` (choices per prompt)")
    max_prompts: int = Field(64, ge=1, description="largest batch of prompts in one completions call")
    max_stop: int = Field(8, ge=0, description="most stop strings per request")


class RoutingConfig(_Strict):
    """Prefix affinity, then least outstanding requests (see `router.py`)."""

    enabled: bool = Field(True, description="False: Serve's default power-of-two-choices router")
    imbalance_threshold: int = Field(
        4, ge=0, description="leave the affine replica when its queue exceeds the shortest by more than this"
    )
    chunk_chars: int = Field(128, ge=8, description="characters per hashed prefix chunk of a text prompt")
    chunk_tokens: int = Field(32, ge=1, description="tokens per hashed prefix chunk of a token-id prompt")
    max_chunks: int = Field(64, ge=1, description="prefix chunks hashed per request")
    table_size: int = Field(100_000, ge=1, description="prefix hashes remembered by each router (LRU)")
    stats_period_s: float = Field(1.0, gt=0.0, description="how often replicas report routing stats")


class CpuOffloadConfig(_Strict):
    """Host memory (GiB) that KV pages are evicted to, set per node and shared by its replicas."""

    per_node_gib: float = Field(0.0, ge=0.0, description="default budget of every node; 0 disables")
    by_node: dict[str, float] = Field(
        default_factory=dict, description="budget of particular nodes, keyed by node IP or node id"
    )

    @field_validator("by_node")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        for node, gib in v.items():
            if gib < 0:
                raise ValueError(f"cpu_offload.by_node[{node!r}] must be >= 0, got {gib}")
        return v


class WorkerConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="fixed replica count when autoscaling is null")
    autoscaling: dict[str, Any] | None = Field(
        None, description="Serve autoscaling_config: min_replicas, max_replicas, target_ongoing_requests, ..."
    )
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs per tensor-parallel rank")
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
    graceful_shutdown_timeout_s: float = Field(120.0, gt=0.0, description="drain limit on scale-down")
    health_check_period_s: float = Field(10.0, gt=0.0)

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


class ClusterArgs(_Strict):
    """Every field of `applications[].args` in `ray_config.yaml`."""

    model: str | None = Field(None, description="HF id or local folder; null = the default model")
    served_model_name: str | None = Field(None, description="name clients pass as `model`")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per worker replica")
    engine: dict[str, Any] = Field(default_factory=dict, description="ContinuousBatchingConfig fields")
    generation: GenerationDefaults = Field(default_factory=GenerationDefaults)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    cpu_offload: CpuOffloadConfig = Field(default_factory=CpuOffloadConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    ingress_replicas: int = Field(1, ge=1)
    api_key: str | None = Field(None, description=f"required bearer token; also read from ${API_KEY_ENV}")
    metrics_require_api_key: bool = Field(
        False, description="True: GET /metrics needs the API key too (only /health stays open)"
    )

    @model_validator(mode="after")
    def _check_engine(self) -> ClusterArgs:
        from cbserve.config import ContinuousBatchingConfig

        for owned in ("tp_size", "cpu_offload_space"):
            if owned in self.engine:
                raise ValueError(f"engine.{owned} is set by the cluster; use the top-level setting instead")
        ContinuousBatchingConfig(**self.engine)  # fail at deploy time, naming the field
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        return os.path.basename(self.model.rstrip("/")) or self.model

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None
