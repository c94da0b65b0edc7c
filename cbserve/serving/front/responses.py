"""OpenAI's Responses API (`POST /v1/responses`) on the chat completions path.

A request is translated to a chat completion request (instructions and input items to messages,
function tools, `text.format` to `response_format`, `reasoning.effort` to `reasoning_effort`,
`max_output_tokens` to `max_tokens`), run as one, and its result rendered as a Response: output
items `reasoning` (a thinking model's reasoning), `message` (`output_text`) and `function_call`;
`status` `incomplete` with `incomplete_details.reason` `max_output_tokens` when cut short. Streaming
turns the chat chunks into the Responses events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`), each with its `sequence_number`.

`previous_response_id` continues a conversation from a bounded in-memory store of the ingress
replica (`ResponseStore`: the conversation's messages, the last `STORE_SIZE` responses; `store:
false` skips it; OpenAI's default is to store). It is lost on a restart, and a follow-up that another
ingress replica receives is refused naming the field. `conversation`, `background`, stored
`prompt`s, tools other than functions, non-text inputs and `include`s are refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import Field, ValidationError

from cbserve.serving.api_errors import APIError
from cbserve.serving.front.json_body import validation_error
from cbserve.serving.front.schemas import ChatCompletionRequest, ChatCompletionResponse, Strict

# A chat field's name as the Responses request spells it (for errors).
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # kept with the response, not used
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)  # OpenAI's successor of `user`: the tenant
    truncation: Literal["disabled"] | None = None
    store: bool | None = None  # None: stored, as OpenAI does
    previous_response_id: str | None = Field(None, max_length=256)
    # Refused unless off: no hosted state beyond the response store.
    background: Literal[False] | None = None
    conversation: None = None
    prompt: None = None
    include: list[str] | None = Field(None, max_length=0)
    top_logprobs: Literal[0] | None = None
    max_tool_calls: None = None
    stream_options: dict[str, Literal[False]] | None = None  # include_obfuscation: false only


STORE_SIZE = 1024  # responses kept for previous_response_id, per ingress replica


class ResponseStore:
    """The conversations of the last `size` stored responses (their chat messages, instructions
    excluded, as OpenAI does not carry them over), least recently stored first out."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[rid] = messages
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict[str, Any]]:
        with self._lock:
            found = self._items.get(rid)
        if found is None:
            raise _refuse("previous_response_id", f"no stored response {rid!r} here (responses are kept in memory, "
                          f"the last {self.size} of this server's ingress replica; store: false keeps none)")
        return found


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant message of a replayed conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            message["content"] = "".join(p["text"] for p in item["content"])
        else:
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [message]


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


# -- request: to chat ------------------------------------------------------------------------------


def _text_of(content: Any, param: str) -> str:
    """The text of an input message's content (a string or input/output text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(param, "a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _refuse(f"{param}.{j}.type", f"only input_text and output_text parts are supported, got {kind!r}")
    return "".join(texts)


def _field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _refuse(f"{param}.{name}", "a string is required")
    return value


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `input`: function calls of one turn in one assistant message, their
    outputs as tool messages, reasoning items on the assistant turn."""
    messages: list[dict[str, Any]] = []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    reasoning: list[str] = []
    for i, item in enumerate(req.input):
        param, kind = f"input.{i}", item.get("type", "message")
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _refuse(f"{param}.role", f"user, system, developer or assistant, got {role!r}")
            message = {"role": role, "content": _text_of(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", param), "type": "function",
                    "function": {"name": _field(item, "name", param), "arguments": _field(item, "arguments", param)}}
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", param), "content": text})
        elif kind == "reasoning":
            reasoning += [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
        else:
            raise _refuse(f"{param}.type", f"message, function_call, function_call_output or reasoning, got {kind!r}")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise _refuse(f"tools.{i}.type", f"only function tools are supported, got {tool.get('type')!r}")
        tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return tools


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise _refuse("tool_choice", "none, auto, required or {\"type\": \"function\", \"name\": ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    if set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
        raise _refuse("text", "format (and verbosity medium) only")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    raise _refuse("text.format.type", f"text, json_object or json_schema, got {fmt.get('type')!r}")


def _reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    if not reasoning:
        return None
    if set(reasoning) - {"effort", "summary"} or reasoning.get("summary") is not None:
        raise _refuse("reasoning", "effort only (no reasoning summaries here)")
    return reasoning.get("effort")


def to_chat(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that runs `req` after `conversation` (its previous turns, the
    input's messages included); a 400 naming the Responses field."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {"model": req.model, "messages": system + conversation, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None, "tools": _tools(req),
            "tool_choice": _tool_choice(req.tool_choice), "response_format": _response_format(req.text),
            "reasoning_effort": _reasoning_effort(req.reasoning), "user": req.user or req.safety_identifier,
            "service_tier": req.service_tier, "prompt_cache_key": req.prompt_cache_key}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise renamed(validation_error(exc)) from None


def renamed(error: APIError) -> APIError:
    """A chat request's error naming the field as the Responses request spells it."""
    head, _, rest = (error.param or "").partition(".")
    if head not in _PARAMS:
        return error
    name = _PARAMS[head] + (f".{rest}" if rest else "")
    return APIError(error.status, error.message.replace(error.param or "", name, 1), name, error.code,
                    error.retry_after_s)


# -- response: from chat ---------------------------------------------------------------------------


def response_id(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def _usage(usage: Any) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    """A Response with the request's settings echoed, as OpenAI's API returns them."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": _reasoning_effort(req.reasoning), "summary": None},
            "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def render(req: ResponsesRequest, chat: ChatCompletionResponse) -> dict[str, Any]:
    """The Response of a finished chat completion."""
    rid = response_id(chat.id)
    choice = chat.choices[0]
    message = choice.message.model_dump()
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(f"rs_{rid}_0", message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(f"msg_{rid}_{len(output)}", message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(f"fc_{rid}_{len(output)}", call))
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    usage = _usage(chat.usage.model_dump() if chat.usage else None)
    return response_object(req, rid, chat.model, chat.created, status, output, usage)


class _Events:
    """The Responses events of one streamed chat completion, item by item."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model, self.created = req, model, int(time.time())
        self.rid = ""
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.req, self.rid, self.model, self.created, status, self.output, usage)

    def start(self, chat_id: str) -> list[str]:
        self.rid = response_id(chat_id)
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def _open_item(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        index = len(self.output)
        events = [self.event("response.output_item.added", output_index=index, item=item)]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.output), []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0])]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        if item["type"] != "reasoning":
            item["status"] = "completed"
        self.output.append(item)
        return [*events, self.event("response.output_item.done", output_index=index, item=item)]

    def text(self, kind: str, delta: str) -> list[str]:
        """A piece of reasoning or message text, in the open item of that kind (opened first)."""
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            item_id = f"{'rs' if kind == 'reasoning' else 'msg'}_{self.rid}_{len(self.output)}"
            item = _reasoning_item(item_id, "") if kind == "reasoning" else _message_item(item_id, "", "in_progress")
            events += self._open_item(item)
        part = self.open["content"][0]
        part["text"] += delta
        index = len(self.output)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, self.event(name, item_id=self.open["id"], output_index=index, content_index=0,
                                    delta=delta, **extra)]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat stream's tool-call delta: one with an id opens a function_call item (its name,
        maybe whole arguments); the others add to its arguments."""
        events: list[str] = []
        if delta.get("id"):
            events += self.close()
            item = _call_item(f"fc_{self.rid}_{len(self.output)}", {"id": delta["id"], "function": {
                "name": delta["function"]["name"], "arguments": ""}}, "in_progress")
            events += self._open_item(item)
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output), delta=piece))
        return events


async def stream(req: ResponsesRequest, model: str, chat_sse: AsyncIterator[str],
                 on_done: Callable[[str, list[dict[str, Any]]], None]) -> AsyncIterator[str]:
    """The Responses events of a chat completion's SSE lines (`data: {chunk}`, ending `[DONE]`);
    `on_done(response id, output items)` once the response is whole."""
    events = _Events(req, model)
    status, usage = "completed", None
    async for line in chat_sse:
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            for event in events.close():
                yield event
            yield events.event("error", code=error.get("code"), message=error.get("message"),
                               param=error.get("param"))
            yield events.event("response.failed", response={**events.response("failed"), "error": {
                "code": error.get("code") or "server_error", "message": error.get("message")}})
            return
        if not events.rid:
            for event in events.start(chunk["id"]):
                yield event
        usage = _usage(chunk.get("usage")) or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            out: list[str] = []
            if delta.get("reasoning_content"):
                out += events.text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += events.text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += events.call(call)
            if choice.get("finish_reason") == "length":
                status = "incomplete"
            for event in out:
                yield event
    for event in events.close():
        yield event
    on_done(events.rid, events.output)
    yield events.event(f"response.{status}", response=events.response(status, usage))
