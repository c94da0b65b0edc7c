"""cbserve: a continuous-batching LLM inference engine with a paged KV cache."""

from cbserve.api import continuous_batching, generate_batch, init_continuous_batching
from cbserve.config import ContinuousBatchingConfig
from cbserve.errors import InvalidRequestError
from cbserve.manager import ContinuousBatchingManager
from cbserve.models import load_model
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus
from cbserve.workers.parallel.launch import serve_tensor_parallel_rank

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "FinishReason",
    "GenerationOutput",
    "InvalidRequestError",
    "RequestStatus",
    "continuous_batching",
    "generate_batch",
    "init_continuous_batching",
    "load_model",
    "serve_tensor_parallel_rank",
]
