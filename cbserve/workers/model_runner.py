"""Turns a scheduled batch into one packed forward pass of the `transformers` model."""

from __future__ import annotations

import torch

from cbserve.kernels.paged_attention import AttentionMetadata, PrefillChunk
from cbserve.scheduler.scheduler import ScheduledRequest
from cbserve.workers.compilation import CompiledForward
from cbserve.workers.kv_cache import PagedKVCache


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache,
                 forward: CompiledForward | None = None) -> None:
        self.model = model
        self.forward = forward or CompiledForward(model, None, None)
        self.cache = cache
        self.page_size = cache.page_size
        self.device = cache.device

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) of a request with block ids `table`."""
        positions = torch.arange(start, end)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def prepare(self, batch: list[ScheduledRequest]) -> tuple[dict, list[ScheduledRequest]]:
        """Packed inputs with decode rows first; returns the forward kwargs and the requests
        whose last logits are sampled, in the order of the logits rows."""
        def is_decode(s: ScheduledRequest) -> bool:
            return s.num_query_tokens == 1 and s.sample and s.request.num_computed > 0

        decodes = [s for s in batch if is_decode(s)]
        prefills = [s for s in batch if not is_decode(s)]
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []

        decode_table = decode_lens = None
        if decodes:
            lens = [s.request.num_computed + 1 for s in decodes]
            max_pages = -(-max(lens) // self.page_size)
            decode_table = torch.zeros(len(decodes), max_pages, dtype=torch.int64)
            for i, s in enumerate(decodes):
                ids = s.request.block_ids[:max_pages]
                decode_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
                input_ids.append(s.request.tokens[s.request.num_computed])
            decode_lens = torch.tensor(lens)
            last = decode_lens - 1
            positions.append(last)
            last_pages = decode_table.gather(1, (last // self.page_size)[:, None]).squeeze(1)
            slot_parts.append(last_pages * self.page_size + last % self.page_size)
            sample_rows.extend(range(len(decodes)))
            sampled.extend(decodes)

        chunks: list[PrefillChunk] = []
        row = len(decodes)
        for s in prefills:
            req, n = s.request, s.num_query_tokens
            start = req.num_computed
            input_ids.extend(req.tokens[start : start + n])
            positions.append(torch.arange(start, start + n))
            table = torch.tensor([req.block_ids], dtype=torch.int64)
            slot_parts.append(self._slots(table[0], start, start + n))
            chunks.append(PrefillChunk(row, row + n, start, table, self.page_size))
            row += n
            if s.sample:
                sample_rows.append(row - 1)
                sampled.append(s)

        meta = AttentionMetadata(
            k_caches=self.cache.k,
            v_caches=self.cache.v,
            slot_mapping=torch.cat(slot_parts).to(self.device),
            page_size=self.page_size,
            num_decodes=len(decodes),
            decode_block_table=decode_table,
            decode_context_lens=decode_lens,
            prefills=chunks,
        )
        kwargs = {
            "input_ids": torch.tensor([input_ids], device=self.device),
            "position_ids": torch.cat(positions)[None].to(self.device),
            "logits_to_keep": torch.tensor(sample_rows or [0], device=self.device),
            "cb_meta": meta,
            "use_cache": False,
        }
        return kwargs, sampled

    @torch.inference_mode()
    def run(self, kwargs: dict) -> torch.Tensor:
        """Logits [num_sampled, vocab] in float32 for the prepared batch."""
        return self.forward(kwargs, decode_only=not kwargs["cb_meta"].prefills).float()
