"""CUDA graphs of forward passes: capture once per padded shape, then replay.

With a kernel backend (triton, flash) a step's kernels never synchronise with the host and
their launch grids depend only on tensor shapes, so a whole forward pass can be captured. Two
kinds of steps are captured, each switched on by `use_cuda_graph`:

- decode: a decode-only batch on the fast path (`max_blocks_per_request` block-table width).
  Its shape is its number of requests, padded up to a bucket (multiples of
  `q_padding_interval_size`, else powers of two). Padding rows write no K/V (slot -1), attend
  to one position of page 0 and are never sampled.
- varlen: any other kernel step (prefill chunks, mixed prefill + decode) of at most
  `VARLEN_GRAPH_MAX_TOKENS` tokens. Its tokens are padded like a decode batch's requests, its
  block-table width (the longest context) up to a multiple of `kv_padding_interval_size`
  tokens, else a power of two of pages. The padding tokens belong to one extra request with no
  cached context (its attention outputs zeros) and store no K/V; the request rows after it are
  empty. A padded shape holds every batch that fits it, whatever its number of requests.

Each step copies its inputs into the shape's static buffers, then replays. Larger varlen steps
(compute-bound: launch overhead is noise there) and shapes past `MAX_VARLEN_GRAPHS` run eagerly.

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

VARLEN_GRAPH_MAX_TOKENS = 512  # like vLLM's largest captured size: bigger steps are compute-bound
MAX_VARLEN_GRAPHS = 64  # captured varlen shapes; later new shapes run eagerly

Replay = Callable[[], None]
GraphFactory = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]


def cuda_graph_factory(device: torch.device) -> GraphFactory:
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


@dataclasses.dataclass(frozen=True)
class Shape:
    """A captured shape: `tokens` query rows, `requests` request rows, `width` pages per row."""

    decode: bool
    tokens: int
    requests: int
    width: int


class _Buffers:
    """The static inputs of one shape; a replay reads only these."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        t, b = shape.tokens, shape.requests
        self.input_ids = torch.zeros(1, t, dtype=torch.int64, device=device)
        self.position_ids = torch.zeros(1, t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, shape.width, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(b + 1, dtype=torch.int32, device=device)
        self.logits_to_keep = torch.zeros(b, dtype=torch.int64, device=device)
        if shape.decode:  # one query per row, padding rows included
            self.cu_seqlens_q.copy_(torch.arange(b + 1, dtype=torch.int32))

    def load(self, kwargs: dict, shape: Shape) -> None:
        """Copy a step's inputs in and set the padding rows (device-side copies only)."""
        meta: AttentionMetadata = kwargs["cb_meta"]
        ki = meta.kernel_inputs
        t, b, w = kwargs["input_ids"].shape[1], ki.context_lens.numel(), ki.block_tables.shape[1]
        s = kwargs["logits_to_keep"].numel()
        self.input_ids[0, :t].copy_(kwargs["input_ids"][0], non_blocking=True)
        self.position_ids[0, :t].copy_(kwargs["position_ids"][0], non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:b, :w].copy_(ki.block_tables, non_blocking=True)
        self.context_lens[:b].copy_(ki.context_lens, non_blocking=True)
        self.logits_to_keep[:s].copy_(kwargs["logits_to_keep"], non_blocking=True)
        self.input_ids[0, t:].zero_()
        self.position_ids[0, t:].zero_()
        self.slot_mapping[t:].fill_(-1)
        self.block_tables[:b, w:].zero_()
        self.block_tables[b:].zero_()
        self.logits_to_keep[s:].zero_()
        if shape.decode:  # padding rows see one position of page 0
            self.context_lens[b:].fill_(1)
        else:  # request row b owns the padding tokens with no context: its attention is zero
            self.cu_seqlens_q[: b + 1].copy_(ki.cu_seqlens_q, non_blocking=True)
            self.cu_seqlens_q[b + 1 :].fill_(shape.tokens)
            self.context_lens[b:].zero_()


class StepGraphs:
    """Captures and replays forward passes of padded shapes (see the module docstring)."""

    def __init__(self, forward: Callable[[dict, bool], torch.Tensor], *, max_requests: int, max_tokens: int,
                 decode_width: int, page_size: int, q_padding_interval: int, kv_padding_interval: int,
                 decode: bool, varlen: bool, device: torch.device, graph_factory: GraphFactory) -> None:
        self.forward = forward  # (kwargs, decode_only) -> logits [rows, vocab]
        self.max_requests = max_requests
        self.decode_width = decode_width if decode else 0
        self.page_size = page_size
        self.q_padding_interval = q_padding_interval
        self.kv_padding_interval = kv_padding_interval
        self.max_varlen_tokens = bucket(min(VARLEN_GRAPH_MAX_TOKENS, max_tokens), q_padding_interval) if varlen else 0
        self.device = device
        self.graph_factory = graph_factory
        self._graphs: dict[Shape, tuple[_Buffers, Replay, torch.Tensor]] = {}
        self._full_logged = False

    @property
    def num_varlen_graphs(self) -> int:
        return sum(not shape.decode for shape in self._graphs)

    def shape_of(self, meta: AttentionMetadata, num_tokens: int) -> Shape | None:
        """The padded shape that holds this step, or None when it runs eagerly."""
        ki = meta.kernel_inputs
        if ki is None or ki.context_lens.numel() > self.max_requests:
            return None
        if meta.fast_decode and self.decode_width and ki.block_tables.shape[1] == self.decode_width:
            rows = min(bucket(meta.num_decodes, self.q_padding_interval), self.max_requests)
            return Shape(True, rows, rows, self.decode_width)
        if num_tokens > self.max_varlen_tokens:
            return None
        tokens = bucket(num_tokens, self.q_padding_interval)
        context = ki.block_tables.shape[1] * self.page_size
        if self.kv_padding_interval:
            width = -(-bucket(context, self.kv_padding_interval) // self.page_size)
        else:
            width = bucket(ki.block_tables.shape[1], 0)
        # Every request has at least one token, and the padding request needs one: `tokens` rows.
        return Shape(False, tokens, min(tokens, self.max_requests + 1), width)

    def run(self, kwargs: dict) -> torch.Tensor | None:
        """Logits [num_sampled, vocab] through a graph, or None when this step runs eagerly."""
        meta: AttentionMetadata = kwargs["cb_meta"]
        shape = self.shape_of(meta, kwargs["input_ids"].shape[1])
        if shape is None:
            return None
        if shape not in self._graphs:
            if not shape.decode and self.num_varlen_graphs >= MAX_VARLEN_GRAPHS:
                if not self._full_logged:
                    logger.info("%d varlen CUDA graphs captured: new varlen shapes run eagerly", MAX_VARLEN_GRAPHS)
                    self._full_logged = True
                return None
            logger.info("capturing the CUDA graph of %s", shape)
            buffers = _Buffers(shape, self.device)
            buffers.load(kwargs, shape)
            self._graphs[shape] = (buffers, *self.graph_factory(self._static_forward(shape, buffers, meta)))
        buffers, replay, logits = self._graphs[shape]
        buffers.load(kwargs, shape)
        replay()
        return logits[: kwargs["logits_to_keep"].numel()]

    def _static_forward(self, shape: Shape, buffers: _Buffers, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        """The forward of `shape`, reading only its static buffers."""
        static_meta = dataclasses.replace(
            meta,
            slot_mapping=buffers.slot_mapping,
            num_decodes=shape.requests if shape.decode else 0,
            decode_block_table=None,
            decode_context_lens=None,
            prefills=[],
            kernel_inputs=KernelInputs(
                meta.kernel_inputs.kernels, buffers.block_tables, buffers.context_lens, buffers.cu_seqlens_q,
                decode_only=shape.decode,
                # Upper bounds baked into the graph (flash-attn sizes its grid by them).
                max_seqlen_q=1 if shape.decode else shape.tokens, max_seqlen_k=shape.width * self.page_size,
            ),
            _decode_kv={},
        )
        kwargs = {
            "input_ids": buffers.input_ids,
            "position_ids": buffers.position_ids,
            "logits_to_keep": buffers.logits_to_keep,
            "cb_meta": static_meta,
            "use_cache": False,
        }
        return lambda: self.forward(kwargs, shape.decode)


def graph_kinds(wanted: bool | tuple | None, device: torch.device, full_kernels: bool,
                fast_path: bool) -> tuple[bool, bool]:
    """(varlen, decode) from `use_cuda_graph`: one bool for both, a pair, or None for each kind on
    CUDA where it can run (transformers' rule for kernels that need no attention mask): varlen
    steps with a kernel backend, decode steps with the fast path too."""
    varlen, decode = wanted if isinstance(wanted, tuple) else (wanted, wanted)
    on_cuda = device.type == "cuda" and full_kernels
    return (on_cuda if varlen is None else bool(varlen),
            on_cuda and fast_path if decode is None else bool(decode))


def build_step_graphs(config, runner, attention_backend: str, max_requests: int,
                      max_batch_tokens: int) -> StepGraphs | None:
    """CUDA graphs as `use_cuda_graph` asks (`graph_kinds`); an explicit ask that cannot run is
    refused, saying why."""
    # Graphs replay the kernels' block-table path; the sdpa/cpu paths hold host control flow.
    full_kernels = runner.kernels is not None and runner.kernels.varlen is not None
    varlen, decode = graph_kinds(config.use_cuda_graph, runner.device, full_kernels,
                                 runner.max_blocks_per_request > 0)
    if not (decode or varlen):
        return None
    if not full_kernels:
        raise ValueError("use_cuda_graph needs a kernel attention backend (triton or flash), "
                         f"got {attention_backend!r}")
    if decode and runner.max_blocks_per_request == 0:
        raise ValueError("use_cuda_graph for decode steps needs the decode fast path: max_blocks_per_request "
                         "must be > 0 (it is forced to 0 for sliding-window models); use_cuda_graph=(True, False) "
                         "captures varlen steps only")
    graphs = StepGraphs(
        runner.forward, max_requests=max_requests, max_tokens=max_batch_tokens,
        decode_width=runner.max_blocks_per_request, page_size=runner.page_size,
        q_padding_interval=config.q_padding_interval_size, kv_padding_interval=config.kv_padding_interval_size,
        decode=decode, varlen=varlen, device=runner.device, graph_factory=cuda_graph_factory(runner.device),
    )
    logger.info("CUDA graphs on: decode %s (up to %d requests, %d pages each), varlen %s (up to %d tokens)",
                decode, max_requests, runner.max_blocks_per_request, varlen, graphs.max_varlen_tokens)
    return graphs
