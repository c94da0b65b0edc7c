"""The per-node KV pool's owner: one Ray actor per node and app, shared by that app's worker
replicas on the node.

With `cpu_offload.node_pool: true` the node's offload budget (`per_node_gib` / `by_node`) is one
`NodeKVPool` (`workers/kv/node_pool.py`: a shared-memory file of pages keyed by their prefix
hash) instead of a private slice per replica. The first replica to start on a node creates the
node's owner actor (named, detached, zero CPUs, pinned to the node); the others find it by name.
Pools are per scope: a Serve app and deployment (a batch job's engines: the Ray job), named by
it, so two apps on one node never share pages or replace each other's pool.
The owner only creates the file and keeps it alive: the engines read and write pages directly in
shared memory, never through the actor. If the owner dies the engines see it and stop using the
pool (a miss, never a wrong page).

The owners are detached so that a replica's scale-down does not take the node's pages with it;
`close_all()` (called by `cluster/run.py` when it stops the server) closes them and frees their
memory, and they go with the Ray cluster.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cbserve.workers.kv.node_pool import NodeKVPool

logger = logging.getLogger(__name__)

NAMESPACE = "cbserve"
ACTOR_PREFIX = "cbserve-kvpool-"


def pool_scope() -> str:
    """Whose pool this process uses: its Serve app and deployment, else its Ray job."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        ctx = serve.get_replica_context()
    except RayServeException:  # not a Serve replica: a batch job's engine actor
        return f"job:{ray.get_runtime_context().get_job_id()}"
    return f"app:{ctx.app_name}/{ctx.deployment}"


def scope_key(scope: str) -> str:
    """A file- and actor-name-safe form of `scope`: readable, and unique by its digest."""
    digest = hashlib.blake2b(scope.encode(), digest_size=6).hexdigest()
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', scope)[:32]}-{digest}"


def actor_name(scope: str, node_id: str) -> str:
    return f"{ACTOR_PREFIX}{scope_key(scope)}-{node_id}"


@ray.remote(num_cpus=0)
class NodePoolOwner:
    """Owns node `node_id`'s pool file of `scope` (`NodeKVPool.create`) for as long as it lives."""

    def __init__(self, scope: str, node_id: str, capacity_bytes: int):
        self.pool = NodeKVPool.create(f"{scope_key(scope)}-{node_id[:16]}", capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self.scope = scope

    def name(self) -> str:
        """The pool's name, as `ContinuousBatchingConfig(node_kv_pool=...)` takes it."""
        return self.pool.path.name.removeprefix("cbserve-kv-")

    def stats(self) -> dict[str, Any]:
        return {**self.pool.stats(), "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        self.pool.close()


def _owner(scope: str, node_id: str, capacity_bytes: int) -> Any:
    return NodePoolOwner.options(
        name=actor_name(scope, node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(scope, node_id, capacity_bytes)


def ensure_node_pool(capacity_bytes: int, attempts: int = 50, scope: str | None = None) -> str:
    """The name of this node's pool of `capacity_bytes` for `scope` (default: `pool_scope()`),
    its owner created if this is the scope's first replica here. An owner left by an earlier
    deployment of the scope with another budget is replaced: the engines still attached to it see
    it closed and stop using it (misses, never wrong pages). Other scopes' pools are untouched."""
    from ray.exceptions import RayActorError

    node_id = ray.get_runtime_context().get_node_id()
    scope = pool_scope() if scope is None else scope
    for _ in range(attempts):
        owner = _owner(scope, node_id, capacity_bytes)
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
    """Every live pool owner of the cluster, by actor name (scope and node id)."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(ACTOR_PREFIX):
            found[entry["name"]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
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
