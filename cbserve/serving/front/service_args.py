"""The serving settings a front needs: defaults for fields a request leaves out, the HTTP front's
limits, and prefix-routing keys. Part of `ClusterArgs` (`cbserve.cluster.settings`), which is
read from `ray_config.yaml`."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationDefaults(Strict):
    """Used when a request leaves a field out."""

    max_tokens: int | None = Field(None, ge=1, description="max_tokens when the request gives none; None: the "
                                   "context the prompt leaves (vLLM's default)")
    # None: the model's generation_config.json sets it (vLLM's default), else OpenAI's value.
    temperature: float | None = Field(None, ge=0.0, description="None: the model's, else 1.0 (OpenAI's default)")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="None: the model's, else 1.0")
    top_k: int | None = Field(None, ge=0, description="None: the model's, else off; 0 = off")


class EmbeddingsConfig(Strict):
    """`/v1/embeddings` of the served model (`workers/pooling.py`)."""

    pooling: Literal["mean", "last"] = Field(
        "mean", description="mean: the mean of every input position's final hidden state (llama.cpp's --pooling "
                            "mean); last: the last position's (vLLM's default for decoder-only models, what causal "
                            "LMs trained as embedders expect); either L2-normalized")


class LimitsConfig(Strict):
    max_tokens: int | None = Field(None, ge=1, description="largest max_tokens a request may ask for; None: "
                                   "no limit but the context (a larger max_tokens is capped to the context left)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest HTTP request body")
    max_n: int = Field(8, ge=1, description="largest `n` (choices per prompt)")
    max_prompts: int = Field(64, ge=1, description="largest batch of prompts in one completions call (and of "
                             "inputs in one embeddings call)")
    max_stop: int = Field(8, ge=0, description="most stop strings per request")


class RoutingConfig(Strict):
    """Consistent hashing with bounded loads of the prompt's leading chunks, power-of-two choices
    for prompts shorter than a chunk (see `cbserve/cluster/balance.py`)."""

    enabled: bool = Field(True, description="False: Serve's default power-of-two-choices router")
    load_factor: float = Field(
        1.25, ge=1.0, description="a prefix's replica takes it while its queue is below this x the mean queue"
    )
    imbalance_threshold: int = Field(
        4, ge=0, description="... plus this many requests (light load never breaks prefix affinity)"
    )
    adapter_load_factor: float = Field(
        2.0, ge=1.0, description="a LoRA adapter's replicas take its requests while their queue is below this x the "
        "mean queue (plus imbalance_threshold): a replica without the adapter must load it"
    )
    key_chunks: int = Field(1, ge=1, description="leading prefix chunks hashed into the routing key")
    virtual_nodes: int = Field(64, ge=1, description="points of each replica on the hash ring")
    chunk_chars: int = Field(128, ge=8, description="characters per hashed prefix chunk of a text prompt")
    chunk_tokens: int = Field(32, ge=1, description="tokens per hashed prefix chunk of a token-id prompt")
    max_chunks: int = Field(64, ge=1, description="prefix chunks hashed per request")
    stats_period_s: float = Field(1.0, gt=0.0, description="how often replicas report routing stats")
    request_router_class: str | None = Field(
        None, description="another Serve RequestRouter (import path `module:Class`) instead of ours"
    )
    request_router_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="its `initialize_state` arguments"
    )


class ServiceArgs(Protocol):
    """What the OpenAI and gRPC fronts read (`ClusterArgs` has it all)."""

    @property
    def model(self) -> str | None: ...

    @property
    def model_name(self) -> str: ...

    @property
    def lora_modules(self) -> dict[str, str]: ...

    @property
    def generation(self) -> GenerationDefaults: ...

    @property
    def limits(self) -> LimitsConfig: ...

    @property
    def embeddings(self) -> EmbeddingsConfig: ...

    @property
    def routing(self) -> RoutingConfig: ...
