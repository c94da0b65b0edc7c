"""EngineCore: one `step()` = schedule, run the model, sample, update the requests.

It knows nothing of threads, HTTP or Ray; the manager and `generate_batch` drive it.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from cbserve.config import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_REQUESTS,
    MIN_AUTO_BATCH_TOKENS,
    ContinuousBatchingConfig,
)
from cbserve.kernels import backends, paged_attention
from cbserve.outputs import FinishReason, RequestStatus
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import Scheduler
from cbserve.workers import compilation, packed_linear
from cbserve.workers.async_batching import InFlightStep, launch_greedy
from cbserve.workers.block_manager import BlockManager
from cbserve.workers.compilation import CompiledForward
from cbserve.workers.cuda_graphs import StepGraphs, cuda_graph_factory
from cbserve.workers.kv_cache import PagedKVCache, available_memory_bytes
from cbserve.workers.model_runner import ModelRunner
from cbserve.workers.offload import HostOffloadPool, host_pool_blocks
from cbserve.workers.sampler import Sampler

logger = logging.getLogger(__name__)

# Share of free memory the KV cache takes by default: host memory on a CPU is shared with
# everything else on the machine, so it gets a smaller default than an accelerator's.
DEFAULT_MEMORY_PERCENT = {"cuda": 0.9, "cpu": 0.2}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        cfg = model.config.get_text_config()
        num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window,) * num_layers
        return cls(
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=model.get_output_embeddings().weight.shape[0],
            max_context=getattr(cfg, "max_position_embeddings", None) or 2**31,
            sliding_windows=windows,
        )

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.sliding_windows)


def eos_set(eos: int | list[int] | None) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class EngineCore:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig | None = None,
        config: ContinuousBatchingConfig | None = None,
        max_total_tokens_hint: int | None = None,
        num_requests_hint: int | None = None,
        max_request_tokens_hint: int | None = None,
    ) -> None:
        self.model = model
        self.config = config or ContinuousBatchingConfig()
        self.generation_config = generation_config or model.generation_config
        self.shape = ModelShape.from_model(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

        cfg = self.config
        pack_weights = self._should_pack_weights()  # may refuse: before the model is touched
        self.max_batch_tokens = cfg.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(self.device.type, 8192)
        page_size = cfg.page_size
        num_blocks = cfg.num_blocks or self._auto_num_blocks(max_total_tokens_hint, num_requests_hint)
        self.cache = PagedKVCache(
            self.shape.num_layers, num_blocks, page_size, self.shape.num_kv_heads,
            self.shape.head_dim, self.dtype, self.device,
        )
        # When every layer is windowed, pages older than the widest window are given back.
        windows = self.shape.sliding_windows
        self.release_window = max(windows) if all(w is not None for w in windows) else None
        if self.shape.has_sliding_layers and self.release_window is None:
            logger.info("hybrid model: sliding layers keep every page, as the full-attention layers need them")
        prefix_caching = cfg.allow_block_sharing and not self.shape.has_sliding_layers
        if cfg.allow_block_sharing and not prefix_caching:
            logger.info("prefix caching off: the model has sliding-window layers")
        self.block_manager = BlockManager(num_blocks, page_size, prefix_caching)
        max_requests = cfg.max_requests_per_batch or num_requests_hint or DEFAULT_MAX_REQUESTS
        max_requests = max(1, min(max_requests, self.max_batch_tokens, num_blocks))
        self.offload_pool = self._make_offload_pool()
        self.scheduler = Scheduler(
            self.block_manager, self.max_batch_tokens, max_requests, cfg.scheduler,
            cfg.resolved_safety_margin, self.offload_pool,
        )
        self.attention_backend = backends.select(cfg.attention_backend, self.device, page_size,
                                                 cfg.auto_switch_to_flash)
        paged_attention.register()
        self._previous_attn = model.config._attn_implementation
        model.set_attn_implementation(paged_attention.ATTENTION_NAME)
        self.runner = ModelRunner(model, self.cache, CompiledForward(
            model,
            compilation.resolve(cfg.default_compile_level, cfg.varlen_compile_config),
            compilation.resolve(cfg.default_compile_level, cfg.decode_compile_config),
            cfg.q_padding_interval_size,
        ), backends.kernels(self.attention_backend), self._fast_path_width(max_request_tokens_hint))
        self.runner.graphs = self._step_graphs(max_requests)
        self.packed_linears = packed_linear.pack_linears(model) if pack_weights else []
        # Async batching (CUDA only, refused by the config elsewhere): see async_batching.py.
        self.async_batching = bool(cfg.use_async_batching)
        if self.async_batching and self.runner.graphs is None:
            logger.warning("use_async_batching without CUDA graphs: every kernel launch stays on the host "
                           "thread, so little of the next step's preparation overlaps this one")
        self._in_flight: InFlightStep | None = None
        self.sampler = Sampler(cfg.seed)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # Seconds spent in each phase of step(), summed: host overhead vs model time.
        self.timings = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0}
        self.generated_tokens = 0
        self.prompt_tokens_computed = 0
        LIVE_ENGINES.add(self)
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MiB), max_batch_tokens=%d, max_requests=%d",
            num_blocks, page_size, self.cache.nbytes / 2**20, self.max_batch_tokens, max_requests,
        )

    def _auto_num_blocks(self, max_total_tokens_hint: int | None, num_requests_hint: int | None) -> int:
        s, cfg = self.shape, self.config
        per_block = PagedKVCache.bytes_per_block(s.num_layers, cfg.page_size, s.num_kv_heads, s.head_dim,
                                                 self.dtype)
        share = cfg.max_memory_percent or DEFAULT_MEMORY_PERCENT.get(self.device.type, 0.9)
        # The batch's input buffers (hidden states, float32 logits) come out of the budget first.
        buffers = self.max_batch_tokens * 64 * 1024 + (num_requests_hint or 256) * s.vocab_size * 4
        budget = max(available_memory_bytes(self.device) * share - buffers, per_block)
        blocks = int(budget // per_block)
        if blocks * cfg.page_size < MIN_AUTO_BATCH_TOKENS:
            raise ValueError(f"the KV cache budget fits only {blocks} pages; raise max_memory_percent")
        if max_total_tokens_hint is None:  # no workload known: what a full batch could use
            max_requests = cfg.max_requests_per_batch or num_requests_hint or DEFAULT_MAX_REQUESTS
            max_total_tokens_hint = max_requests * min(s.max_context, 1 << 16)
        # Every request rounds its last page up: up to one partly filled page per request.
        partial_pages = num_requests_hint or 1
        return min(blocks, -(-max_total_tokens_hint // cfg.page_size) + partial_pages)

    def _fast_path_width(self, max_request_tokens_hint: int | None) -> int:
        """Block-table width of the decode fast path (`max_blocks_per_request`); 0 = off."""
        width = self.config.max_blocks_per_request
        if width is None:
            width = -(-max_request_tokens_hint // self.cache.page_size) if max_request_tokens_hint else 32
        if width and self.shape.has_sliding_layers:
            logger.info("decode fast path off: the model has sliding-window layers")
            return 0
        return width

    def _step_graphs(self, max_requests: int) -> StepGraphs | None:
        """CUDA graphs as `use_cuda_graph` asks: (varlen, decode), or one bool for both. None
        means decode graphs on CUDA when possible and no varlen graphs (opt-in)."""
        cfg, runner = self.config, self.runner
        wanted = cfg.use_cuda_graph
        varlen, decode = wanted if isinstance(wanted, tuple) else (wanted, wanted)
        # Graphs replay the kernels' block-table path; the sdpa/cpu paths hold host control flow.
        full_kernels = runner.kernels is not None and runner.kernels.varlen is not None
        if decode is None:
            decode = self.device.type == "cuda" and full_kernels and runner.max_blocks_per_request > 0
        if not (decode or varlen):
            return None
        if not full_kernels:
            raise ValueError("use_cuda_graph needs a kernel attention backend (triton or flash), "
                             f"got {self.attention_backend!r}")
        if decode and runner.max_blocks_per_request == 0:
            raise ValueError("use_cuda_graph for decode steps needs the decode fast path: max_blocks_per_request "
                             "must be > 0 (it is forced to 0 for sliding-window models); use_cuda_graph=(True, False) "
                             "captures varlen steps only")
        graphs = StepGraphs(
            runner.forward, max_requests=max_requests, max_tokens=self.max_batch_tokens,
            decode_width=runner.max_blocks_per_request, page_size=self.cache.page_size,
            q_padding_interval=cfg.q_padding_interval_size, kv_padding_interval=cfg.kv_padding_interval_size,
            decode=bool(decode), varlen=bool(varlen), device=self.device, graph_factory=cuda_graph_factory(self.device),
        )
        logger.info("CUDA graphs on: decode %s (up to %d requests, %d pages each), varlen %s (up to %d tokens)",
                    bool(decode), max_requests, runner.max_blocks_per_request, bool(varlen), graphs.max_varlen_tokens)
        return graphs

    def _should_pack_weights(self) -> bool:
        """Whether linear weights get packed for oneDNN (`prepack_weights`, CPU only)."""
        cfg = self.config
        compiled = cfg.default_compile_level > 0 or cfg.varlen_compile_config or cfg.decode_compile_config
        reason = packed_linear.unavailable_reason(self.device, self.dtype) or (
            "torch.compile does not trace oneDNN-packed weights" if compiled else "")
        wanted = cfg.prepack_weights
        if wanted and reason:
            raise ValueError(f"prepack_weights=True cannot be used here: {reason}")
        if wanted is None:
            wanted = not reason
            if reason and self.device.type == "cpu":
                logger.info("linear weights not packed for oneDNN: %s", reason)
        return wanted

    def _make_offload_pool(self) -> HostOffloadPool | None:
        cfg = self.config
        if cfg.cpu_offload_space == 0:
            return None
        if self.release_window is not None:
            logger.info("CPU offload off: sliding-window pages are released as they leave the window")
            return None
        blocks = host_pool_blocks(self.cache, cfg.cpu_offload_space, cfg.cpu_offload_space_safety_threshold)
        if blocks == 0:
            logger.warning("cpu_offload_space too small for one page: offloading disabled")
            return None
        logger.info("CPU offload pool: %d pages", blocks)
        return HostOffloadPool(self.cache, blocks)

    def release_model(self) -> None:
        """Give the model back its own attention implementation, linear layers and eager layers."""
        packed_linear.unpack_linears(self.packed_linears)
        self.runner.forward.restore()
        self.model.set_attn_implementation(self._previous_attn)

    # -- requests ----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.cache.num_blocks * self.cache.page_size

    def make_request(
        self,
        input_ids: list[int],
        request_id: str,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Validate a request at the boundary; every error names the argument and its range."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
            raise ValueError("input_ids must be a non-empty list of token ids")
        vocab = self.shape.vocab_size
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"input_ids[{i}]: token id {t!r} is not an integer in the vocabulary [0, {vocab})")
        gc = self.generation_config
        if max_new_tokens is None:
            max_new_tokens = gc.max_new_tokens if gc.max_new_tokens is not None else 20
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer (>= 1), got {max_new_tokens!r}")
        if eos_token_id is not None:
            ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
            if (isinstance(eos_token_id, bool) or not isinstance(ids, (list, tuple, set, frozenset))
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                raise ValueError(f"eos_token_id must be a token id (integer >= 0) or a list of them, "
                                 f"got {eos_token_id!r}")
        total = len(input_ids) + max_new_tokens
        if total > self.shape.max_context:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.shape.max_context} tokens"
            )
        if total > self.capacity_tokens:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"KV cache's {self.capacity_tokens} tokens (num_blocks * page_size)"
            )
        eos = eos_set(eos_token_id if eos_token_id is not None else gc.eos_token_id)
        return Request(
            request_id=request_id,
            prompt_ids=list(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos,
            sampling=sampling or self.default_sampling(),
            streaming=streaming,
            return_logprobs=self.config.return_logprobs,
        )

    def default_sampling(self) -> SamplingParams:
        gc = self.generation_config
        return SamplingParams(
            do_sample=bool(gc.do_sample),
            temperature=gc.temperature if gc.temperature is not None else 1.0,
            top_k=gc.top_k or 0,
            top_p=gc.top_p if gc.top_p is not None else 1.0,
            seed=None,
        )

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def cancel_request(self, request_id: str) -> Request | None:
        """Stop a live request now and free its pages; None when unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.remove(request)
        request.finish(RequestStatus.CANCELLED, FinishReason.CANCELLED)
        return request

    def fail_all(self, error: BaseException) -> list[Request]:
        """Fail every live request (hard stop, crash), freeing their pages."""
        failed = list(self.requests.values())
        for request in failed:
            self.scheduler.remove(request)
            request.finish(RequestStatus.FAILED, FinishReason.ERROR, error)
        self.requests.clear()
        self._in_flight = None
        return failed

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one forward pass; returns the requests that got a token or finished.

        With async batching the tokens returned are those of the previous call's forward pass,
        read after this call's pass was launched."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            updated = self._finish_in_flight()
            if not updated and self.scheduler.has_work and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress: a waiting request cannot fit the cache")
            return updated
        in_flight, self._in_flight = self._in_flight, None
        launch_async = self.async_batching and all(s.request.sampling.greedy for s in batch if s.sample)
        updated: list[Request] = []
        if in_flight is not None and not launch_async:
            # Synchronous: earlier tokens first (rows of requests that just stopped are dropped).
            updated = self._finish(in_flight)
            batch = [s for s in batch if self._is_live(s.request)]
            in_flight = None
            if not batch:
                return updated
        t1 = time.perf_counter()
        kwargs, sampled = self.runner.prepare(batch, in_flight)
        t2 = time.perf_counter()
        logits = self.runner.run(kwargs)
        t3 = time.perf_counter()
        requests = [s.request for s in sampled]
        if launch_async:
            launched = launch_greedy(logits, requests, self.config.return_logprobs)
            updated = self._finish(in_flight)  # waits for the previous pass only
            self._advance([s for s in batch if self._is_live(s.request)])
            for request in requests:
                request.num_inflight += self._is_live(request)
            self._in_flight = launched
        else:
            self._advance(batch)
            tokens, logprobs = self.sampler(
                logits, [r.sampling for r in requests], [r.generator for r in requests],
                self.config.return_logprobs,
            ) if requests else ([], None)
            updated += self._append(requests, tokens, logprobs)
        self.timings["schedule"] += t1 - t0
        self.timings["prepare"] += t2 - t1
        self.timings["forward"] += t3 - t2
        return updated

    def _is_live(self, request: Request) -> bool:
        return self.requests.get(request.request_id) is request

    def _advance(self, batch: list) -> None:
        """The pass's tokens are in the cache: move the requests on, register and release pages."""
        for s in batch:
            s.request.num_computed += s.num_query_tokens
            if s.request.status == RequestStatus.PREFILLING and s.sample:
                s.request.status = RequestStatus.DECODING
            self.block_manager.register_full_pages(s.request)
            if self.release_window is not None:
                self.block_manager.release_before(s.request, s.request.num_computed - self.release_window + 1)
            if not s.request.generated:
                self.prompt_tokens_computed += s.num_query_tokens
        self.num_steps += 1

    def _finish(self, in_flight: InFlightStep | None) -> list[Request]:
        """Read a launched pass's tokens and update its requests that are still live."""
        if in_flight is None:
            return []
        tokens, logprobs = in_flight.results()
        live = [i for i, r in enumerate(in_flight.requests) if self._is_live(r)]
        requests = [in_flight.requests[i] for i in live]
        for request in requests:
            request.num_inflight -= 1
        return self._append(requests, [tokens[i] for i in live],
                            None if logprobs is None else [logprobs[i] for i in live])

    def _finish_in_flight(self) -> list[Request]:
        in_flight, self._in_flight = self._in_flight, None
        return self._finish(in_flight)

    def _append(self, requests: list[Request], tokens: list[int], logprobs: list[float] | None) -> list[Request]:
        for i, request in enumerate(requests):
            request.append_token(tokens[i], logprobs[i] if logprobs is not None else None)
            self.generated_tokens += 1
            reason = request.stop_reason()
            if reason is not None:
                self.scheduler.remove(request)
                del self.requests[request.request_id]
                request.finish(RequestStatus.FINISHED, reason)
        return requests

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "total_pages": self.block_manager.num_blocks,
            "free_pages": self.block_manager.num_free,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "recomputes": self.scheduler.num_recomputes,
            "offloads": self.offload_pool.num_offloads if self.offload_pool else 0,
            "restores": self.offload_pool.num_restores if self.offload_pool else 0,
            "steps": self.num_steps,
        }


# Every engine built in this process, so tests can check that pages always come back.
LIVE_ENGINES: weakref.WeakSet[EngineCore] = weakref.WeakSet()
