"""Turns a scheduled batch into one packed forward pass of the `transformers` model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbserve.kernels.attention_backends import KernelBackend
from cbserve.kernels.paged_attention import AttentionMetadata, KernelInputs, PrefillChunk
from cbserve.scheduler.request import Request
from cbserve.scheduler.scheduler import ScheduledRequest
from cbserve.workers.async_batching import InFlightStep
from cbserve.workers.block_table import BlockTables
from cbserve.workers.compilation import CompiledForward
from cbserve.workers.cuda_graphs import StepGraphs
from cbserve.workers.input_staging import InputStaging
from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.lora_slots import LoraSlots


@dataclass
class _Rows:
    """A step's packed rows as they are built: token ids, positions, KV slots, sampled rows."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits give prompt logprobs
    pooled_rows: list[int] = field(default_factory=list)  # rows whose final hidden state is pooled


def is_decode(s: ScheduledRequest) -> bool:
    return s.num_query_tokens == 1 and s.sample and s.request.num_computed > 0


def num_sampled_rows(sampled: list[ScheduledRequest]) -> int:
    """Logits rows of `prepare`'s sampled requests: one each, and one per proposed token."""
    return sum(1 + len(s.draft) for s in sampled)


class ModelRunner:
    """`prepare()` builds the packed inputs; `run()` calls the (compiled) model.

    `max_blocks_per_request` > 0 enables the decode fast path: a decode-only batch whose
    requests all fit in that many pages gets a block table of exactly that width (a static
    shape that CUDA graphs can capture) and goes to the backend's paged decode kernel.
    """

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, forward: CompiledForward | None = None,
                 kernels: KernelBackend | None = None, max_blocks_per_request: int = 0) -> None:
        self.model = model
        self.forward = forward or CompiledForward(model, None, None)
        self.cache = cache
        self.page_size = cache.page_size
        self.device = cache.device
        self.kernels = kernels
        self.max_blocks_per_request = max_blocks_per_request
        self.tables = BlockTables(max_blocks_per_request or 32)
        self.graphs: StepGraphs | None = None  # set by the engine when CUDA graphs are on
        self.lora: LoraSlots | None = None  # set by the factory with enable_lora
        self._float_logits = torch.empty(0)  # `_as_float`'s buffer
        # The last prepared step's prompt-logprob rows, after its sampled rows in the logits:
        # (request, first prompt position they predict, how many).
        self.prompt_chunks: list[tuple[ScheduledRequest, int, int]] = []
        self.has_drafts = False  # the last prepared step verifies proposed tokens
        # The last prepared step's embedding requests and the positions they pool (`pooling.py`),
        # the rows of `pooled_rows` (on the device) in that order; run() sets `hidden` to those
        # rows' final hidden states.
        self.pool_chunks: list[tuple[Request, range]] = []
        self.pooled_rows: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        # Pinned double-buffered copies on CUDA; on a CPU, .to() is a no-op.
        self.staging = InputStaging(self.device) if self.device.type == "cuda" else None

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) of a request whose block ids are `table`."""
        positions = torch.arange(start, end)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def prepare(self, batch: list[ScheduledRequest], in_flight: InFlightStep | None = None
                ) -> tuple[dict, list[ScheduledRequest]]:
        """Packed inputs with decode rows first; returns the forward kwargs and the requests
        whose last logits are sampled, in the order of the logits rows (`num_sampled_rows`).

        Host work is O(batch + new tokens): block tables come from `BlockTables` rows that only
        grow by the pages allocated since the last step. With async batching, a decode row whose
        token the host has not seen yet takes it from `in_flight`'s tokens, on the device.
        """
        decodes = [s for s in batch if is_decode(s)]
        prefills = [s for s in batch if not is_decode(s)]
        ordered = self._set_adapters(decodes + prefills)
        context_lens = [s.request.num_computed + s.num_query_tokens for s in ordered]
        width = -(-max(context_lens) // self.page_size)
        fast = bool(decodes) and not prefills and 0 < width <= self.max_blocks_per_request
        if fast:
            width = self.max_blocks_per_request
        table = self.tables.table([s.request for s in ordered], width)
        lens = torch.tensor(context_lens)
        device_rows = self._decode_rows(rows := _Rows(), decodes, table, lens)
        chunks = self._prefill_rows(rows, prefills, table, len(decodes))  # sets prompt_chunks
        # Every integer input goes to the device in one call (one staged copy on CUDA).
        full_kernels = self.kernels is not None and self.kernels.varlen is not None
        host = [torch.tensor(rows.input_ids), torch.cat(rows.positions), torch.cat(rows.slots),
                torch.tensor(rows.sample_rows + rows.prompt_rows or [0])]
        if full_kernels:
            cu_seqlens_q = torch.zeros(len(ordered) + 1, dtype=torch.int32)
            torch.cumsum(torch.tensor([s.num_query_tokens for s in ordered]), 0, out=cu_seqlens_q[1:])
            host += [table, lens.to(torch.int32), cu_seqlens_q]
        if device_rows:
            sources = in_flight.rows
            host += [torch.tensor(device_rows), torch.tensor([sources[id(decodes[r].request)] for r in device_rows])]
        ids, position_ids, slot_mapping, logits_to_keep, *rest = self._to_device(host)
        kernel_inputs = None
        if full_kernels:
            block_tables, kv_lens, cu_seqlens, *rest = rest
            kernel_inputs = KernelInputs(
                self.kernels, block_tables, kv_lens, cu_seqlens, decode_only=not prefills,
                max_seqlen_q=max(s.num_query_tokens for s in ordered), max_seqlen_k=max(context_lens),
            )
        if device_rows:  # async batching: those tokens come from the launched step, on the device
            rows_on_device, source_rows = rest
            ids[rows_on_device] = in_flight.tokens[source_rows]
        nd = len(decodes)
        meta = AttentionMetadata(
            k_caches=self.cache.k,
            v_caches=self.cache.v,
            slot_mapping=slot_mapping,
            page_size=self.page_size,
            num_decodes=nd,
            decode_block_table=table[:nd] if nd else None,
            decode_context_lens=lens[:nd] if nd else None,
            prefills=chunks,
            kernel_inputs=kernel_inputs,
            decode_kernel=self.kernels.decode if self.kernels is not None and kernel_inputs is None else None,
            fast_decode=fast,
        )
        kwargs = {"input_ids": ids[None], "position_ids": position_ids[None], "logits_to_keep": logits_to_keep,
                  "cb_meta": meta, "use_cache": False}
        return kwargs, decodes + [s for s in prefills if s.sample]

    def _set_adapters(self, ordered: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """With LoRA, each row's adapter for the pass's adapted projections; returns `ordered`."""
        if self.lora is not None:
            self.lora.prepare([(s.request.lora_id, s.num_query_tokens) for s in ordered])
        return ordered

    def _decode_rows(self, rows: _Rows, decodes: list[ScheduledRequest], table: torch.Tensor,
                     lens: torch.Tensor) -> list[int]:
        """One row per decode request; returns the rows whose token is still on the device."""
        device_rows: list[int] = []
        for row, s in enumerate(decodes):
            req = s.request
            on_host = req.num_computed < len(req.tokens)
            rows.input_ids.append(req.tokens[req.num_computed] if on_host else 0)
            if not on_host:
                device_rows.append(row)
        nd = len(decodes)
        rows.sample_rows.extend(range(nd))
        if nd:
            last = lens[:nd] - 1
            rows.positions.append(last)
            last_pages = table[:nd].gather(1, (last // self.page_size)[:, None]).squeeze(1)
            rows.slots.append(last_pages * self.page_size + last % self.page_size)
        return device_rows

    def _prefill_rows(self, rows: _Rows, prefills: list[ScheduledRequest], table: torch.Tensor,
                      first: int) -> list[PrefillChunk]:
        """A chunk of rows per prefill request (block-table rows from `first` on)."""
        chunks: list[PrefillChunk] = []
        self.prompt_chunks, self.pool_chunks = [], []
        self.has_drafts = any(s.draft for s in prefills)  # only decoding requests have drafts: never decode rows
        row = len(rows.input_ids)
        for i, s in enumerate(prefills, start=first):
            req, n = s.request, s.num_query_tokens
            start = req.num_computed
            rows.input_ids.extend(req.tokens[start : start + n] + s.draft)  # a draft follows the last token
            rows.positions.append(torch.arange(start, start + n))
            rows.slots.append(self._slots(table[i], start, start + n))
            chunks.append(PrefillChunk(row, row + n, start, table[i : i + 1], self.page_size))
            row += n
            if s.sample:
                rows.sample_rows.extend(range(row - 1 - len(s.draft), row))
            if req.wants_prompt_logprobs:
                self._keep_prompt_rows(rows, s, row - n)
            if req.pooling is not None and (positions := req.pooling.positions(start, n)):
                origin = row - n - start  # where position 0's row would be
                rows.pooled_rows.extend(range(origin + positions.start, origin + positions.stop))
                self.pool_chunks.append((req, positions))
        self.pooled_rows = torch.tensor(rows.pooled_rows, device=self.device) if rows.pooled_rows else None
        return chunks

    def _keep_prompt_rows(self, rows: _Rows, s: ScheduledRequest, first_row: int) -> None:
        """The chunk's row at position p predicts prompt token p + 1: keep the rows of prompt
        positions whose logprob the request still lacks (a recomputed chunk adds nothing)."""
        req, start = s.request, s.request.num_computed
        first = max(start + 1, len(req.prompt_logprobs))
        last = min(start + s.num_query_tokens, len(req.prompt_ids) - 1)
        if last >= first:
            rows.prompt_rows.extend(range(first_row + first - 1 - start, first_row + last - start))
            self.prompt_chunks.append((s, first, last - first + 1))

    def _to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.staging is not None:
            return self.staging.send(parts)
        return [p.to(self.device) for p in parts]

    @torch.inference_mode()
    def run(self, kwargs: dict) -> torch.Tensor:
        """Logits [num_sampled, vocab] in float32 for the prepared batch."""
        meta = kwargs["cb_meta"]
        plain = not self.prompt_chunks and not self.has_drafts and self.pooled_rows is None
        if self.graphs is not None and plain:  # graphs: one row per request
            logits = self.graphs.run(kwargs)
            if logits is not None:
                return logits.float()
        try:
            logits = self.forward(kwargs, decode_only=not meta.prefills, pooled_rows=self.pooled_rows)
            self.hidden = self.forward.hidden
            return self._as_float(logits)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _as_float(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits. On a CPU, half-precision logits are converted into a buffer kept from
        step to step: a fresh 25 MB tensor per step (128 rows x 49k vocabulary) cost ~4 ms of page
        faults, more than the conversion. The step consumes its logits before the next one."""
        if logits.dtype == torch.float32 or logits.device.type != "cpu":
            return logits.float()
        n = logits.numel()
        if self._float_logits.numel() < n:
            self._float_logits = torch.empty(n, dtype=torch.float32)
        return self._float_logits[:n].view(logits.shape).copy_(logits)
