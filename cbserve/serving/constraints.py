"""Structured outputs on the serving side: which constraint an OpenAI request asks for, the
grammar that forces a tool call, and the replica's compiler.

A request names at most one constraint, in any of the forms OpenAI and vLLM accept:
`response_format` (`json_object`, `json_schema`; `text` is no constraint), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, or vLLM's newer `structured_outputs` object.
A `tool_choice` of `required` or a named function is a constraint too (a JSON schema built from
the functions' parameters), so the call always parses and its arguments validate.

The replica compiles a constraint with `cbserve.StructuredOutputs` (xgrammar; built once per
replica, on first use), on its bounded compile threads, so the event loop keeps streaming other
requests and one slow compile holds up no other (`workers/structured.CompilePool`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.serving.front.schemas import ChatCompletionRequest, StructuredFields
from cbserve.serving.protocol import Constraint


def _given(req: StructuredFields) -> list[Constraint]:
    """Every constraint the request names, each with its field."""
    found: list[Constraint] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(Constraint(kind="json_object", field="response_format"))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        found.append(Constraint(kind="json_schema", spec=rf.json_schema.json_schema,
                                field="response_format.json_schema.schema"))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(Constraint(kind=kind, spec=value, field=name))  # type: ignore[arg-type]
    so = req.structured_outputs
    if so is not None:
        for name, kind, value in (("json", "json_schema", so.json_), ("regex", "regex", so.regex),
                                  ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar)):
            if value is not None:
                found.append(Constraint(kind=kind, spec=value, field=f"structured_outputs.{name}"))  # type: ignore[arg-type]
        if so.json_object:
            found.append(Constraint(kind="json_object", field="structured_outputs.json_object"))
    return found


def requested(req: StructuredFields) -> Constraint | None:
    """The request's one constraint, or None; two or more are refused naming the second."""
    found = _given(req)
    if len(found) > 1:
        raise InvalidRequestError(found[1].field, f"{found[1].field}: only one output constraint per request; "
                                  f"{found[0].field} is given too")
    return found[0] if found else None


# ---- tool calls --------------------------------------------------------------------------------

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """One call of function `name`: `{"name": name, "arguments": {...}}` (the JSON inside a
    Hermes `<tool_call>`), its arguments validating against the function's parameters."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or EMPTY_PARAMETERS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_choice_mode(req: ChatCompletionRequest) -> str:
    """"none", "auto", "required" or "named"; refuses a choice that names no given tool."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    if not req.tools and choice != "none":
        raise InvalidRequestError("tool_choice", "tool_choice: needs `tools`")
    if isinstance(choice, str):
        return choice
    names = [t.function.name for t in req.tools or []]
    if choice.function.name not in names:
        raise InvalidRequestError("tool_choice", f"tool_choice: no tool named {choice.function.name!r} in tools "
                                  f"({', '.join(names)})")
    return "named"


MAX_PARALLEL_CALLS = 8


def tool_constraint(req: ChatCompletionRequest, mode: str) -> Constraint | None:
    """The grammar of a forced call: one call of the named function, or (required) a JSON list
    of one or more calls of any of the tools: one when `parallel_tool_calls` is false, at most
    MAX_PARALLEL_CALLS else (a model that repeats its call must still close the list, long before
    a max_tokens that defaults to the context left)."""
    if mode == "named":
        name = req.tool_choice.function.name  # type: ignore[union-attr]
        fn = next(t.function for t in req.tools or [] if t.function.name == name)
        return Constraint(kind="json_schema", spec=call_schema(fn.name, fn.parameters), field="tools")
    if mode == "required":
        calls = [call_schema(t.function.name, t.function.parameters) for t in req.tools or []]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        schema["maxItems"] = MAX_PARALLEL_CALLS if req.parallel_tool_calls else 1
        return Constraint(kind="json_schema", spec=schema, field="tools")
    return None


# ---- the replica's compiler --------------------------------------------------------------------


class Grammars:
    """One replica's compiler of constraints, for its tokenizer and model: built on first use;
    `config`: the engine's, whose `grammar_*` fields bound each compile (the defaults when None)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | list[int] | None,
                 config: Any = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self._stop_ids = eos or None
        self._config = config
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _structured(self) -> Any:
        with self._lock:
            if self._compiler is None:
                from cbserve.workers.structured import StructuredOutputs

                self._compiler = StructuredOutputs(self._tokenizer, self._vocab_size, self._stop_ids, self._config)
            return self._compiler

    async def compile_in_thread(self, constraint: Constraint) -> Any:
        """The compiled grammar, off the event loop (a large schema takes tens of milliseconds): the
        compile runs on the compiler's own bounded threads, awaited without holding one here.
        Raises InvalidRequestError naming the constraint's field, or QueueFullError (an overload)
        when no compile thread comes free in time."""
        structured = self._compiler or await asyncio.to_thread(self._structured)
        return await structured.compile_async(constraint.kind, constraint.spec, constraint.field)
