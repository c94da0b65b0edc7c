"""Chats through the model's chat template, tools included.

The front turns OpenAI messages into the dicts chat templates read (`template_messages`): text
content, an assistant's `tool_calls` with their arguments as objects (what Hermes-style templates
such as Qwen's expect), a tool message's `tool_call_id`. The replica renders them with
`tools=` (`chat_token_ids`).

A template that does not mention `tools` (SmolLM2's, for one) would drop them silently, so for
such a template the tools are described in the system message in the Hermes format that most
open models are trained on (`<tools>` JSON, calls as `<tool_call>{json}</tool_call>`), earlier
calls are written into the assistant's text the same way, and tool results are wrapped in
`<tool_response>`: the model sees the whole exchange either way.
"""

from __future__ import annotations

import json
from typing import Any

from cbserve.errors import InvalidRequestError

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags as follows:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON (templates render objects), else as sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI chat messages (`schemas.ChatMessage`) as the dicts a chat template reads."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else json.dumps(template or "")


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}) + "\n</tool_call>"


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat written out in the Hermes format, for a template that knows no tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + [_call_text(c) for c in calls])
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
        out.append(m)
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def tool_format(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str:
    """How the model writes tool calls, read off its chat template (`front/tool_formats.py`):
    Hermes' `<tool_call>` unless the template renders the tools itself in another format."""
    source = _template_source(tokenizer) if tools else ""
    if "tools" not in source or "<tool_call>" in source:  # no tools, or ours: the Hermes prompt
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "[func_name1(" in source:
        return "pythonic"
    if "<|python_tag|>" in source or "respond with a JSON for a function call" in source:
        return "llama3_json"
    return "hermes"


def has_think_tags(tokenizer: Any) -> bool:
    """Whether the chat template writes `<think>` blocks (a thinking model: its output is split)."""
    return "<think>" in _template_source(tokenizer)


def has_thinking_switch(tokenizer: Any) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3's switch, what reasoning_effort sets)."""
    return "enable_thinking" in _template_source(tokenizer)


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   add_special_tokens: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat's prompt token ids (by default: with the generation prompt, and no special tokens
    beyond the template's own); `template_kwargs`: variables for the template. Raises
    InvalidRequestError("messages", ...) when the template cannot render them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("messages", "messages: this model has no chat template; use /v1/completions")
    source = _template_source(tokenizer)
    needs_hermes = bool(tools and "tools" not in source) or (
        "tool_calls" not in source and any(m.get("tool_calls") or m["role"] == "tool" for m in messages))
    if needs_hermes:
        messages = hermes_messages(messages, tools)
    kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools and not needs_hermes else {})}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as exc:  # jinja errors for roles the template refuses, etc.
        raise InvalidRequestError("messages", f"messages: the chat template refused them: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
