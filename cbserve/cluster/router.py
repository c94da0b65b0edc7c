"""Ray Serve request router for engine replicas: consistent hashing with bounded loads of the
prompt's leading chunks, power-of-two choices otherwise (the policy itself: `balance.py`).

It runs inside every process that holds a handle to the engine replicas' deployment (the ingress
replicas) and keeps no table: the ring is a function of the live replicas' ids, so every ingress
replica sends a prefix to the same worker replica without talking to the others. Loads are the
replicas' outstanding requests as Serve knows them (its queue-length cache, refreshed by every
reply and probed when stale: `ray_compat.CompatRouter.queue_lens`); ties between the two random
choices are broken by the KV usage the replicas report as routing stats
(`EngineReplica.record_routing_stats`).

A request that names a LoRA adapter goes to a replica that holds it (the replicas report theirs
as routing stats; a replica this router sent the adapter to since its last stats counts too, since
the stats lag) while that replica's queue is below the bounded-load capacity (`adapter_load_factor`),
the prefix's ring order breaking ties; else to the least loaded replica with room for one more
adapter (`lora_room` in its stats) below that capacity (the least loaded one if none), which loads
it (`cluster/adapters.py`).

Ranks returned to Serve: the chosen replica first; if it refuses (full), the rest by load.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cbserve.cluster.balance import HashRing, bounded_load_choice, capacity, routing_key, two_choices
from cbserve.cluster.ray_compat import CompatRouter

# Longest a replica this router sent an adapter's request to counts as holding it while its
# routing stats (every `routing.stats_period_s`) have not been refreshed since.
ADAPTER_MEMORY_S = 30.0


def request_hashes(pending_request: PendingRequest | None) -> list[int]:
    """The prefix hashes the ingress put on the `WorkerRequest` (its first argument)."""
    if pending_request is None:
        return []
    for arg in pending_request.args:
        hashes = getattr(arg, "prefix_hashes", None)
        if hashes:
            return list(hashes)
    return []


def request_adapter(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter of the `WorkerRequest` (its `sampling.lora`)."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        sampling = getattr(arg, "sampling", None)
        if sampling is not None:
            return sampling.lora
    return None


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
                         virtual_nodes: int = 64, seed: int | None = None, adapter_load_factor: float = 2.0,
                         **_: Any) -> None:
        self._load_factor = load_factor
        # An adapter's requests leave its replicas later than a prefix's: loading an adapter where
        # it is not held costs more than a prefix-cache miss.
        self._adapter_load_factor = adapter_load_factor
        self._slack = imbalance_threshold
        self._key_chunks = key_chunks
        self._virtual_nodes = virtual_nodes
        self._rng = random.Random(seed)
        self._ring = HashRing([], virtual_nodes)
        self.num_affinity_routes = 0  # keyed requests that went to their key's first replica
        self.num_spilled_routes = 0  # keyed requests that went further along the ring (load bound)
        self.num_load_routes = 0  # requests without a key
        self.num_adapter_routes = 0  # adapter requests sent to a replica holding their adapter
        self.num_adapter_spreads = 0  # adapter requests sent to one that does not (it loads the adapter)
        # adapter -> replica -> (when this router sent it one, the replica's routing stats then)
        self._adapter_sent: dict[str, dict[str, tuple[float, Any]]] = {}

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
        adapter = request_adapter(pending_request)
        if adapter is not None:
            chosen = self._adapter_choice(adapter, key, candidate_replicas, lens, by_load)
            return [[chosen], by_load]
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

    def _adapter_choice(self, adapter: str, key: int | None, candidates: list[RunningReplica],
                        lens: dict[ReplicaID, int], by_load: list[RunningReplica]) -> RunningReplica:
        """A replica holding `adapter` whose queue is below capacity, in the prefix's ring order (or
        by load without a key); else the least loaded one with room for another adapter and a queue
        below capacity; else the least loaded one."""
        now = time.monotonic()
        sent = self._adapter_sent.setdefault(adapter, {})
        for r in candidates:  # newer stats than at the send: they tell whether it still holds it
            when, stats = sent.get(r.replica_id.unique_id, (now, r.routing_stats))
            if stats is not r.routing_stats or now - when > ADAPTER_MEMORY_S:
                del sent[r.replica_id.unique_id]
        holders = [r for r in candidates
                   if r.replica_id.unique_id in sent or adapter in (r.routing_stats or {}).get("loras", ())]
        if key is not None and holders:
            walk = self._ring_of([r.replica_id.unique_id for r in candidates]).walk(key)
            order = {name: i for i, name in enumerate(walk)}
            holders.sort(key=lambda r: order.get(r.replica_id.unique_id, len(order)))
        else:
            holders.sort(key=lambda r: lens.get(r.replica_id, 0))
        cap = capacity(sum(lens.values()), len(candidates), self._adapter_load_factor, self._slack)
        roomy = [r for r in by_load
                 if (r.routing_stats or {}).get("lora_room", 1) > 0 and lens.get(r.replica_id, 0) < cap]
        chosen = next((r for r in holders if lens.get(r.replica_id, 0) < cap), (roomy or by_load)[0])
        if chosen in holders:
            self.num_adapter_routes += 1
        else:
            self.num_adapter_spreads += 1
        sent[chosen.replica_id.unique_id] = (now, chosen.routing_stats)
        return chosen

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # the ring follows the candidates Serve passes
