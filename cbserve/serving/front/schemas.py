"""OpenAI wire schemas (the subset this server implements), as pydantic models.

Requests are strict: a field this server does not know is a 400 naming it (OpenAI's `param`),
never silently dropped. The few fields accepted and ignored on purpose are declared here, each
with its reason (`IGNORED`). Fields this server knows but cannot honour in some value (`suffix`,
`best_of > 1`) are refused with a 400 naming the field (see `openai_service.py`).

The ranges below are OpenAI's documented wire contract (temperature in [0, 2], top_p in (0, 1],
n >= 1, ...), refused while parsing with the JSON path of the field, before any choice is sent
to a replica. What the engine itself can hold (token ids in its vocabulary, top_k and seed sizes,
max_tokens against the context, logit_bias values) is checked by the engine only.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

# OpenAI's seed is an int64; each choice samples with seed + its index.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # top logprobs per token (the engine's limit, vLLM's default max_logprobs)

# Accepted and ignored on purpose: field -> why (README "Endpoints").
IGNORED = {
    "response_format.json_schema.name / description": "labels for the schema; the grammar enforces it",
    "response_format.json_schema.strict": "always strict: the output is constrained by the schema's grammar",
    "tools[].function.strict": "named and required calls always follow the schema (grammar); auto calls "
                               "are parsed as the model wrote them",
    "tools[].function.description": "passed to the chat template, which may or may not show it",
    "metadata": "tags for stored completions; nothing is stored here (validated as OpenAI does)",
    "service_tier": "auto or default: this server has one tier (flex, scale, priority are refused)",
    "messages[].annotations / audio / refusal (assistant)": "a replayed assistant turn's extras: its text "
                                                            "(content) is what the template gets",
}


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
TEMPLATE_CALL_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Strict(BaseModel):
    """Unknown fields are refused (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: usage in every chunk (with include_usage)")


# ---- structured outputs ------------------------------------------------------------------------


class JsonSchemaSpec(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema must be given exactly when type is 'json_schema'")
        return self


class StructuredOutputsSpec(Strict):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StructuredFields(Strict):
    """Ways to constrain the output (at most one per request)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class SamplingFields(StructuredFields):
    """Fields shared by completions and chat completions."""

    # Numbers are strict: "5", true or 5.5 for an integer is refused (400), not coerced.
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    top_k: int | None = Field(None, ge=-1, strict=True, description="extension, as in vLLM; 0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, strict=True)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX - 64, strict=True)  # room for seed + choice
    n: int = Field(1, ge=1, strict=True)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # With no API keys configured, the tenant of the engine's fair share (ignored with keys).
    user: str | None = Field(None, strict=True)
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1, strict=True,
                          description="vLLM's: lower runs first (before any fair share); an int64")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    repetition_penalty: float | None = Field(None, gt=0.0, strict=True)
    logit_bias: dict[str, StrictFloat] | None = None
    min_tokens: int | None = Field(None, ge=0, strict=True)
    ignore_eos: bool = Field(False, strict=True)
    skip_special_tokens: bool = Field(True, strict=True)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    cache_salt: str | None = Field(None, strict=True, description="vLLM's: the prompt's prefix pages are shared "
                                   "only with requests of the same salt (length checked by the engine)")
    speculative: bool | None = Field(None, strict=True, description="cbserve's: false keeps the request out of the "
                                     "engine's speculative decoding (engine.speculative)")
    migrate: bool = Field(True, strict=True, description="cbserve's: false: a choice whose worker replica fails "
                          "mid-stream ends with the error instead of going on on another replica (stream migration)")
    # Fields current OpenAI SDKs send (README "Endpoints": the field policy).
    store: bool | None = Field(None, strict=True, description="false or null: nothing is stored here")
    metadata: dict[str, str] | None = Field(None, max_length=16)  # IGNORED
    service_tier: Literal["auto", "default"] | None = None  # IGNORED
    prompt_cache_key: str | None = Field(None, strict=True, min_length=1, max_length=1024,
                                         description="the routing key: requests with one key go to one replica")

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("completions are not stored by this server: store must be false or left out")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and any(len(k) > 64 or len(val) > 512 for k, val in v.items()):
            raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_with_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only with stream: true")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(None, ge=0, strict=True, description="0: only with echo or prompt_logprobs")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, strict=True)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(len(p) == 0 for p in v):
            raise ValueError("prompt token lists must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, one per completion batch entry."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # list[str] or list[list[int]]


# ---- chat ---------------------------------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="JSON text of the arguments, as OpenAI sends it")


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # What SDKs replay of an assistant turn: the reasoning goes to the chat template (Qwen3's reads
    # it); the rest is accepted and not used (IGNORED).
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        for name in ("reasoning_content", "refusal", "annotations", "audio"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name}: only assistant messages carry it")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool messages answer a tool call")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted and ignored: IGNORED


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=32, description="vLLM's: variables for the chat template (Qwen3's enable_thinking)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="the template's thinking switch: none and minimal turn it off (refused without one)")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & TEMPLATE_CALL_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the server, not a template variable")
        return v


# ---- responses --------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely; None when the token is not among the top ones
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt position (None for the first), token id -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]
FinishReasonName = Literal["stop", "length", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class _OmitsNoCalls(BaseModel):
    """`tool_calls` only when there are calls (as OpenAI sends it), `reasoning_content` only from
    a thinking model (vLLM's field)."""

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> Any:
        data = handler(self)
        for name in ("tool_calls", "reasoning_content"):
            if isinstance(data, dict) and data.get(name) is None:
                data.pop(name, None)
        return data


class AssistantMessage(_OmitsNoCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension (the chat's prompt is shared)


class _OmitsNone(BaseModel):
    """Only the keys given, as OpenAI streams a call: its later deltas carry no `id`, `type` or
    `name` (a null `type` would overwrite what the SDKs' stream helpers accumulated)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> Any:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class DeltaFunctionCall(_OmitsNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitsNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_OmitsNoCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cbserve"
    root: str | None = None
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (None for the base model)
    max_model_len: int | None = None  # vLLM's: the longest prompt + output


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# An adapter's name as clients pass it in `model`: what a model id looks like ("org/name-v2").
ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}"


class LoadLoraAdapterRequest(Strict):
    """vLLM's body of `POST /v1/load_lora_adapter`."""

    lora_name: str = Field(pattern=f"^{ADAPTER_NAME}$", description="the name clients then pass as `model`")
    lora_path: str = Field(min_length=1, max_length=4096, description="a PEFT adapter folder on the server")
    load_inplace: bool = Field(False, description="replace an adapter of that name instead of refusing")


class UnloadLoraAdapterRequest(Strict):
    """vLLM's body of `POST /v1/unload_lora_adapter`."""

    lora_name: str = Field(min_length=1, max_length=128)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
