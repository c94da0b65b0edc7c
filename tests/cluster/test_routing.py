"""Routing without a Ray cluster: the hash ring, bounded loads and two choices (`cluster/balance.py`),
and the Serve router built on them (`cluster/router.py`) over fake replicas.

The scenarios are the ones that broke the old router: several ingress replicas that do not talk
must agree on a prefix's replica, a hot prefix must not pile onto one replica, and stale queue
lengths must not herd every request onto the replica that looked shortest."""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass
from typing import Any

import pytest

from cbserve.cluster.balance import HashRing, bounded_load_choice, capacity, routing_key, two_choices
from cbserve.serving.front.prefix import chat_routing_text, prefix_hashes
from cbserve.serving.protocol import WorkerRequest
from tests.support.cluster import FakeReplica

NAMES = [f"replica-{i:02d}" for i in range(4)]


def _keys(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


# ---- the ring ---------------------------------------------------------------------------------


def test_every_process_builds_the_same_ring_from_the_same_replicas() -> None:
    a, b = HashRing(NAMES), HashRing(list(reversed(NAMES)) + NAMES[:1])  # order and repeats do not matter
    for key in _keys(200):
        walk = a.walk(key)
        assert walk == b.walk(key)
        assert sorted(walk) == sorted(NAMES)  # every replica once


def test_keys_spread_evenly_and_a_leaving_replica_moves_only_its_own_keys() -> None:
    keys = _keys(4000)
    ring = HashRing(NAMES)
    first = {k: ring.walk(k)[0] for k in keys}
    shares = collections.Counter(first.values())
    assert min(shares.values()) > 0.6 * len(keys) / len(NAMES), shares  # 64 points each: within ~40%
    smaller = HashRing(NAMES[:-1])
    moved = [k for k in keys if smaller.walk(k)[0] != first[k]]
    assert {first[k] for k in moved} == {NAMES[-1]}  # only the gone replica's keys move...
    assert all(smaller.walk(k)[0] == ring.walk(k)[1] for k in moved)  # ...to the next on their walk
    assert HashRing([]).walk(1) == []


def test_the_routing_key_is_the_hash_of_the_leading_chunks() -> None:
    system = "You are a helpful assistant for the travel agency. " * 6
    users = [chat_routing_text([{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
             for i in range(5)]
    keys = {routing_key(prefix_hashes(u, 128, 64), 1) for u in users}
    assert len(keys) == 1 and None not in keys  # one system prompt, one key, whatever the user says
    assert routing_key([], 1) is None and routing_key([7, 8], 4) == 8 and routing_key([7, 8, 9], 2) == 8


# ---- bounded loads ----------------------------------------------------------------------------


def test_capacity_is_load_factor_times_the_mean_plus_slack() -> None:
    assert capacity(total_load=0, replicas=4, load_factor=1.25, slack=0) == 1
    assert capacity(total_load=39, replicas=4, load_factor=1.25, slack=0) == 13  # mean 10 with the new one
    assert capacity(total_load=39, replicas=4, load_factor=1.25, slack=4) == 17
    walk = ["a", "b", "c"]
    assert bounded_load_choice(walk, {"a": 3, "b": 0, "c": 0}, 1.25, 4) == "a"  # within the slack
    assert bounded_load_choice(walk, {"a": 9, "b": 0, "c": 0}, 1.25, 4) == "b"  # next on the key's walk
    assert bounded_load_choice(walk, {"a": 9, "b": 9, "c": 0}, 1.25, 0) == "c"  # cap ceil(1.25 x 19 / 3) = 8


def test_a_hot_prefix_overflows_along_its_walk_and_no_replica_exceeds_the_bound() -> None:
    """2 ingress routers, no shared state, 4 replicas, 3 system prompts of which one is hot."""
    ring = HashRing(NAMES)
    loads = dict.fromkeys(NAMES, 0)
    hot, warm, cold = _keys(3, seed=1)
    served: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    rng = random.Random(2)
    for i in range(400):
        key = rng.choices([hot, warm, cold], weights=[8, 1, 1])[0]
        # Both ingress routers see the same queues (Serve's replies carry them) and the same ring.
        picks = {bounded_load_choice(ring.walk(key), loads, 1.25, 4) for _router in range(2)}
        assert len(picks) == 1
        (pick,) = picks
        assert loads[pick] < capacity(sum(loads.values()), len(NAMES), 1.25, 4)
        loads[pick] += 1
        served[key][pick] += 1
        if i % 3 == 2:  # requests finish: the longest queue drains one
            loads[max(loads, key=loads.get)] -= 1
    # The hot prefix used its walk in order: its first replicas took it, not random ones.
    walk = ring.walk(hot)
    used = [r for r in walk if served[hot][r]]
    assert used == walk[: len(used)] and len(used) >= 2
    assert max(loads.values()) <= capacity(sum(loads.values()) - 1, len(NAMES), 1.25, 4)
    # A cold prefix stays on its first replica (light load keeps affinity).
    assert set(served[cold]) <= set(ring.walk(cold)[:2])


# ---- two choices ------------------------------------------------------------------------------


def test_two_choices_do_not_herd_on_a_stale_view() -> None:
    """Two ingress routers whose cached queues are stale (all replicas look equally idle except
    one) route 40 requests each without an update: "the shortest queue" sends all 80 to one
    replica; two random choices spread them."""
    stale = {"r0": 0, "r1": 1, "r2": 1, "r3": 1}
    routers = [random.Random(seed) for seed in (10, 11)]
    sent: collections.Counter[str] = collections.Counter()
    shortest: collections.Counter[str] = collections.Counter()
    for rng in routers:
        for _ in range(40):
            sent[two_choices(list(stale), lambda r: (stale[r],), rng)[0]] += 1
            shortest[min(stale, key=stale.get)] += 1
    assert shortest == {"r0": 80}
    assert len(sent) == 4 and max(sent.values()) < 45  # r0 wins only the draws it is in (1/2)
    assert two_choices(["x"], lambda r: (0,)) == ["x"]
    assert two_choices(["x", "y"], lambda r: (r == "x",)) == ["y", "x"]
    # Equal loads: either may come first (a fixed order would herd concurrent decisions).
    firsts = collections.Counter(two_choices(["x", "y"], lambda r: (0,), routers[0])[0] for _ in range(100))
    assert set(firsts) == {"x", "y"} and min(firsts.values()) > 30


# ---- the Serve router over fake replicas ------------------------------------------------------


@dataclass
class FakePending:
    args: list[Any]
    routing_context: Any = None

    def __post_init__(self) -> None:
        from ray.serve._private.request_router.common import RequestRoutingContext

        self.routing_context = RequestRoutingContext()


def _router(**kwargs: Any) -> Any:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cbserve.cluster.router import PrefixAffinityRouter

    dep = DeploymentID(name="LLMWorker", app_name="app")
    router = PrefixAffinityRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN,
                                  use_replica_queue_len_cache=False)
    router.initialize_state(**kwargs)
    return router


def _replicas(names: list[str]) -> list[FakeReplica]:
    from ray.serve._private.common import DeploymentID, ReplicaID

    dep = DeploymentID(name="LLMWorker", app_name="app")
    return [FakeReplica(ReplicaID(unique_id=n, deployment_id=dep)) for n in names]


def _request(text: str) -> FakePending:
    return FakePending([WorkerRequest(request_id="r", prompt=text, prefix_hashes=prefix_hashes(text, 16, 8))])


def test_router_agrees_across_ingress_replicas_and_spills_past_the_bound() -> None:
    async def scenario() -> None:
        ingress = [_router(imbalance_threshold=2, seed=s) for s in (1, 2)]
        replicas = _replicas(NAMES)
        prompts = [f"system prompt number {i} is long enough, and the user asks" for i in range(6)]
        for text in prompts:
            firsts = [(await r.choose_replicas(replicas, _request(text)))[0] for r in ingress]
            assert firsts[0] == firsts[1] and len(firsts[0]) == 1  # same replica, no talking
        text = prompts[0]
        owner = (await ingress[0].choose_replicas(replicas, _request(text)))[0][0]
        owner.queue_len = 3  # 3 < ceil(1.25 x 4 / 4) + 2 = 4: still the owner
        assert (await ingress[1].choose_replicas(replicas, _request(text)))[0] == [owner]
        owner.queue_len = 4  # at the bound: the next replica on this prefix's walk, for both routers
        spilled = [(await r.choose_replicas(replicas, _request(text)))[0] for r in ingress]
        assert spilled[0] == spilled[1] and spilled[0] != [owner]
        assert ingress[1].num_spilled_routes == 1 and ingress[1].num_affinity_routes == 7
        # The owner leaves: its prefixes go to the next replica of their walk, the others stay.
        rest = [r for r in replicas if r is not owner]
        assert (await ingress[0].choose_replicas(rest, _request(text)))[0] == spilled[0]

    asyncio.run(scenario())


def test_router_uses_two_choices_for_short_prompts_and_kv_usage_breaks_ties() -> None:
    async def scenario() -> None:
        router = _router(seed=3)
        a, b = _replicas(["a", "b"])
        a.routing_stats, b.routing_stats = {"kv_usage": 0.9}, {"kv_usage": 0.1}
        short = FakePending([WorkerRequest(request_id="r", prompt="hi")])  # shorter than a chunk: no key
        ranks = await router.choose_replicas([a, b], short)
        assert ranks[0] == [b, a] and router.num_load_routes == 1
        assert short.routing_context.should_backoff
        a.queue_len, b.queue_len = 0, 2
        assert (await router.choose_replicas([a, b], short))[0] == [a, b]
        assert await router.choose_replicas([], short) == []

    asyncio.run(scenario())


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_router_balances_a_shared_prefix_workload(replicas: int) -> None:
    """Many users, 3 long system prompts, 2 ingress routers, about 6 requests in flight per
    replica: nearly every request lands where its system prompt is already cached, and no
    replica's queue passes the bound."""
    async def scenario() -> None:
        ingress = [_router(imbalance_threshold=2, seed=s) for s in (5, 6)]
        fakes = _replicas(NAMES[:replicas])
        systems = [f"you are assistant {i} of the company; answer briefly and politely. " * 3 for i in range(3)]
        rng = random.Random(7)
        warm: set[tuple[int, str]] = set()
        hits = 0
        for i in range(300):
            s = rng.randrange(3)
            chosen = (await ingress[i % 2].choose_replicas(fakes, _request(systems[s] + f"user {i}")))[0][0]
            total = sum(r.queue_len for r in fakes)
            assert chosen.queue_len < capacity(total, replicas, 1.25, 2)
            hits += (s, chosen.replica_id.unique_id) in warm
            warm.add((s, chosen.replica_id.unique_id))
            chosen.queue_len += 1
            if total + 1 > 6 * replicas:  # steady state: a request finishes somewhere
                rng.choice([r for r in fakes if r.queue_len]).queue_len -= 1
        assert hits >= 0.9 * 300

    asyncio.run(scenario())


# ---- LoRA adapters: a request goes where its adapter is held ------------------------------------


def _adapter_request(lora: str | None, text: str = "hi") -> FakePending:
    from cbserve.serving.protocol import Sampling

    return FakePending([WorkerRequest(request_id="r", prompt=text, prefix_hashes=prefix_hashes(text, 16, 8),
                                      sampling=Sampling(lora=lora))])


def test_router_sends_an_adapter_to_a_replica_that_holds_it_within_the_bound() -> None:
    async def scenario() -> None:
        router = _router(imbalance_threshold=2, seed=4, adapter_load_factor=1.25)
        a, b, c = _replicas(["a", "b", "c"])
        b.routing_stats = {"loras": ["sql"]}
        a.queue_len = c.queue_len = 0
        b.queue_len = 3  # 3 < ceil(1.25 x 4 / 3) + 2 = 4: still b
        assert (await router.choose_replicas([a, b, c], _adapter_request("sql")))[0] == [b]
        b.queue_len = 5  # at the bound, ceil(1.25 x 6 / 3) + 2 = 5: the least loaded replica, which loads it
        spilled = (await router.choose_replicas([a, b, c], _adapter_request("sql")))[0][0]
        assert spilled in (a, c) and router.num_adapter_spreads == 1 and router.num_adapter_routes == 1
        # The replica it went to holds it from now on, before its routing stats say so.
        b.queue_len = 6
        spilled.queue_len = 2
        assert (await router.choose_replicas([a, b, c], _adapter_request("sql")))[0] == [spilled]
        # An adapter nobody holds: the least loaded replica; then it sticks there.
        first = (await router.choose_replicas([a, b, c], _adapter_request("chat")))[0][0]
        assert first.queue_len == min(r.queue_len for r in (a, b, c))
        first.queue_len += 1
        assert (await router.choose_replicas([a, b, c], _adapter_request("chat")))[0] == [first]
        # The least loaded replica with room for another adapter, before a less loaded full one.
        a.queue_len, b.queue_len, c.queue_len = 0, 1, 2
        a.routing_stats = {"loras": ["p", "q"], "lora_room": 0}
        assert (await router.choose_replicas([a, b, c], _adapter_request("new")))[0] == [b]
        b.routing_stats = c.routing_stats = {"lora_room": 0}
        assert (await router.choose_replicas([a, b, c], _adapter_request("newer")))[0] == [a]
        # With a prefix key, holders are tried in the prefix's ring order (the same in every router).
        a.queue_len = b.queue_len = c.queue_len = 0
        for r in (a, b, c):
            r.routing_stats = {"loras": ["tool"]}
        text = "a system prompt long enough to have a routing key, and more"
        others = [_router(imbalance_threshold=2, seed=s) for s in (7, 8)]
        firsts = [(await r.choose_replicas([a, b, c], _adapter_request("tool", text)))[0] for r in others]
        assert firsts[0] == firsts[1]

    asyncio.run(scenario())


def _adapter_loads(route_by_adapter: bool, requests: int = 600, warm: int = 100) -> float:
    """Share of requests after `warm` that made their replica load the adapter: 8 adapters chosen
    at random, 3 replicas each holding at most 4 (least recently used unloaded), 2 ingress routers,
    ~6 requests in flight per replica, routing stats refreshed every 20 requests. No replica's queue
    passes the adapters' bounded-load capacity (load factor 2)."""
    async def scenario() -> float:
        routers = [_router(imbalance_threshold=2, seed=s) for s in (11, 12)]
        fakes = _replicas(["x", "y", "z"])
        held: dict[str, collections.OrderedDict[str, None]] = {r.replica_id.unique_id: collections.OrderedDict()
                                                                for r in fakes}
        rng = random.Random(3)
        loads = 0
        for i in range(requests):
            if i % 20 == 0:
                for r in fakes:
                    cache = held[r.replica_id.unique_id]
                    r.routing_stats = {"loras": list(cache), "lora_room": 4 - len(cache)}
            lora = f"adapter-{rng.randrange(8)}"
            pending = _adapter_request(lora if route_by_adapter else None)
            chosen = (await routers[i % 2].choose_replicas(fakes, pending))[0][0]
            assert chosen.queue_len < capacity(sum(r.queue_len for r in fakes), 3, 2.0, 2)
            cache = held[chosen.replica_id.unique_id]
            if lora in cache:
                cache.move_to_end(lora)
            else:
                loads += i >= warm
                cache[lora] = None
                if len(cache) > 4:
                    cache.popitem(last=False)
            chosen.queue_len += 1
            if sum(r.queue_len for r in fakes) > 18:
                rng.choice([r for r in fakes if r.queue_len]).queue_len -= 1
        return loads / (requests - warm)

    return asyncio.run(scenario())


def test_adapter_loads_stay_below_5_percent_once_warm() -> None:
    assert _adapter_loads(route_by_adapter=True) < 0.05
    assert _adapter_loads(route_by_adapter=False) > 0.3  # by load alone, replicas keep reloading
