"""The ranks > 0 of a tensor-parallel engine: the loop each one runs. Take rank 0's step plan,
run this shard's forward pass (whose all-reduces meet rank 0's), until rank 0 shuts down.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from cbserve.kernels import paged_attention
from cbserve.workers.kv.cache import PagedKVCache
from cbserve.workers.model_shape import ModelShape
from cbserve.workers.parallel.groups import TensorParallelError, TPGroups, unpack
from cbserve.workers.parallel.sharding import install_all_reduce, vocab_parallel_head

logger = logging.getLogger(__name__)


def follow(shard: torch.nn.Module, groups: TPGroups, device: torch.device) -> Any:
    """Rank > 0: run every step rank 0 broadcasts until it shuts down; returns the shutdown
    message's payload. Raises TensorParallelError when rank 0 or a peer fails."""
    paged_attention.register()
    shard.set_attn_implementation(paged_attention.ATTENTION_NAME)
    install_all_reduce(shard, groups.data)
    # A vocabulary-parallel head takes part in every step (its logits are gathered on rank 0); a
    # replicated one is left to rank 0.
    whole = vocab_parallel_head(shard) is not None
    forward = shard if whole else shard.get_decoder()
    shape = ModelShape.from_model(shard)
    dtype = next(shard.parameters()).dtype
    cache: PagedKVCache | None = None
    while True:
        message = groups.recv()
        if message.kind == "step":
            plan = unpack(message.payload, device)
            plan["cb_meta"] = dataclasses.replace(plan["cb_meta"], k_caches=cache.k, v_caches=cache.v)
            if not whole:
                plan.pop("logits_to_keep")
            try:
                with torch.inference_mode():
                    forward(**plan)
            except TensorParallelError:
                raise
            except Exception as error:
                raise groups.fail("running its forward pass", error) from error
        elif message.kind == "setup":
            cache = PagedKVCache(shape.num_layers, message.payload["num_blocks"], message.payload["page_size"],
                                 shape.num_kv_heads, shape.head_dim, dtype, device)
            logger.info("rank %d: KV cache of %.1f MiB", groups.rank, cache.nbytes / 2**20)
        elif message.kind == "shutdown":
            return message.payload
        else:  # ping: nothing is in flight on this rank between steps
            logger.debug("rank %d: %s", groups.rank, message.kind)
