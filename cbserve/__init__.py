"""cbserve: a continuous-batching LLM inference engine with a paged KV cache."""

from cbserve.api import generate_batch
from cbserve.config import ContinuousBatchingConfig
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus

__all__ = [
    "ContinuousBatchingConfig",
    "FinishReason",
    "GenerationOutput",
    "RequestStatus",
    "generate_batch",
]
