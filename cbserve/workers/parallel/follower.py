"""The ranks > 0 of a tensor-parallel engine: the loop each one runs. Take rank 0's step
(`step_codec`: one int64 tensor), run the KV transfers it carries on this rank's shard of the
pages, then this shard's forward pass (whose all-reduces meet rank 0's), until rank 0 shuts down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from cbserve.kernels import paged_attention
from cbserve.kernels.attention_backends import KernelBackend
from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.kv.host_pool import HostKVPool
from cbserve.workers.lora_slots import LoraSlots
from cbserve.workers.model_shape import ModelShape
from cbserve.workers.parallel import step_codec
from cbserve.workers.parallel.groups import TensorParallelError, TPGroups
from cbserve.workers.parallel.sharding import install_all_reduce, vocab_parallel_head

logger = logging.getLogger(__name__)


@dataclass
class _Memory:
    """What rank 0's setup message gives this rank: its pages, its host pool, rank 0's kernels,
    its LoRA slots (enable_lora)."""

    cache: PagedKVCache
    host_pool: HostKVPool | None
    kernels: KernelBackend | None
    lora: LoraSlots | None = None


def _setup(payload: dict, shard: torch.nn.Module, groups: TPGroups, device: torch.device) -> _Memory:
    shape, dtype = ModelShape.from_model(shard), next(shard.parameters()).dtype
    cache = PagedKVCache(shape.num_layers, payload["num_blocks"], payload["page_size"], shape.num_kv_heads,
                         shape.head_dim, dtype, device)
    pool = HostKVPool(cache, payload["host_blocks"]) if payload["host_blocks"] else None
    logger.info("rank %d: KV cache of %.1f MiB, host pool of %d pages", groups.rank, cache.nbytes / 2**20,
                payload["host_blocks"])
    lora = None
    if payload.get("lora") is not None:  # rank 0's slots, over this rank's shard of each projection
        lora = LoraSlots(shard, *payload["lora"], reduce_group=groups.data)
        lora.attach()
    return _Memory(cache, pool, payload["kernels"], lora)


def follow(shard: torch.nn.Module, groups: TPGroups, device: torch.device) -> Any:
    """Rank > 0: run every step rank 0 broadcasts until it shuts down; returns the shutdown
    message's payload. Raises TensorParallelError when rank 0 or a peer fails. The shard (the
    caller's, under torchrun) gets its attention implementation back and loses its collectives
    when this returns, so that it can follow another engine."""
    paged_attention.register()
    previous = shard.config._attn_implementation
    shard.set_attn_implementation(paged_attention.ATTENTION_NAME)
    hooks = install_all_reduce(shard, groups.data)
    memory: list[_Memory] = []  # the loop's, for the adapters' wrappers to be taken off
    try:
        return _loop(shard, groups, device, memory)
    finally:
        if memory and memory[-1].lora is not None:
            memory[-1].lora.detach()
        for hook in hooks:
            hook.remove()
        shard.set_attn_implementation(previous)


def _loop(shard: torch.nn.Module, groups: TPGroups, device: torch.device, kept: list[_Memory]) -> Any:
    # A vocabulary-parallel head takes part in every step (its logits are gathered on rank 0); a
    # replicated one is left to rank 0.
    whole = vocab_parallel_head(shard) is not None
    forward = shard if whole else shard.get_decoder()
    memory: _Memory | None = None
    while True:
        message = groups.recv()
        if message.kind == "step":
            cache = memory.cache
            kwargs, transfers, lora = step_codec.decode(message.payload, device, cache.k, cache.v,
                                                        cache.page_size, memory.kernels)
            if not whole:
                kwargs.pop("logits_to_keep")
            try:
                if transfers:  # before the forward pass may write the pages they read
                    memory.host_pool.execute(transfers)
                if memory.lora is not None:
                    memory.lora.apply(lora.rows, lora.copies)
                with torch.inference_mode():
                    forward(**kwargs)
            except TensorParallelError:
                raise
            except Exception as error:
                raise groups.fail("running its forward pass", error) from error
            finally:
                if memory.lora is not None:
                    memory.lora.end_step()
        elif message.kind == "lora":
            memory.lora.receive(message.payload)
        elif message.kind == "setup":
            if memory is not None and memory.lora is not None:  # a new engine: its own slots
                memory.lora.detach()
            memory = _setup(message.payload, shard, groups, device)
            kept[:] = [memory]
        elif message.kind == "shutdown":
            return message.payload
        else:  # ping: nothing is in flight on this rank between steps
            logger.debug("rank %d: %s", groups.rank, message.kind)
