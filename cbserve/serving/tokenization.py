"""vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`, so clients (lm-eval's remote
tokenizer, GuideLLM) can use the server's own tokenizer.

The ingress parses and checks the body (`parse_tokenize`, `DetokenizeRequest`), an engine
replica answers with its tokenizer (`tokenize`, `detokenize`, `tokenizer_info`). Shapes as in
vLLM: `/tokenize` takes `{"prompt", "add_special_tokens": true}` or `{"messages",
"add_generation_prompt": true, "continue_final_message": false, "add_special_tokens": false,
"tools"}`, and `return_token_strs`; it answers `{"count", "max_model_len", "tokens",
"token_strs"}`. `/detokenize` takes `{"tokens"}` and answers `{"prompt"}`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictInt

from cbserve.errors import InvalidRequestError
from cbserve.serving.chat_template import chat_token_ids, template_messages
from cbserve.serving.front.json_body import parse_json, validation_error
from cbserve.serving.front.schemas import ChatMessage, Strict, Tool


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[StrictInt]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body in the form it takes (`messages`: chat); a 400 `APIError` naming the field."""
    from pydantic import ValidationError

    data = parse_json(body)
    schema = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def tokenize_work(req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """What the replica needs of a tokenize request (plain data, for the handle call)."""
    work = req.model_dump(exclude={"model", "messages", "tools"})
    if isinstance(req, TokenizeChatRequest):
        if req.add_generation_prompt and req.continue_final_message:
            raise InvalidRequestError("continue_final_message", "continue_final_message: not with "
                                      "add_generation_prompt")
        work["messages"] = template_messages(req.messages)
        work["tools"] = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return work


def tokenize(tokenizer: Any, max_model_len: int, work: dict[str, Any]) -> TokenizeResponse:
    if "messages" in work:
        ids = chat_token_ids(tokenizer, work["messages"], work.get("tools"), work["add_generation_prompt"],
                             work["continue_final_message"], work["add_special_tokens"])
    else:
        ids = list(tokenizer(work["prompt"], add_special_tokens=work["add_special_tokens"]).input_ids)
    strs = tokenizer.convert_ids_to_tokens(ids) if work.get("return_token_strs") else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(tokenizer: Any, vocab_size: int, tokens: list[int]) -> DetokenizeResponse:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise InvalidRequestError("tokens", f"tokens[{i}]: token id {t} is not in the vocabulary [0, {vocab_size})")
    return DetokenizeResponse(prompt=tokenizer.decode(tokens))


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: the special tokens, the chat template, the context."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len,
                            "chat_template": getattr(tokenizer, "chat_template", None)}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    return info
