"""OpenAI's embeddings (`POST /v1/embeddings`) of the served model: each input is one embedding
request on an engine replica (`workers/pooling.py`: its final hidden state pooled as the
deployment's `embeddings.pooling` says, L2-normalized), prefilled in the engine's batches beside
generating requests; nothing is generated.

`input`: a string, a list of strings, a list of token ids, or a list of token-id lists;
`encoding_format`: `float` or `base64` (little-endian float32, what OpenAI sends and its SDK
decodes, and asks for by default). `dimensions` is refused: a causal LM's pooled state is not
trained to be cut short (Matryoshka), so a truncated vector would silently mean less.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt, field_validator

from cbserve.errors import InvalidRequestError
from cbserve.serving.front.schemas import Strict


class EmbeddingRequest(Strict):
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, strict=True, description="refused when set (see the module doc)")
    # With no API keys configured, the tenant of the engine's fair share (ignored with keys).
    user: str | None = Field(None, strict=True)

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if len(items) == 0:
            raise ValueError("input must not be empty")
        if any(isinstance(item, (str, list)) and len(item) == 0 for item in items):
            raise ValueError("input must not hold an empty string or an empty token list")
        return v

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding, in the response's order."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # list[str] or list[list[int]]

    def check(self, max_inputs: int) -> None:
        if self.dimensions is not None:
            raise InvalidRequestError("dimensions", "dimensions is not supported: this model's embeddings have "
                                      "one size (leave dimensions out)")
        if len(self.inputs()) > max_inputs:
            raise InvalidRequestError("input", f"at most {max_inputs} inputs per request (limits.max_prompts), "
                                      f"got {len(self.inputs())}")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def response(model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str) -> EmbeddingResponse:
    data = [Embedding(index=i, embedding=encoded(v, encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=model,
                             usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
