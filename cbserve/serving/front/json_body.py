"""Reading an HTTP request's JSON body, free of the web framework: strict JSON (no NaN), valid
Unicode, bounded nesting, and pydantic's validation errors as OpenAI errors naming the field.
Client bytes are only ever parsed as JSON, then by pydantic: never unpickled or evaluated."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from cbserve.serving.api_errors import APIError

MAX_JSON_DEPTH = 64
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_surrogate_free(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_invalid_json_text(data: Any) -> tuple[str, str] | None:
    """(message, field) for the first string of a parsed JSON body that is not valid Unicode (a
    lone surrogate such as "\\ud800", which JSON's escapes allow), or for nesting deeper than
    MAX_JSON_DEPTH; None when the body is fine. Iterative, so any depth is safe to walk."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            top = path.split("[")[0].split(".")[0] or "body"  # the top-level field, not 64 levels of it
            return f"{top}: JSON nested deeper than {MAX_JSON_DEPTH} levels", top
        if isinstance(value, str):
            if not _is_surrogate_free(value):
                where = path or "body"
                message = f"{where}: the text contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode"
                return message, where
        elif isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{key}" if path else str(key)
                if not _is_surrogate_free(key):
                    message = f"{path or 'body'}: a key contains a lone UTF-16 surrogate, which is not valid Unicode"
                    return message, path or "body"
                stack.append((item, sub, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> Any:
    """The parsed body; raises a 400 `APIError` for bytes that are not JSON or text that is not
    valid Unicode, naming the field."""
    try:
        # NaN / Infinity are not JSON (Python's parser would accept them).
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    except RecursionError:
        raise APIError(400, "We could not parse the JSON body of your request: nested too deeply") from None
    problem = find_invalid_json_text(data)
    if problem is not None:
        message, param = problem
        raise APIError(400, message, param)
    return data


def _field_path(loc: tuple[Any, ...]) -> str | None:
    """`prompt.list[int].0` -> `prompt.0`: pydantic's union-member tags are not field names."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the field (OpenAI's `param`)."""
    errors = exc.errors()
    param = _field_path(tuple(errors[0].get("loc", ())))
    # A union (e.g. `prompt`) fails once per accepted form: say so, rather than quote one form.
    same = [e for e in errors if _field_path(tuple(e.get("loc", ())))
            and (_field_path(tuple(e.get("loc", ()))) or "").startswith(param or "\0")]
    msgs = list(dict.fromkeys(str(e.get("msg")) for e in same)) or [str(errors[0].get("msg"))]
    text = msgs[0] if len(msgs) == 1 else "matches none of the accepted forms: " + "; ".join(msgs)
    return APIError(400, (f"{param}: {text}" if param else text)[:1000], param)


def parse_request(body: bytes, schema: type[BaseModel]) -> Any:
    """A request body as `schema`; raises a 400 `APIError` naming the field."""
    try:
        return schema.model_validate(parse_json(body))
    except ValidationError as exc:
        raise validation_error(exc) from None
