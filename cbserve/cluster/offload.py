"""Per-node CPU offload budgets, shared out among the worker replicas a node can hold.

`ray_config.yaml` sets the host memory (GiB) that evicted KV pages may take on each node
(`cpu_offload.per_node_gib`, overridden per node by IP or node id in `cpu_offload.by_node`).
A replica's engine gets `budget / replicas_that_fit_on_the_node`: the number of replicas the
node's resources can hold at once (capped by the deployment's maximum replica count), so
the replicas on a node never take more than its budget together, whatever the scheduler packs
there. The share is fixed when the replica starts (the engine sizes its pool once).

With `cpu_offload.node_pool` the budget is instead one pool shared by the node's replicas
(`node_pools.py`), and each replica keeps `staging_gib` of its own.
"""

from __future__ import annotations

import logging
import math

from cbserve.cluster.settings import CpuOffloadConfig

logger = logging.getLogger(__name__)


def node_budget_gib(cfg: CpuOffloadConfig, node_id: str, node_ip: str) -> float:
    for key in (node_id, node_ip):
        if key in cfg.by_node:
            return cfg.by_node[key]
    return cfg.per_node_gib


def replicas_fitting(node_resources: dict[str, float], per_replica: dict[str, float], max_replicas: int) -> int:
    """How many replicas asking `per_replica` resources fit in `node_resources` (at least 1)."""
    fits = max_replicas
    for name, amount in per_replica.items():
        if amount > 0:
            fits = min(fits, math.floor(node_resources.get(name, 0.0) / amount + 1e-9))
    return max(1, fits)


def _this_node() -> tuple[str, dict]:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return node_id, next((n for n in ray.nodes() if n.get("NodeID") == node_id), {})


def offload_settings(cfg: CpuOffloadConfig, per_replica: dict[str, float], max_replicas: int) -> dict[str, object]:
    """This replica's engine settings for offload: `cpu_offload_space` (GiB), and with
    `cfg.node_pool` the name of its node's shared pool in `node_kv_pool`."""
    if cfg.per_node_gib == 0 and not cfg.by_node:
        return {"cpu_offload_space": 0.0}
    node_id, node = _this_node()
    budget = node_budget_gib(cfg, node_id, node.get("NodeManagerAddress", ""))
    if budget == 0:
        return {"cpu_offload_space": 0.0}
    if cfg.node_pool:
        from cbserve.cluster.node_pools import ensure_node_pool

        name = ensure_node_pool(int(budget * 2**30))
        logger.info("CPU offload: node %s's shared KV pool %s (%.2f GiB), %.2f GiB of staging here",
                    node_id[:8], name, budget, cfg.staging_gib)
        return {"cpu_offload_space": cfg.staging_gib, "node_kv_pool": name}
    fits = replicas_fitting(node.get("Resources", {}), per_replica, max_replicas)
    share = budget / fits
    logger.info("CPU offload: node %s has %.2f GiB for up to %d replicas: %.2f GiB here",
                node_id[:8], budget, fits, share)
    return {"cpu_offload_space": share}
