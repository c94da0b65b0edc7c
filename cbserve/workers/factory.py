"""The one place an engine is built: `generate_batch` and the manager both come here, so tensor
parallelism is decided once (`tp_size`), and the leader is handed to the engine core."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.workers.engine import EngineCore
from cbserve.workers.sizing import Workload


def build_engine(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    config: ContinuousBatchingConfig | None = None,
    workload: Workload | None = None,
) -> EngineCore:
    config = config or ContinuousBatchingConfig()
    workload = workload or Workload()
    hints = (workload.max_total_tokens, workload.num_requests, workload.max_request_tokens)
    generation_config = generation_config or model.generation_config
    if config.tp_size == 1:
        return EngineCore(model, generation_config, config, *hints)
    from cbserve.workers.parallel.leader import TensorParallelLeader  # torch.distributed only when used

    leader = TensorParallelLeader(model, config)
    try:
        return EngineCore(leader.shard, generation_config, leader.engine_config(config), *hints, parallel=leader)
    except BaseException:
        leader.abort()
        leader.close()
        raise
