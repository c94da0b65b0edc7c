"""Ray Serve request router for engine replicas: prefix affinity, then least outstanding requests.

It runs inside every process that holds a handle to the engine replicas' deployment (the ingress
replicas). For each request it looks up the longest prompt prefix (see `serving/prefix.py`) that it
routed before, and prefers the replica that served it, whose prefix cache then hits. It leaves
that replica when its queue is longer than the shortest queue by more than
`imbalance_threshold`, or when the prompt shares no known prefix, and then picks the replica with
the fewest outstanding requests (Serve's queue lengths, which it probes or caches), breaking ties
by the KV-cache usage the replicas report as routing stats (`EngineReplica.record_routing_stats`).
Serve's private parts it needs (queue lengths, matching a replica to its request) are in
`ray_compat.CompatRouter`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cbserve.cluster.ray_compat import CompatRouter


def _request_hashes(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    for arg in pending_request.args:
        hashes = getattr(arg, "prefix_hashes", None)
        if hashes:
            return list(hashes)
    return []


class PrefixAffinityRouter(CompatRouter):
    def initialize_state(self, imbalance_threshold: int = 4, table_size: int = 100_000, **_: Any) -> None:
        self._imbalance_threshold = imbalance_threshold
        self._table_size = table_size
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()  # prefix hash -> replica (LRU)
        self.num_affinity_routes = 0
        self.num_load_routes = 0

    # -- choosing -----------------------------------------------------------------------------

    def _affine_replica(self, hashes: list[int], candidates: dict[ReplicaID, RunningReplica]) -> ReplicaID | None:
        for h in reversed(hashes):  # longest shared prefix first
            owner = self._owner.get(h)
            if owner is not None and owner in candidates:
                return owner
        return None

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
        by_id = {r.replica_id: r for r in candidate_replicas}
        lens = await self.queue_lens(candidate_replicas)
        # Replicas that did not answer the probe go last; the rest by load, then KV usage.
        by_load = sorted(
            candidate_replicas,
            key=lambda r: (r.replica_id not in lens, lens.get(r.replica_id, 0), self._kv_usage(r)),
        )
        target = self._affine_replica(_request_hashes(pending_request), by_id)
        if target is not None and target in lens and lens[target] - min(lens.values()) <= self._imbalance_threshold:
            self.num_affinity_routes += 1
            return [[by_id[target]], by_load]
        self.num_load_routes += 1
        # The least loaded alone first (Serve would break ties in probe-completion order), then
        # the rest in order of load, in case it refuses (full).
        return [by_load[:1], by_load]

    # -- learning -----------------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for h in _request_hashes(pending_request):
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self._table_size:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, owner in self._owner.items() if owner == replica_id]:
            del self._owner[h]
