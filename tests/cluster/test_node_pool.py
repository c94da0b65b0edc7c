"""The per-node KV pool on Ray (`cluster/node_pools.py`): two engine replicas of one node share it.

Replica A computes a long shared system prompt; replica B, given the same system prompt and
another question, pulls the prefix's pages from the node's pool instead of computing them, and
its tokens equal those of a replica without the pool. The engines are the batch job's engine
actors (`EngineActor`: an `EngineReplica` in a Ray actor), which build their engine config the
way a Serve replica does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from cbserve.cluster.settings import ClusterArgs
from cbserve.serving.protocol import Sampling, WorkerRequest
from tests.support.cluster import start_local_ray, tiny_model_dir

PAGE = 16
SYSTEM_TOKENS = 20 * PAGE
QUESTION_TOKENS = 8


@pytest.fixture(scope="module")
def ray_local():
    import ray

    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        from cbserve.cluster import node_pools

        node_pools.close_all()
        ray.shutdown()


def _args(model_dir: Path, **offload: Any) -> dict[str, Any]:
    return {"model": str(model_dir), "engine": {"page_size": PAGE}, "worker": {"num_cpus": 0.5},
            "cpu_offload": offload}


def _engine(ray: Any, args: dict[str, Any]) -> Any:
    from cbserve.batch.backends import EngineActor

    return ray.remote(EngineActor).options(num_cpus=0.5).remote(ClusterArgs(**args))  # parsed, as the batch job does


def _run(ray: Any, engine: Any, ids: list[int], rid: str) -> list[int]:
    req = WorkerRequest(request_id=rid, prompt_ids=ids, max_tokens=6, sampling=Sampling(temperature=0.0))
    result = ray.get(engine.run.remote(req))
    assert result.error is None, result.error
    return result.token_ids


def test_two_replicas_of_a_node_share_its_pool(ray_local: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    from cbserve.cluster import node_pools

    ray = ray_local
    model_dir = tiny_model_dir(tmp_path_factory)
    rng = random.Random(0)
    system = [rng.randrange(10, 390) for _ in range(SYSTEM_TOKENS)]
    a_ids = system + [rng.randrange(10, 390) for _ in range(QUESTION_TOKENS)]
    b_ids = system + [rng.randrange(10, 390) for _ in range(QUESTION_TOKENS)]

    shared = _args(model_dir, per_node_gib=0.02, node_pool=True, staging_gib=0.01)
    a, b = _engine(ray, shared), _engine(ray, shared)
    info_a, info_b = ray.get([a.info.remote(), b.info.remote()])
    assert info_a["node_kv_pool"] == info_b["node_kv_pool"] is not None  # one pool for the node
    assert info_a["node_kv_pool"].startswith("job_")  # and for this job (a batch job's engines)
    assert info_a["cpu_offload_gib"] == 0.01  # each replica keeps only its staging pool
    [owner] = node_pools.owners().values()
    assert ray.get(owner.name.remote()) == info_a["node_kv_pool"]

    _run(ray, a, a_ids, "a")
    assert ray.get(owner.stats.remote())["ready"] >= SYSTEM_TOKENS // PAGE  # A published its prompt pages
    got_b = _run(ray, b, b_ids, "b")
    stats_b = ray.get(b.stats.remote())
    assert stats_b["node_pool_hit_tokens"] == SYSTEM_TOKENS
    assert stats_b["prompt_tokens_computed"] == len(b_ids) - SYSTEM_TOKENS

    # The same request on a replica without the pool: every prompt token computed, same tokens.
    alone = _engine(ray, _args(model_dir))
    assert ray.get(alone.info.remote())["node_kv_pool"] is None
    assert _run(ray, alone, b_ids, "c") == got_b
    assert ray.get(alone.stats.remote())["prompt_tokens_computed"] == len(b_ids)

    assert node_pools.close_all() == 1
    assert node_pools.owners() == {}


def test_a_new_budget_replaces_the_nodes_pool(ray_local: Any) -> None:
    """An owner left with another capacity (an earlier deployment) is replaced, not reused: the
    configured budget holds, and engines on the old pool see it closed."""
    from cbserve.cluster import node_pools
    from cbserve.workers.kv.node_pool import NodeKVPool

    ray = ray_local
    name = node_pools.ensure_node_pool(1 << 20)
    assert node_pools.ensure_node_pool(1 << 20) == name
    old = NodeKVPool.attach(name)
    assert old.alive()
    assert node_pools.ensure_node_pool(2 << 20) == name
    [owner] = node_pools.owners().values()
    assert ray.get(owner.stats.remote())["capacity_bytes"] == 2 << 20
    assert not old.alive()
    old.detach()
    assert node_pools.close_all() == 1


def test_two_apps_on_a_node_keep_their_own_pools(ray_local: Any) -> None:
    """Each app (and deployment) has its own pool and owner on a node: a second app with another
    budget neither shares the first app's pages nor closes its pool."""
    from cbserve.cluster import node_pools
    from cbserve.workers.kv.node_pool import NodeKVPool

    ray = ray_local
    first = node_pools.ensure_node_pool(1 << 20, scope="app:first/LLMWorker")
    pool = NodeKVPool.attach(first)
    second = node_pools.ensure_node_pool(2 << 20, scope="app:second/LLMWorker")
    other_deployment = node_pools.ensure_node_pool(1 << 20, scope="app:first/Other")
    assert len({first, second, other_deployment}) == 3
    assert pool.alive()  # the second app's budget did not replace the first app's pool
    assert node_pools.ensure_node_pool(1 << 20, scope="app:first/LLMWorker") == first
    capacities = {ray.get(o.name.remote()): ray.get(o.stats.remote())["capacity_bytes"]
                  for o in node_pools.owners().values()}
    assert capacities == {first: 1 << 20, second: 2 << 20, other_deployment: 1 << 20}
    pool.detach()
    assert node_pools.close_all() == 3


def test_a_serve_replica_scopes_its_pool_by_app_and_deployment(ray_local: Any) -> None:
    """What `ensure_node_pool` names a Serve replica's pool by: its app and deployment."""
    from ray import serve

    from cbserve.cluster import node_pools

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Scope:
        def __call__(self) -> str:
            return node_pools.pool_scope()

    serve.start(proxy_location="Disabled")  # a handle call: no HTTP port taken
    try:
        handles = [serve.run(Scope.options(name=d).bind(), name=app, route_prefix=None)
                   for app, d in (("first", "LLMWorker"), ("second", "LLMWorker"))]
        scopes = [h.remote().result(timeout_s=60) for h in handles]
    finally:
        serve.shutdown()
    assert scopes == ["app:first/LLMWorker", "app:second/LLMWorker"]
    assert node_pools.pool_scope().startswith("job:")  # this driver is no replica


def test_node_pool_refuses_tensor_parallel() -> None:
    with pytest.raises(ValueError, match="node_pool works with tp_size 1 only"):
        ClusterArgs(tp_size=2, cpu_offload={"per_node_gib": 1, "node_pool": True})
    with pytest.raises(ValueError, match="engine.node_kv_pool is set by the cluster"):
        ClusterArgs(engine={"node_kv_pool": "x"})


def test_staging_must_be_positive() -> None:
    with pytest.raises(ValueError, match="staging_gib"):
        ClusterArgs(cpu_offload={"per_node_gib": 1, "node_pool": True, "staging_gib": 0})


def test_node_pool_settings_that_would_be_ignored_are_refused() -> None:
    with pytest.raises(ValueError, match="staging_gib is used only with node_pool: true"):
        ClusterArgs(cpu_offload={"per_node_gib": 1, "staging_gib": 0.5})
    with pytest.raises(ValueError, match="node_pool needs a budget"):
        ClusterArgs(cpu_offload={"node_pool": True})
    ClusterArgs(cpu_offload={"by_node": {"10.0.0.1": 2.0}, "node_pool": True})  # one node's budget is enough
    dumped = ClusterArgs().model_dump()  # what each replica receives: every default written out
    assert ClusterArgs(**dumped).cpu_offload.staging_gib == dumped["cpu_offload"]["staging_gib"]
