"""What can be known of a constraint without running it: how deeply its source nests (checked
before compiling, since xgrammar's cost grows with it), and the most bytes any output it allows
can take (so a `min_tokens` it cannot reach is refused at admission).

Nesting, measured with xgrammar 0.2.9 on the default model's 49,152-token vocabulary (2 shared
cores): a JSON schema of arrays nested 100 / 200 / 300 / 400 deep took 0.1 / 1.2 / 4.4 / 10.4 s
only to convert to a grammar (objects: 0.3 / 2.4 / - / 17 s), and depth 1,000 did not finish in
60 s; compiling objects nested 200 / 300 deep took 5 / 10 s. Regex groups and EBNF parentheses
nested 1,000 deep compiled in 2 ms, and xgrammar refuses deeper ones itself ("Nest layer exceeded
the maximum"). So the depth is bounded for every source, the same way, well below the slow range.

The longest output is read from the grammar xgrammar compiled, printed as EBNF
(`str(compiled.grammar)`): any construct not recognised here makes the bound unknown (None), so a
request is refused only when the bound is certain.
"""

from __future__ import annotations

import math
import re
from typing import Any

# ---- nesting -----------------------------------------------------------------------------------


def json_depth(spec: Any) -> int:
    """How deeply a JSON document (a parsed value or its text) nests objects and arrays."""
    if isinstance(spec, str):
        return _text_depth(spec)
    depth, stack = 0, [(spec, 1)]
    while stack:  # iterative: a deep document must not exhaust Python's recursion limit here
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else None
        if children is None:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _text_depth(text: str) -> int:
    depth = most = 0
    for bracket in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        most = max(most, depth)
    return most


def regex_depth(pattern: str) -> int:
    """How deeply a regex nests groups (escaped and bracketed parentheses are literals)."""
    depth = most = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            depth += 1
            most = max(most, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return most


def _class_end(text: str, start: int) -> int:
    """The index of the `]` closing the character class opened at `start` (a `]` right after
    `[` or `[^` is a literal)."""
    i = start + 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i


def ebnf_depth(grammar: str) -> int:
    """How deeply an EBNF grammar nests parentheses (outside strings, classes and comments)."""
    depth = most = 0
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"':
            i = _string_end(grammar, i)
        elif c == "[":
            i = _class_end(grammar, i)
        elif c == "#":  # a comment, to the end of its line
            end = grammar.find("\n", i)
            i = n if end < 0 else end
        elif c == "(":
            depth += 1
            most = max(most, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return most


def _string_end(text: str, start: int) -> int:
    i = start + 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i


def nesting(kind: str, source: str | Any) -> int:
    """The nesting depth of a constraint's source (`kind` as in `structured.KINDS`)."""
    if kind == "json_schema":
        return json_depth(source)
    if kind == "regex":
        return regex_depth(source)
    if kind == "grammar":
        return ebnf_depth(source)
    return 0  # json_object is fixed; a choice list is escaped into a flat alternation


# ---- the longest output ------------------------------------------------------------------------


class _Unknown(Exception):
    """A construct this reader does not know: the bound is unknown, nothing is refused."""


_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPEAT = re.compile(r"\{(\d+), (-?\d+)\}")


def max_output_bytes(ebnf: str, root: str = "root") -> int | None:
    """The most UTF-8 bytes of any string the printed grammar `ebnf` accepts; None when that is
    unbounded or not certain (a construct not read here)."""
    rules: dict[str, str] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        match = _RULE.match(line)
        if match is None or match.group(1) in rules:
            return None
        rules[match.group(1)] = match.group(2)
    if root not in rules:
        return None
    try:
        bound = _Bounds(rules).rule(root)
    except (_Unknown, RecursionError):
        return None
    return None if math.isinf(bound) else int(bound)


class _Bounds:
    """Upper bounds of each rule's output bytes, read by recursive descent over the printed
    EBNF; a rule reached again while being read (recursion) is unbounded."""

    def __init__(self, rules: dict[str, str]) -> None:
        self.rules = rules
        self.done: dict[str, float] = {}
        self.open: set[str] = set()

    def rule(self, name: str) -> float:
        if name in self.done:
            return self.done[name]
        if name not in self.rules:
            raise _Unknown(name)
        if name in self.open:
            return math.inf
        self.open.add(name)
        text = self.rules[name]
        bound, end = self.choices(text, 0)
        if end < len(text):  # a trailing lookahead `(= ...)` matches no bytes
            if not text.startswith(" (=", end):
                raise _Unknown(text[end:])
            self.choices(text, end + 3)
        self.open.discard(name)
        self.done[name] = bound
        return bound

    def choices(self, text: str, i: int) -> tuple[float, int]:
        best, i = self.sequence(text, i)
        while text.startswith(" | ", i):
            bound, i = self.sequence(text, i + 3)
            best = max(best, bound)
        return best, i

    def sequence(self, text: str, i: int) -> tuple[float, int]:
        total, i = self.element(text, i)
        while i < len(text) and text[i] == " " and not text.startswith((" | ", " (="), i):
            bound, i = self.element(text, i + 1)
            total += bound
        return total, i

    def element(self, text: str, i: int) -> tuple[float, int]:
        bound, i = self.atom(text, i)
        if text.startswith("*", i):
            return (0.0 if bound == 0 else math.inf), i + 1
        repeat = _REPEAT.match(text, i)
        if repeat is not None:
            most = int(repeat.group(2))
            return (math.inf if most < 0 and bound > 0 else bound * max(most, 0)), repeat.end()
        return bound, i

    def atom(self, text: str, i: int) -> tuple[float, int]:
        if text.startswith('"', i):
            end = _string_end(text, i)
            return _string_bytes(text[i + 1:end]), end + 1
        if text.startswith("[", i):
            end = _class_end(text, i)
            return _class_bytes(text[i + 1:end]), end + 1
        if text.startswith("(", i) and not text.startswith("(=", i):
            bound, end = self.choices(text, i + 1)
            if not text.startswith(")", end):
                raise _Unknown(text[i:])
            return bound, end + 1
        name = _NAME.match(text, i)
        if name is None or text.startswith("(", name.end()):  # a macro such as Regex(...) or TagDispatch(...)
            raise _Unknown(text[i:])
        return self.rule(name.group()), name.end()


_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))", re.DOTALL)


def _char_bytes(code: int) -> int:
    """UTF-8 bytes of a code point; xgrammar prints a byte above 0x7f as `\\xHH` too, so 2 bounds both."""
    return 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4


def _codes(text: str) -> list[int]:
    """The code points of printed string or class text, escapes decoded."""
    codes: list[int] = []
    i = 0
    while i < len(text):
        escape = _ESCAPE.match(text, i)
        if escape is None:
            codes.append(ord(text[i]))
            i += 1
            continue
        hexa = escape.group(1) or escape.group(2) or escape.group(3)
        codes.append(int(hexa, 16) if hexa else 0)  # `\n`, `\"`, `\-`, ...: one ASCII byte
        i = escape.end()
    return codes


def _string_bytes(text: str) -> float:
    return float(sum(_char_bytes(code) for code in _codes(text)))


def _class_bytes(text: str) -> float:
    """One character of the class: its widest member's bytes (4 for a negated class)."""
    if text.startswith("^"):
        return 4.0
    codes = _codes(text)
    return float(_char_bytes(max(codes))) if codes else 0.0


def choice_max_bytes(choices: list[str]) -> int:
    return max(len(c.encode("utf-8")) for c in choices)
