"""Block tables kept across steps, so that a step's host work grows with the batch, not the cache.

A running request's row is a tensor of its block ids that is only appended to as pages are
allocated. A page list replaced by the block manager (freed on preemption, restored from the
host pool) is a new list object, which rebuilds the row; appends reuse it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from cbserve.scheduler.request import Request


@dataclass
class _Row:
    ids: list[int]  # the request's block_ids list this row mirrors (identity, not a copy)
    synced: int  # how many of its entries are in `table`
    table: torch.Tensor  # [capacity] int64; zero past `synced`


class BlockTables:
    """Rows of block ids per live request; `table()` stacks a batch's rows."""

    def __init__(self, min_width: int = 32) -> None:
        self.min_width = max(1, min_width)
        self._rows: weakref.WeakKeyDictionary[Request, _Row] = weakref.WeakKeyDictionary()

    def row(self, request: Request, width: int) -> torch.Tensor:
        """The request's block ids, zero-padded to `width` (>= its page count)."""
        ids = request.block_ids
        entry = self._rows.get(request)
        if entry is None or entry.ids is not ids or entry.synced > len(ids):
            entry = _Row(ids, 0, torch.zeros(max(self.min_width, width, len(ids)), dtype=torch.int64))
            self._rows[request] = entry
        needed = max(width, len(ids))
        if entry.table.numel() < needed:  # grow geometrically: appends stay amortised O(1)
            grown = torch.zeros(max(needed, 2 * entry.table.numel()), dtype=torch.int64)
            grown[: entry.synced] = entry.table[: entry.synced]
            entry.table = grown
        if entry.synced < len(ids):
            entry.table[entry.synced : len(ids)] = torch.tensor(ids[entry.synced :], dtype=torch.int64)
            entry.synced = len(ids)
        return entry.table[:width]

    def table(self, requests: list[Request], width: int) -> torch.Tensor:
        """[len(requests), width] int64 block table."""
        if not requests:
            return torch.zeros(0, width, dtype=torch.int64)
        return torch.stack([self.row(r, width) for r in requests])
