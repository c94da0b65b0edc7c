"""N-gram proposals for speculative decoding (prompt lookup): the tokens that followed the latest
earlier occurrence of a request's last n tokens, in its prompt or its output, longest n first.

Copy-heavy generations (quoting, editing, extracting, code) repeat long runs of their context;
there the proposals are often right, and a step that verifies k of them costs about what a
one-token step costs while reading the weights dominates. Tokens and counts only: no torch.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cbserve.config import SpeculativeConfig
from cbserve.scheduler.request import Request


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """At most `min(limit, num_speculative_tokens)` tokens to follow each request's tokens; []
        when no n-gram of the configured sizes recurs."""
        return [self.lookup(r.tokens, limit) for r, limit in zip(requests, limits)]

    def distributions(self, request_id: str) -> None:
        """A lookup is deterministic: point masses."""

    def forget(self, request_id: str) -> None:
        """No state per request."""

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        k = min(limit, self.num_tokens)
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        context = np.asarray(tokens)
        earlier = context[:-1]  # windows ending before the last token: the suffix itself never matches
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            hits = np.flatnonzero((sliding_window_view(earlier, n) == context[-n:]).all(axis=1))
            if hits.size:
                # The latest occurrence (the likeliest to continue alike) among those followed by
                # k tokens, else the earliest (the longest continuation): in a loop ("x x x x")
                # the latest is followed by one token.
                whole = hits[hits + n + k <= len(tokens)]
                start = int(whole[-1] if whole.size else hits[0]) + n
                return context[start : start + k].tolist()
        return []
