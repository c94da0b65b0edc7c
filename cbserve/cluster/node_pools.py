"""The per-node KV pool's owner: one Ray actor per node, shared by that node's worker replicas.

With `cpu_offload.node_pool: true` the node's offload budget (`per_node_gib` / `by_node`) is one
`NodeKVPool` (`workers/kv/node_pool.py`: a shared-memory file of pages keyed by their prefix
hash) instead of a private slice per replica. The first replica to start on a node creates the
node's owner actor (named, detached, zero CPUs, pinned to the node); the others find it by name.
The owner only creates the file and keeps it alive: the engines read and write pages directly in
shared memory, never through the actor. If the owner dies the engines see it and stop using the
pool (a miss, never a wrong page).

The owners are detached so that a replica's scale-down does not take the node's pages with it;
`close_all()` (called by `cluster/run.py` when it stops the server) closes them and frees their
memory, and they go with the Ray cluster.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cbserve.workers.kv.node_pool import NodeKVPool

logger = logging.getLogger(__name__)

NAMESPACE = "cbserve"
ACTOR_PREFIX = "cbserve-kvpool-"


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id


@ray.remote(num_cpus=0)
class NodePoolOwner:
    """Owns node `node_id`'s pool file (`NodeKVPool.create`) for as long as it lives."""

    def __init__(self, node_id: str, capacity_bytes: int):
        self.pool = NodeKVPool.create(f"node-{node_id[:24]}", capacity_bytes)
        self.capacity_bytes = capacity_bytes

    def name(self) -> str:
        """The pool's name, as `ContinuousBatchingConfig(node_kv_pool=...)` takes it."""
        return self.pool.path.name.removeprefix("cbserve-kv-")

    def stats(self) -> dict[str, Any]:
        return {**self.pool.stats(), "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        self.pool.close()


def _owner(node_id: str, capacity_bytes: int) -> Any:
    return NodePoolOwner.options(
        name=actor_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, capacity_bytes)


def ensure_node_pool(capacity_bytes: int, attempts: int = 50) -> str:
    """The name of this node's pool of `capacity_bytes`, its owner created if this is the first
    replica here. An owner left by an earlier deployment with another budget is replaced: the
    engines still attached to it see it closed and stop using it (misses, never wrong pages)."""
    from ray.exceptions import RayActorError

    node_id = ray.get_runtime_context().get_node_id()
    for _ in range(attempts):
        owner = _owner(node_id, capacity_bytes)
        try:
            have = ray.get(owner.stats.remote())["capacity_bytes"]
        except RayActorError:  # a replaced owner whose name is not released yet
            time.sleep(0.1)
            continue
        if have == capacity_bytes:
            return ray.get(owner.name.remote())
        logger.info("node KV pool of node %s: %.2f GiB -> %.2f GiB (a new budget)", node_id[:8], have / 2**30,
                    capacity_bytes / 2**30)
        ray.get(owner.close.remote())
        ray.kill(owner)
    raise RuntimeError(f"no node KV pool owner of {capacity_bytes} bytes on node {node_id} after {attempts} tries")


def owners() -> dict[str, Any]:
    """Every live pool owner of the cluster, by node id."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(ACTOR_PREFIX):
            found[entry["name"].removeprefix(ACTOR_PREFIX)] = ray.get_actor(entry["name"], namespace=NAMESPACE)
    return found


def close_all(timeout_s: float = 10.0) -> int:
    """Close every node's pool and end its owner; how many there were."""
    found = owners()
    for owner in found.values():
        try:
            ray.get(owner.close.remote(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead owner's file is replaced by the next create
            logger.warning("closing a node KV pool: %s", exc)
        ray.kill(owner)
    return len(found)
