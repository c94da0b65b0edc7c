"""Ray Serve request router for engine replicas: consistent hashing with bounded loads of the
prompt's leading chunks, power-of-two choices otherwise (the policy itself: `balance.py`).

It runs inside every process that holds a handle to the engine replicas' deployment (the ingress
replicas) and keeps no table: the ring is a function of the live replicas' ids, so every ingress
replica sends a prefix to the same worker replica without talking to the others. Loads are the
replicas' outstanding requests as Serve knows them (its queue-length cache, refreshed by every
reply and probed when stale: `ray_compat.CompatRouter.queue_lens`); ties between the two random
choices are broken by the KV usage the replicas report as routing stats
(`EngineReplica.record_routing_stats`).

Ranks returned to Serve: the chosen replica first; if it refuses (full), the rest by load.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cbserve.cluster.balance import HashRing, bounded_load_choice, routing_key, two_choices
from cbserve.cluster.ray_compat import CompatRouter


def request_hashes(pending_request: PendingRequest | None) -> list[int]:
    """The prefix hashes the ingress put on the `WorkerRequest` (its first argument)."""
    if pending_request is None:
        return []
    for arg in pending_request.args:
        hashes = getattr(arg, "prefix_hashes", None)
        if hashes:
            return list(hashes)
    return []


def request_avoids(pending_request: PendingRequest | None) -> set[str]:
    """The replicas a migrating choice left (`WorkerRequest.avoid_replicas`): tried last."""
    if pending_request is None:
        return set()
    for arg in pending_request.args:
        avoid = getattr(arg, "avoid_replicas", None)
        if avoid:
            return set(avoid)
    return set()


class PrefixAffinityRouter(CompatRouter):
    def initialize_state(self, load_factor: float = 1.25, imbalance_threshold: int = 4, key_chunks: int = 1,
                         virtual_nodes: int = 64, seed: int | None = None, **_: Any) -> None:
        self._load_factor = load_factor
        self._slack = imbalance_threshold
        self._key_chunks = key_chunks
        self._virtual_nodes = virtual_nodes
        self._rng = random.Random(seed)
        self._ring = HashRing([], virtual_nodes)
        self.num_affinity_routes = 0  # keyed requests that went to their key's first replica
        self.num_spilled_routes = 0  # keyed requests that went further along the ring (load bound)
        self.num_load_routes = 0  # requests without a key

    def _ring_of(self, names: list[str]) -> HashRing:
        if self._ring.names != frozenset(names):
            self._ring = HashRing(names, self._virtual_nodes)
        return self._ring

    @staticmethod
    def _kv_usage(replica: RunningReplica) -> float:
        stats = replica.routing_stats or {}
        return float(stats.get("kv_usage", 0.0))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off between retries
        if not candidate_replicas:
            return []
        avoid = request_avoids(pending_request)
        lens = await self.queue_lens(candidate_replicas)

        def load_key(r: RunningReplica) -> tuple[float, ...]:
            # Replicas a migrating choice left, then those that did not answer the probe, go last;
            # the rest by load, then KV usage.
            return (r.replica_id.unique_id in avoid, r.replica_id not in lens, lens.get(r.replica_id, 0),
                    self._kv_usage(r))

        by_load = sorted(candidate_replicas, key=load_key)
        if avoid and by_load[0].replica_id.unique_id not in avoid:
            # A continuation (stream migration) goes to a replica it has not been on, by load:
            # its prefix's replica may be the one that just failed.
            return [[by_load[0]], by_load]
        key = routing_key(request_hashes(pending_request), self._key_chunks)
        if key is None:
            self.num_load_routes += 1
            return [two_choices(candidate_replicas, load_key, self._rng), by_load]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        walk = self._ring_of(list(by_name)).walk(key)
        loads = {name: lens.get(by_name[name].replica_id, 0) for name in walk}
        chosen = bounded_load_choice(walk, loads, self._load_factor, self._slack)
        if chosen == walk[0]:
            self.num_affinity_routes += 1
        else:
            self.num_spilled_routes += 1
        return [[by_name[chosen]], by_load]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # the ring follows the candidates Serve passes
