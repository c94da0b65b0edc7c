"""cbserve: a continuous-batching LLM inference engine with a paged KV cache."""

from cbserve.api import (
    continuous_batching,
    destroy_cached_continuous_batching_manager,
    generate_batch,
    init_continuous_batching,
)
from cbserve.compat import attach, detach
from cbserve.config import ContinuousBatchingConfig, SpeculativeConfig
from cbserve.errors import InvalidRequestError, QueueFullError
from cbserve.manager import ContinuousBatchingManager
from cbserve.models import load_model, load_model_shard
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus
from cbserve.workers.parallel.launch import serve_tensor_parallel_rank
from cbserve.workers.structured import StructuredOutputs

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "FinishReason",
    "GenerationOutput",
    "InvalidRequestError",
    "QueueFullError",
    "RequestStatus",
    "SpeculativeConfig",
    "StructuredOutputs",
    "attach",
    "continuous_batching",
    "destroy_cached_continuous_batching_manager",
    "detach",
    "generate_batch",
    "init_continuous_batching",
    "load_model",
    "load_model_shard",
    "serve_tensor_parallel_rank",
]
