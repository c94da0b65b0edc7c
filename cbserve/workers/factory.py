"""The one place an engine is built and its parts wired: the model's shape and the sizes read from
it, the KV pages and their bookkeeping (cache, block manager, host pool, node pool), the scheduler
over them, the attention backend and the model runner, the packed weights, the sampler; under
tensor parallelism (`tp_size`), the leader wrapped around the runner and the host pool.
`generate_batch`, the manager, the benchmarks and the tests all build engines here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.kernels import attention_backends, cpu_kernels, packed_linear, quantized
from cbserve.scheduler.block_manager import BlockManager
from cbserve.scheduler.host_pages import HostPages
from cbserve.scheduler.ngram import NgramProposer
from cbserve.scheduler.scheduler import Scheduler
from cbserve.workers import compilation, draft_model
from cbserve.workers.compilation import CompiledForward
from cbserve.workers.cuda_graphs import build_step_graphs
from cbserve.workers.engine import EngineCore, EngineParts
from cbserve.workers.kv import node_client
from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.kv.host_pool import HostKVPool
from cbserve.workers.lora_slots import LoraSlots
from cbserve.workers.model_runner import ModelRunner
from cbserve.workers.model_shape import ModelShape
from cbserve.workers.sampler import Sampler
from cbserve.workers.sizing import EngineSizes, Workload, engine_sizes, host_pool_size

if TYPE_CHECKING:
    from cbserve.workers.parallel.leader import TensorParallelLeader

logger = logging.getLogger(__name__)


def build_engine(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    config: ContinuousBatchingConfig | None = None,
    workload: Workload | None = None,
) -> EngineCore:
    config = config or ContinuousBatchingConfig()
    workload = workload or Workload()
    generation_config = generation_config or model.generation_config
    if config.tp_size == 1:
        return EngineCore(model, generation_config, config, build_parts(model, config, workload))
    from cbserve.workers.parallel.leader import TensorParallelLeader  # torch.distributed only when used

    leader = TensorParallelLeader(model, config)
    try:
        config = leader.engine_config(config)
        parts = build_parts(leader.shard, config, workload, leader)
        return EngineCore(leader.shard, generation_config, config, parts, parallel=leader)
    except BaseException:
        leader.abort()
        leader.close()
        raise


def build_parts(model: torch.nn.Module, config: ContinuousBatchingConfig, workload: Workload,
                parallel: TensorParallelLeader | None = None) -> EngineParts:
    if config.quantization != "none":  # a tensor-parallel shard was quantized by its leader
        quantized.quantize_model(model, config.quantization, config.batch_invariant)
    shape = ModelShape.from_model(model)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    pack_weights = pack_weights_wanted(config, device, dtype)  # may refuse: before the model is touched
    sizes = engine_sizes(config, shape, device, dtype, workload)
    cache = PagedKVCache(shape.num_layers, sizes.num_blocks, config.page_size, shape.num_kv_heads,
                         shape.head_dim, dtype, device)
    prefix_caching = config.allow_block_sharing and not shape.has_sliding_layers
    if config.allow_block_sharing and not prefix_caching:
        logger.info("prefix caching off: the model has sliding-window layers")
    block_manager = BlockManager(sizes.num_blocks, config.page_size, prefix_caching)
    host_blocks = host_pool_size(config, cache, sizes.release_window)
    host_pool = HostKVPool(cache, host_blocks) if host_blocks else None
    host_pages = HostPages(host_blocks, config.page_size) if host_blocks else None
    node_pool = node_client.attach(config.node_kv_pool, model, cache, host_pool, host_pages, prefix_caching)
    scheduler = Scheduler(block_manager, sizes.max_batch_tokens, sizes.max_requests, config.scheduler,
                          config.resolved_safety_margin, host_pages, config.parent_share, sizes.release_window,
                          parent_step_tokens=config.resolved_parent_step_tokens(device.type),
                          shared_parent_step_tokens=config.resolved_shared_parent_step_tokens(device.type),
                          shared_window_s=config.shared_window_s,
                          held_step_tokens=config.held_step_tokens,
                          max_loras=config.max_loras if config.enable_lora else None,
                          **speculation(config, model, cache))
    if node_pool is not None:  # computed prompt pages, for the node's other engines
        scheduler.on_computed = node_pool.after_step
    attention_backend = attention_backends.select(config.attention_backend, device, config.page_size,
                                                  config.auto_switch_to_flash, config.batch_invariant)
    runner = build_runner(model, config, cache, attention_backend, sizes, dtype)
    lora = None
    if config.enable_lora:  # its slots sized from the model's own projections, before packing
        lora = runner.lora = LoraSlots(model, config.max_loras, config.max_lora_rank,
                                       parallel.groups.data if parallel is not None else None)
    packed_linears = packed_linear.pack_linears(model, config.batch_invariant) if pack_weights else []
    if lora is not None:  # around what the pass calls: packed, fused q/k/v and gate/up
        lora.attach()
    if parallel is not None:
        runner = parallel.wrap_runner(runner)  # each step's inputs reach the other ranks
        host_pool = parallel.wrap_host_pool(host_pool)  # its transfers reach every rank
        parallel.start(cache)
    logger.info(
        "KV cache: %d pages of %d tokens (%.1f MiB), max_batch_tokens=%d, max_requests=%d",
        sizes.num_blocks, config.page_size, cache.nbytes / 2**20, sizes.max_batch_tokens, sizes.max_requests,
    )
    return EngineParts(shape, sizes, cache, block_manager, host_pool, node_pool, scheduler, attention_backend,
                       runner, Sampler(shape.vocab_size, config.seed, greedy_kernel(device)), pack_weights, packed_linears, lora)


def greedy_kernel(device: torch.device) -> bool:
    """Whether the sampler picks greedy rows with the C++ kernel: on a CPU engine with a vector
    path (the generic C++ row is slower than torch's ops)."""
    return device.type == "cpu" and cpu_kernels.layer_ops_isa() != "generic" and not cpu_kernels.unavailable_reason()


def speculation(config: ContinuousBatchingConfig, model: torch.nn.Module, cache: PagedKVCache) -> dict:
    """The scheduler's speculative decoding arguments: its proposer (a draft model's cache sized
    from the target's `cache`) and when to use it."""
    spec = config.speculative
    if spec is None:
        return {}
    if spec.method == "draft_model":
        draft = draft_model.load_draft(spec, model)
        engine = build_engine(draft, GenerationConfig(), draft_model.draft_engine_config(config, draft, cache))
        logger.info("draft model %s: %d KV pages (%.1f MiB)", spec.model, engine.cache.num_blocks,
                    engine.cache.nbytes / 2**20)
        proposer = draft_model.DraftModelProposer(engine, spec.num_speculative_tokens,
                                                  draft_model.catch_up_factor(model.config, draft.config))
    else:
        proposer = NgramProposer(spec)
    return {"proposer": proposer, "speculate_below": spec.disable_by_batch_size,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "adaptive_lookahead": spec.num_speculative_tokens_schedule == "heuristic"}


def build_runner(model: torch.nn.Module, config: ContinuousBatchingConfig, cache: PagedKVCache,
                 attention_backend: str, sizes: EngineSizes, dtype: torch.dtype) -> ModelRunner:
    """The model's forward on cbserve's attention (compiled or not, CUDA graphs or not); the
    engine takes the model's attention when it is made (`EngineCore.take_model`)."""
    forward = CompiledForward(
        model,
        compilation.resolve(config.default_compile_level, config.varlen_compile_config),
        compilation.resolve(config.default_compile_level, config.decode_compile_config),
        config.q_padding_interval_size,
    )
    kernels = attention_backends.kernels(attention_backend, config.batch_invariant, dtype)
    runner = ModelRunner(model, cache, forward, kernels, sizes.fast_path_width)
    if not config.enable_lora:  # graphs would replay one step's adapter rows (refused when asked for)
        runner.graphs = build_step_graphs(config, runner, attention_backend, sizes.max_requests,
                                          sizes.max_batch_tokens)
    return runner


def pack_weights_wanted(config: ContinuousBatchingConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights get packed for the CPU kernels (`prepack_weights`, CPU only)."""
    compiled = config.default_compile_level > 0 or config.varlen_compile_config or config.decode_compile_config
    reason = packed_linear.unavailable_reason(device, dtype, config.batch_invariant) or (
        "torch.compile does not trace oneDNN-packed weights" if compiled else "")
    wanted = config.prepack_weights
    if config.batch_invariant and reason:  # the guarantee needs the C++ linear kernel on every layer
        raise ValueError(f"batch_invariant=True cannot be used here: {reason}")
    if wanted and reason:
        raise ValueError(f"prepack_weights=True cannot be used here: {reason}")
    if wanted is None:
        wanted = not reason
        if reason and device.type == "cpu":
            logger.info("linear weights not packed for oneDNN: %s", reason)
    return wanted
