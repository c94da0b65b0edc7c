"""What a front sends an engine replica, and what the replica streams back.

`WorkerRequest` carries values, not rules: sampling ranges, token ids and lengths are checked
once, by the engine, which raises `cbserve.errors.InvalidRequestError` naming its argument; the
replica streams that back as an `error` event whose `field` each front maps to its own name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class WorkerRequest(BaseModel):
    """One generation (one choice): exactly one of `prompt`, `messages`, `prompt_ids`."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int | None = Field(None, description="None: the deployment default, capped by context")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    logprobs: bool = False
    prefix_hashes: list[int] = Field(default_factory=list, description="read by the request router")

    @model_validator(mode="after")
    def _one_prompt(self) -> WorkerRequest:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_ids)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, messages, prompt_ids must be given")
        return self


EventKind = Literal["start", "delta", "end", "error"]
FinishReason = Literal["stop", "length", "abort"]


class WorkerEvent(BaseModel):
    """`start` (once, first), then `delta`s, then `end` or `error` (last)."""

    kind: EventKind
    # start
    replica: str | None = None
    prompt_tokens: int = 0
    # delta
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None
    # end
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    # error
    status: int = 0
    message: str = ""
    field: str | None = None  # set on a refused request (400): the InvalidRequestError's field
