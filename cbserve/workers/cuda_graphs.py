"""CUDA graphs for decode steps: capture once per padded batch size, then replay.

A decode-only batch on the fast path (`max_blocks_per_request` block-table width) with a kernel
backend (triton or flash) has shapes that depend only on its number of requests, and its kernels
never synchronise with the host, so the whole forward can be captured. Batch sizes are padded
up to a bucket (multiples of `q_padding_interval_size`, else powers of two) so a handful of
graphs cover every batch; the kv dimension is the fixed table width, so no kv padding is needed.

Each step copies its inputs into static buffers, then replays. Padded rows write no K/V (slot
-1), attend to one position of page 0 and are never sampled.

The graph itself is made by `graph_factory(fn)`; on CUDA it captures `fn` with
`torch.cuda.graph`; CPU tests pass a factory that re-runs `fn` eagerly on the same static
buffers, which checks all of the buffer and padding logic without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from cbserve.kernels.paged_attention import AttentionMetadata, KernelInputs
from cbserve.workers.compilation import bucket

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


def cuda_graph_factory(device: torch.device) -> Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]:
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy inits, autotuning
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    return capture


def eager_graph_factory(fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """Stand-in for CPU tests: "replay" re-runs `fn` on the static buffers into the same output."""
    out = fn().clone()
    return (lambda: out.copy_(fn())), out


class DecodeGraphs:
    def __init__(self, forward: Callable[[dict], torch.Tensor], max_requests: int, width: int,
                 padding_interval: int, device: torch.device,
                 graph_factory: Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]) -> None:
        self.forward = forward  # kwargs -> logits [rows, vocab]
        self.max_requests = max_requests
        self.width = width
        self.padding_interval = padding_interval
        self.graph_factory = graph_factory
        n = max_requests
        self.input_ids = torch.zeros(1, n, dtype=torch.int64, device=device)
        self.position_ids = torch.zeros(1, n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}

    def bucket(self, num_requests: int) -> int:
        return min(bucket(num_requests, self.padding_interval), self.max_requests)

    def accepts(self, meta: AttentionMetadata) -> bool:
        ki = meta.kernel_inputs
        return (meta.fast_decode and ki is not None and ki.block_tables.shape[1] == self.width
                and meta.num_decodes <= self.max_requests)

    def run(self, kwargs: dict) -> torch.Tensor:
        """Logits [num_requests, vocab] of a decode batch that `accepts()`."""
        meta: AttentionMetadata = kwargs["cb_meta"]
        b = meta.num_decodes
        size = self.bucket(b)
        self.input_ids[0, :b].copy_(kwargs["input_ids"][0], non_blocking=True)
        self.position_ids[0, :b].copy_(kwargs["position_ids"][0], non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:b].copy_(meta.kernel_inputs.block_tables, non_blocking=True)
        self.context_lens[:b].copy_(meta.kernel_inputs.context_lens, non_blocking=True)
        # Padding rows: no K/V written, one visible position, never sampled.
        self.input_ids[0, b:size].zero_()
        self.position_ids[0, b:size].zero_()
        self.slot_mapping[b:size].fill_(-1)
        self.block_tables[b:size].zero_()
        self.context_lens[b:size].fill_(1)
        if size not in self._graphs:
            logger.info("capturing the decode graph for %d requests", size)
            self._graphs[size] = self.graph_factory(self._static_forward(size, meta))
        replay, logits = self._graphs[size]
        replay()
        return logits[:b]

    def _static_forward(self, size: int, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        """The forward of `size` rows, reading only the static buffers."""
        static_meta = dataclasses.replace(
            meta,
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_block_table=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefills=[],
            kernel_inputs=KernelInputs(meta.kernel_inputs.kernels, self.block_tables[:size],
                                       self.context_lens[:size], self.cu_seqlens_q[: size + 1], decode_only=True),
            _decode_kv={},
        )
        kwargs = {
            "input_ids": self.input_ids[:, :size],
            "position_ids": self.position_ids[:, :size],
            "logits_to_keep": self.rows[:size],
            "cb_meta": static_meta,
            "use_cache": False,
        }
        return lambda: self.forward(kwargs)
