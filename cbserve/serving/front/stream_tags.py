"""Tags cut across streamed chunks: how much of a text's end must be held back."""

from __future__ import annotations


def partial_tail(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
