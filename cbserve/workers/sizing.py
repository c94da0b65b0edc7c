"""How big the engine's memory and batches are: KV pages, requests per step, decode fast-path
width, the host offload pool. Computed once, when an engine is built, from the config, the model's
shape and what is known of the workload."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cbserve.config import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_REQUESTS,
    MIN_AUTO_BATCH_TOKENS,
    ContinuousBatchingConfig,
)
from cbserve.workers.kv.cache import PagedKVCache, available_memory_bytes
from cbserve.workers.kv.host_pool import host_pool_blocks
from cbserve.workers.model_shape import ModelShape

logger = logging.getLogger(__name__)

# Share of free memory the KV cache takes by default: host memory on a CPU is shared with
# everything else on the machine, so it gets a smaller default than an accelerator's.
DEFAULT_MEMORY_PERCENT = {"cuda": 0.9, "cpu": 0.2}
# What one query token of a forward pass may take beside the KV cache (hidden states, projections,
# attention inputs), for sizing: the batch's buffers come out of the memory budget first.
BATCH_TOKEN_BYTES = 64 * 1024


@dataclass(frozen=True)
class Workload:
    """What `generate_batch` knows before it starts (all None for an online manager)."""

    max_total_tokens: int | None = None  # prompts + new tokens of every request
    num_requests: int | None = None
    max_request_tokens: int | None = None  # the longest prompt + its new tokens


@dataclass(frozen=True)
class EngineSizes:
    max_batch_tokens: int
    num_blocks: int
    max_requests: int
    fast_path_width: int  # block-table width of the decode fast path; 0 = off
    # When every layer is windowed, pages older than the widest window are given back.
    release_window: int | None


def engine_sizes(config: ContinuousBatchingConfig, shape: ModelShape, device: torch.device, dtype: torch.dtype,
                 workload: Workload) -> EngineSizes:
    max_batch_tokens = config.max_batch_tokens or auto_max_batch_tokens(config, device)
    num_blocks = config.num_blocks or auto_num_blocks(config, shape, device, dtype, max_batch_tokens, workload)
    max_requests = config.max_requests_per_batch or workload.num_requests or DEFAULT_MAX_REQUESTS
    windows = shape.sliding_windows
    release_window = max(windows) if all(w is not None for w in windows) else None
    if shape.has_sliding_layers and release_window is None:
        logger.info("hybrid model: sliding layers keep every page, as the full-attention layers need them")
    return EngineSizes(
        max_batch_tokens=max_batch_tokens,
        num_blocks=num_blocks,
        max_requests=max(1, min(max_requests, max_batch_tokens, num_blocks)),
        fast_path_width=fast_path_width(config, shape, workload),
        release_window=release_window,
    )


def auto_max_batch_tokens(config: ContinuousBatchingConfig, device: torch.device) -> int:
    """The default token budget of a step, as transformers sizes it: the device's default, lowered
    so that the batch's buffers take at most half the memory budget (the rest is KV pages), and
    never below 256."""
    default = DEFAULT_MAX_BATCH_TOKENS.get(device.type, 8192)
    share = config.max_memory_percent or DEFAULT_MEMORY_PERCENT.get(device.type, 0.9)
    cap = int(available_memory_bytes(device) * share / 2 // BATCH_TOKEN_BYTES)
    if cap < default:
        logger.info("max_batch_tokens lowered from %d to %d to leave memory for the KV cache", default,
                    max(cap, MIN_AUTO_BATCH_TOKENS))
    return max(MIN_AUTO_BATCH_TOKENS, min(default, cap))


def auto_num_blocks(config: ContinuousBatchingConfig, shape: ModelShape, device: torch.device, dtype: torch.dtype,
                    max_batch_tokens: int, workload: Workload) -> int:
    """Pages for the memory budget, no more than the workload can use."""
    per_block = PagedKVCache.bytes_per_block(shape.num_layers, config.page_size, shape.num_kv_heads,
                                             shape.head_dim, dtype)
    share = config.max_memory_percent or DEFAULT_MEMORY_PERCENT.get(device.type, 0.9)
    # The batch's input buffers (hidden states, float32 logits) come out of the budget first.
    buffers = max_batch_tokens * BATCH_TOKEN_BYTES + (workload.num_requests or 256) * shape.vocab_size * 4
    budget = max(available_memory_bytes(device) * share - buffers, per_block)
    blocks = int(budget // per_block)
    if blocks * config.page_size < MIN_AUTO_BATCH_TOKENS:
        raise ValueError(f"the KV cache budget fits only {blocks} pages; raise max_memory_percent")
    max_total_tokens = workload.max_total_tokens
    if max_total_tokens is None:  # no workload known: what a full batch could use
        max_requests = config.max_requests_per_batch or workload.num_requests or DEFAULT_MAX_REQUESTS
        max_total_tokens = max_requests * min(shape.max_context, 1 << 16)
    # Every request rounds its last page up: up to one partly filled page per request.
    partial_pages = workload.num_requests or 1
    return min(blocks, -(-max_total_tokens // config.page_size) + partial_pages)


def fast_path_width(config: ContinuousBatchingConfig, shape: ModelShape, workload: Workload) -> int:
    """Block-table width of the decode fast path (`max_blocks_per_request`); 0 = off."""
    width = config.max_blocks_per_request
    if width is None:
        longest = workload.max_request_tokens
        width = -(-longest // config.page_size) if longest else 32
    if width and shape.has_sliding_layers:
        logger.info("decode fast path off: the model has sliding-window layers")
        return 0
    return width


def host_pool_size(config: ContinuousBatchingConfig, cache: PagedKVCache, release_window: int | None) -> int:
    """Pages of the CPU offload pool; 0 = no offloading."""
    if config.cpu_offload_space == 0:
        return 0
    if release_window is not None:
        logger.info("CPU offload off: sliding-window pages are released as they leave the window")
        return 0
    blocks = host_pool_blocks(cache, config.cpu_offload_space, config.cpu_offload_space_safety_threshold)
    if blocks == 0:
        logger.warning("cpu_offload_space too small for one page: offloading disabled")
        return 0
    logger.info("CPU offload pool: %d pages", blocks)
    return blocks
