"""What a front sends an engine replica, and what the replica streams back.

`WorkerRequest` carries values, not rules: sampling ranges, token ids and lengths are checked
once, by the engine, which raises `cbserve.errors.InvalidRequestError` naming its argument; the
replica streams that back as an `error` event whose `field` each front maps to its own name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# One of the most likely tokens at a position: (token id, its text, its log-probability).
TopEntry = tuple[int, str, float]
ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class Sampling(BaseModel):
    """One choice's sampling, built once by its front and carried as is to the manager: each field
    is an `add_request` keyword (`cbserve.workers.validation`: SAMPLING_FIELDS, OPTIONS,
    SCHEDULING_FIELDS, cache_salt), checked there, with vLLM's semantics. A field left None is left
    off: the replica's manager then applies the model's generation_config.json defaults
    (`generation.manager_generation_config`), as vLLM does."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    top_logprobs: int | None = Field(None, description="most likely tokens reported with each generated one")
    prompt_logprobs: int | None = Field(None, description="None: none; k: each prompt token's and k top ones")
    cache_salt: str | None = None  # vLLM's: prefix pages shared only among requests of one salt
    speculative: bool | None = None  # False: out of the engine's speculative decoding
    lora: str | None = None  # the LoRA adapter it runs with (the front's, from `model`); None: the base model
    # The engine's fair share (cbserve/scheduler/fair_share.py): vLLM's priority (lower runs first);
    # the tenant and the parent request (one API call) are set by the server, never by a client.
    priority: int | None = None
    tenant: str | None = None
    parent_id: str | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """`add_request`'s sampling keywords."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Constraint(BaseModel):
    """Structured output: compiled by the replica (`cbserve.workers.structured`); a spec that does
    not compile is refused naming `field`, the request's own name for it."""

    kind: ConstraintKind
    spec: Any = None
    field: str = "response_format"


class Resume(BaseModel):
    """A choice continued on this replica after the one serving it failed or drained (stream
    migration, `cbserve/cluster/migration.py`): what its client has received so far."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(description="the output tokens sent: prefilled after the prompt, counted as generated")
    text_chars: int = Field(0, ge=0, description="the characters of output text sent: not sent again")


class WorkerRequest(BaseModel):
    """One generation (one choice), or one embedding (`pooling`): exactly one of `prompt`,
    `messages`, `prompt_ids`."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not a default

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="function tools, for the chat template")
    template_kwargs: dict[str, Any] | None = Field(None, description="variables for the chat template")
    reasoning_effort: str | None = Field(None, description="set: the chat template must have enable_thinking")
    max_tokens: int | None = Field(None, description="None: the deployment default, capped by context; "
                                                     "0: no generated token (echo / prompt logprobs)")
    sampling: Sampling = Field(default_factory=Sampling)
    stop: list[str] = Field(default_factory=list)
    constraint: Constraint | None = None
    logprobs: bool = False
    echo: bool = Field(False, description="send the prompt's text (and tokens) back before the output")
    skip_special_tokens: bool = True
    prefix_hashes: list[int] = Field(default_factory=list, description="read by the request router")
    resume: Resume | None = None
    migrate: bool = Field(True, description="false: no continuation elsewhere if its replica loses it")
    avoid_replicas: list[str] = Field(default_factory=list, description="read by the request router: replicas "
                                      "this choice left (tried last)")
    pooling: Literal["mean", "last"] | None = Field(None, description="set: an embedding (the `end` event carries "
                                                    "it); nothing is generated")
    lora_path: str | None = Field(None, description="the folder of `sampling.lora`, from the ingress's adapter "
                                  "catalog: the replica loads it if it does not hold it yet")

    @model_validator(mode="after")
    def _one_prompt(self) -> WorkerRequest:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_ids)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, messages, prompt_ids must be given")
        return self


class PromptInfo(BaseModel):
    """The prompt as the request asked to get it back (echo, prompt logprobs): its text, tokens,
    each token's log-probability (None for the first) and the most likely tokens at each one."""

    text: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    token_texts: list[str] = Field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[TopEntry]] | None = None


EventKind = Literal["start", "delta", "end", "error"]
FinishReason = Literal["stop", "length", "abort"]


class WorkerEvent(BaseModel):
    """`start` (once, first), then `delta`s, then `end` or `error` (last)."""

    kind: EventKind
    # start
    replica: str | None = None
    prompt_tokens: int = 0
    # How a chat output begins (front/reasoning.py): "tagged" may open <think>, "open" starts in it.
    reasoning: Literal["off", "tagged", "open"] = "off"
    tool_format: Literal["hermes", "mistral", "llama3_json", "pythonic"] = "hermes"  # how tool calls are written
    # delta
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None
    top_logprobs: list[list[TopEntry]] | None = None
    prompt: PromptInfo | None = None  # on the first delta, when the request asked for it
    # end
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector
    # error
    status: int = 0
    message: str = ""
    field: str | None = None  # set on a refused request (400): the InvalidRequestError's field
    code: str | None = None  # "overloaded": the engine's waiting queue is full
