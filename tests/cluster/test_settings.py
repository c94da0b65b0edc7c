"""`ClusterArgs` from the YAML to the replicas, without a Ray cluster: the `args` of a Serve config
are parsed once, in `build_app`, `engine` into a `ContinuousBatchingConfig`; every deployment is
bound to that object (Ray pickles it), never to a dump it would parse again; each replica's engine
config is `args.engine` plus the fields the cluster owns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from cbserve.cluster.app import build_app
from cbserve.cluster.engine_replica import engine_config
from cbserve.cluster.settings import CLUSTER_OWNED_ENGINE_FIELDS, ClusterArgs
from cbserve.config import ContinuousBatchingConfig

RAY_CONFIG = Path(__file__).resolve().parents[2] / "ray_config.yaml"


def yaml_args() -> dict[str, Any]:
    return yaml.safe_load(RAY_CONFIG.read_text())["applications"][0]["args"]


def test_engine_is_a_typed_config_whose_dump_is_the_yaml_again() -> None:
    given = yaml_args()
    args = ClusterArgs(**given)
    assert isinstance(args.engine, ContinuousBatchingConfig)
    assert {k: getattr(args.engine, k) for k in given["engine"]} == given["engine"]
    # A dump holds the engine fields the YAML set, not every default: it reads back as the same args.
    dumped = args.model_dump(mode="json")
    assert dumped["engine"] == given["engine"]
    assert ClusterArgs(**dumped) == args
    assert ClusterArgs(**ClusterArgs(tp_size=2).model_dump()).tp_size == 2
    with pytest.raises(ValidationError, match=r"engine\.page_size"):  # named where the YAML has it
        ClusterArgs(engine={"page_size": 2})


@pytest.mark.parametrize("owned", CLUSTER_OWNED_ENGINE_FIELDS)
def test_engine_fields_the_cluster_owns_are_refused(owned: str) -> None:
    value = {"tp_size": 2, "tp_launcher": "external", "cpu_offload_space": 1.0, "node_kv_pool": "p"}[owned]
    with pytest.raises(ValidationError, match=f"engine.{owned} is set by the cluster"):
        ClusterArgs(engine={owned: value})
    if owned != "node_kv_pool":  # which needs cpu_offload_space set too
        with pytest.raises(ValidationError, match=f"engine.{owned} is set by the cluster"):
            ClusterArgs(engine=ContinuousBatchingConfig(**{owned: value}))


def test_engine_config_adds_the_cluster_fields_to_the_parsed_engine() -> None:
    args = ClusterArgs(tp_size=2, engine={"page_size": 16, "max_queue_size": 5, "scheduler": "prefill_first"})
    cfg = engine_config(args)
    assert isinstance(cfg, ContinuousBatchingConfig) and cfg is not args.engine
    assert (cfg.page_size, cfg.max_queue_size, cfg.scheduler) == (16, 5, "prefill_first")
    assert (cfg.tp_size, cfg.tp_launcher, cfg.cpu_offload_space) == (2, "external", 0.0)
    assert cfg.per_request_processors and cfg.return_logprobs
    assert args.engine.tp_size == 1 and args.engine.model_fields_set == {"page_size", "max_queue_size", "scheduler"}


@pytest.mark.parametrize("placement", ["worker", "own"])
def test_build_app_binds_every_deployment_to_the_parsed_args(placement: str) -> None:
    """What `serve run` / `serve deploy` do with the config's plain `args`: Serve's own builder call,
    then its build of the deployments, whose init args it cloudpickles for the replicas."""
    from ray import cloudpickle
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as serve_build_app
    from ray.serve.handle import DeploymentHandle

    given = {**yaml_args(), "ingress_placement": placement}
    app = call_user_app_builder_with_args_if_necessary(build_app, given)
    built = {d.name: d for d in serve_build_app(app, name="cbserve").deployments}
    takes_args = {"LLMWorker", "OpenAIIngress"} if placement == "own" else {"LLMWorker"}
    assert set(built) == takes_args | {"StatsBoard"}
    expected = ClusterArgs(**given)
    for name in takes_args:
        (args,) = [a for a in built[name].init_args if not isinstance(a, DeploymentHandle)]
        assert isinstance(args, ClusterArgs), name
        replica_gets = cloudpickle.loads(cloudpickle.dumps(args))
        assert isinstance(replica_gets.worker.num_cpus, float)  # build_app worked out "auto"
        assert replica_gets == expected.model_copy(update={"worker": replica_gets.worker})
        assert replica_gets.engine.model_fields_set == set(given["engine"])
