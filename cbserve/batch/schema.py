"""The lines of a batch job: what an input line may hold, and the record written for each line.

Input (one JSON object per line): an `id` (a non-empty string or an integer, unique in the file)
and exactly one of `prompt` (text; sent as one user chat message when the model has a chat
template, or as plain completion text with `raw: true`), `messages` (a chat) or `input_ids`,
plus optional sampling fields named as in the OpenAI API.

Output (one JSON object per line, in completion order): `id`, `line` (1-based line number in the
input), and either `text`, `token_ids`, `finish_reason`, `usage`, or `error` and `error_type`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cbserve.serving.front.schemas import MAX_LOGPROBS, StructuredFields

ErrorType = Literal["invalid_json", "invalid_line", "duplicate_id", "invalid_request", "engine_error"]
# Errors that say nothing about the line itself: a rerun with the same output tries the line again.
RETRYABLE_ERRORS: frozenset[str] = frozenset({"engine_error"})
MAX_STOP = 8


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: str = Field(min_length=1)
    content: str


class BatchLine(StructuredFields):
    """One valid input line. Its types and ranges are the documented line format, refused as an
    `invalid_line` before the job starts an engine; what only the engine can judge (token ids in
    its vocabulary, max_tokens against the context, logit_bias values, a schema that does not
    compile) comes back from it as `invalid_request`. Structured outputs: `response_format`,
    `structured_outputs` or vLLM's `guided_*` fields, as in the HTTP API."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | int
    prompt: str | None = Field(None, min_length=1)
    raw: bool = Field(False, description="send `prompt` as plain text, not as a user chat message")
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    input_ids: list[int] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs: bool = Field(False, description="each output token's log-probability in the record")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: the k most likely")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each prompt token's, and k top")
    cache_salt: str | None = Field(None, description="vLLM's: prefix pages shared only among lines of one salt")
    lora: str | None = Field(None, min_length=1, description="the LoRA adapter the line runs with: a name of the "
                             "engines' lora_modules (or an adapter folder they can read); none: the base model")
    speculative: bool | None = Field(None, strict=True, description="false: the line is kept out of the engine's "
                                     "speculative decoding")
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1, description="vLLM's: lower runs first (needs the engine's "
                          "priority_scheduling)")
    metadata: dict[str, Any] | None = Field(None, description="copied to the output line as is")

    @field_validator("id", mode="before")
    @classmethod
    def _usable_id(cls, v: Any) -> Any:
        if usable_id(v) is None:
            raise ValueError(f"must be a non-empty string or an integer, got {json.dumps(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> BatchLine:
        given = [name for name in ("prompt", "messages", "input_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of prompt, messages, input_ids must be given, got {given or 'none'}"
            )
        if self.raw and self.prompt is None:
            raise ValueError("raw: only applies to `prompt`")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TopToken(BaseModel):
    token_id: int
    token: str
    logprob: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResultLine(BaseModel):
    """What the job writes for one input line."""

    id: str | int | None
    line: int
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopToken]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[TopToken]] | None = None
    error: str | None = None
    error_type: ErrorType | None = None
    metadata: dict[str, Any] | None = None

    def to_json(self) -> str:
        data = {"id": self.id, **self.model_dump(exclude_none=True)}  # a null id stays: the line had none
        return json.dumps(data, ensure_ascii=False)


def usable_id(value: Any) -> str | int | None:
    """`value` if it can serve as a line's id (a non-empty string or an integer, not a bool)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value):
        return value
    return None


def id_key(line_id: str | int) -> str:
    """Distinguishes 1 from "1"."""
    return "id:" + json.dumps(line_id, ensure_ascii=False)


def line_key(lineno: int) -> str:
    return f"line:{lineno}"


def record_key(record: dict[str, Any]) -> str | None:
    """The key under which a written record counts as done (None: not a record of this job).

    Lines with a usable id are keyed by it; lines without one, and repeated ids, by line number.
    """
    lineno = record.get("line")
    if not isinstance(lineno, int) or isinstance(lineno, bool):
        return None
    rid = usable_id(record.get("id"))
    if rid is None or record.get("error_type") == "duplicate_id":
        return line_key(lineno)
    return id_key(rid)


# Pydantic names the member of a union in an error's location (`stop.list[str]`): not a field.
_UNION_TAGS = {"str", "int", "list[str]"}


def describe_validation_error(exc: ValidationError) -> str:
    """`field: message; ...`, naming each offending field once."""
    parts: list[str] = []
    seen: set[str] = set()
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and p in _UNION_TAGS)]
        field = ".".join(loc) or "line"
        msg = err["msg"].removeprefix("Value error, ")
        if field in seen:
            continue
        seen.add(field)
        parts.append(f"{field}: {msg}" if field != "line" else msg)
    return "; ".join(parts)


def parse_line(text: str, lineno: int) -> BatchLine | ResultLine:
    """The validated line, or the error record to write for it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return ResultLine(id=None, line=lineno, error=f"invalid JSON: {exc}", error_type="invalid_json")
    if not isinstance(obj, dict):
        return ResultLine(
            id=None,
            line=lineno,
            error=f"a line must be a JSON object, got {type(obj).__name__}",
            error_type="invalid_line",
        )
    rid = usable_id(obj.get("id"))
    try:
        return BatchLine.model_validate(obj)
    except ValidationError as exc:
        return ResultLine(
            id=rid, line=lineno, error=describe_validation_error(exc), error_type="invalid_line"
        )
