"""Chained hashes of a prompt's leading chunks, the key of prefix-affinity routing.

Hash i covers chunks 0..i, so two prompts share hash i exactly when (barring collisions) they
share their first i+1 chunks. Text prompts are chunked by characters (the ingress does not
tokenize), token-id prompts by tokens. A prompt shorter than one chunk has no hashes and is
routed by load alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _digest(parent: int, payload: bytes) -> int:
    h = hashlib.blake2b(payload, digest_size=8, key=parent.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(prompt: str | Sequence[int], chunk: int, max_chunks: int) -> list[int]:
    if isinstance(prompt, str):
        pieces = [prompt[i : i + chunk].encode() for i in range(0, len(prompt) - chunk + 1, chunk)]
    else:
        ids = list(prompt)
        pieces = [
            b"ids:" + b",".join(str(t).encode() for t in ids[i : i + chunk])
            for i in range(0, len(ids) - chunk + 1, chunk)
        ]
    out: list[int] = []
    parent = 0
    for piece in pieces[:max_chunks]:
        parent = _digest(parent, piece)
        out.append(parent)
    return out


def cache_key_hashes(key: str) -> list[int]:
    """A client's `prompt_cache_key` as the routing key: one hash, so requests of one key share
    a replica (and its prefix cache) whatever their prompts."""
    return [_digest(0, b"prompt_cache_key:" + key.encode())]


def chat_routing_text(messages: list[dict[str, str]]) -> str:
    """A text that shares a prefix between two conversations exactly when their messages do."""
    return "".join(f"<{m.get('role', '')}>{m.get('content', '')}\n" for m in messages)
