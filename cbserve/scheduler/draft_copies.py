"""A draft model's copies of the requests it proposes for (speculative decoding,
`workers/draft_model.py`): the draft engine's own `Request`s, whose pages in the draft's KV cache
hold the K/V of the tokens the draft has seen, kept in step with the target's requests.

Before a round of proposals a copy takes its request's tokens: the K/V of the longest common
prefix stay (the accepted proposals'), the rest is recomputed over what was there (rejected
proposals', and the last token, which is always fed for its logits). When the draft's pages run
out, the copies of requests that are not proposing this round give theirs back, least recently
used first (recomputed if they speculate again).

A request whose copy lags far behind it and that has few tokens left does not speculate: the
draft would prefill the lag to save steps on the few tokens left. On 32 mixed streams the requests
that start speculating (when fewer than `disable_by_batch_size` are left) are near their end:
catching up ~1,800 tokens took 0.75 s of an 8 s run and the tail saved less (bfloat16, a Q4_1 draft
of the target's size). A copy may lag `max_lag_per_token_left` tokens per token left: 4 for a
draft of the target's size, more for a smaller one (`draft_model.catch_up_factor`).
"""

from __future__ import annotations

from collections import OrderedDict

from cbserve.scheduler.block_manager import BlockManager
from cbserve.scheduler.request import Request


class DraftCopies:
    def __init__(self, block_manager: BlockManager, max_lag_per_token_left: float) -> None:
        self.block_manager = block_manager  # the draft engine's
        self.max_lag_per_token_left = max_lag_per_token_left
        # request id -> its copy, least recently proposed for first
        self._copies: OrderedDict[str, Request] = OrderedDict()

    def get(self, request_id: str) -> Request | None:
        return self._copies.get(request_id)

    def __len__(self) -> int:
        return len(self._copies)

    def sync(self, request: Request, k: int, proposing: set[str]) -> Request | None:
        """The request's copy, brought up to its tokens, with pages for k proposals (the last is
        not fed); None when the pages are not there even without the idle copies' pages, or the
        copy lags too far behind for the tokens the request has left."""
        copy = self._copies.get(request.request_id)
        tokens = request.tokens
        common = 0 if copy is None else min(copy.num_computed, len(tokens) - 1)
        while common > 0 and copy.tokens[common - 1] != tokens[common - 1]:  # where proposals were cut
            common -= 1
        if len(tokens) - common > self.max_lag_per_token_left * (request.max_new_tokens - len(request.generated)):
            return None
        if copy is None:
            copy = Request(request.request_id, [], 0, frozenset())
        copy.num_computed, copy.tokens[common:] = common, tokens[common:]  # the rest is the same already
        self._copies.pop(request.request_id, None)
        self._copies[request.request_id] = copy  # most recently used last
        while not self.block_manager.allocate(copy, len(tokens) + k - 1):
            idle = next((c for rid, c in self._copies.items() if rid not in proposing and c.block_ids), None)
            if idle is None:
                return None
            self.block_manager.free(idle)
        return copy

    @staticmethod
    def advance(copy: Request, token: int) -> None:
        """A pass computed the copy's pending tokens and proposed `token` (fed by the next pass)."""
        copy.num_computed = len(copy.tokens)
        copy.tokens.append(token)

    def forget(self, request_id: str) -> None:
        copy = self._copies.pop(request_id, None)
        if copy is not None:
            self.block_manager.free(copy)
