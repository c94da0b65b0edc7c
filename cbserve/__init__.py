"""cbserve: a continuous-batching LLM inference engine with a paged KV cache."""

from cbserve.api import continuous_batching, generate_batch, init_continuous_batching
from cbserve.config import ContinuousBatchingConfig
from cbserve.manager import ContinuousBatchingManager
from cbserve.models import load_model
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "FinishReason",
    "GenerationOutput",
    "RequestStatus",
    "continuous_batching",
    "generate_batch",
    "init_continuous_batching",
    "load_model",
]
