"""Autoscaling on the engine's signals and the drain budget, without a Ray cluster: the policy
(`cluster/autoscaling.py`) on fake Serve contexts, the deployment options that install it, and a
stopping replica's teardown against the time Serve gives it before killing it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from cbserve.cluster.autoscaling import KV_USAGE, RUNNING, WAITING, EngineAutoscalingPolicy, desired_replicas
from cbserve.cluster.settings import ClusterArgs


@dataclass
class FakeConfig:
    target: float = 32.0

    def get_target_ongoing_requests(self) -> float:
        return self.target


@dataclass
class FakeContext:
    """The fields of Serve's `AutoscalingContext` the policy reads."""

    current_num_replicas: int
    total_num_requests: float
    aggregated_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    config: FakeConfig = field(default_factory=FakeConfig)
    policy_state: dict[str, Any] = field(default_factory=dict)


def _engine(waiting: list[float], running: list[float], kv: list[float]) -> dict[str, dict[str, float]]:
    return {name: {f"r{i}": v for i, v in enumerate(values)}
            for name, values in ((WAITING, waiting), (RUNNING, running), (KV_USAGE, kv))}


def test_ongoing_requests_alone_scale_as_serves_default() -> None:
    policy = EngineAutoscalingPolicy()
    assert policy(FakeContext(2, 128))[0] == 4  # 128 ongoing / 32 per replica
    assert policy(FakeContext(2, 16))[0] == 0.5  # Serve rounds up and applies min_replicas and delays
    assert policy(FakeContext(2, 16, _engine([0, 0], [8, 8], [0.1, 0.1])))[0] == 0.5  # engines idle too


def test_kv_usage_scales_up_before_the_request_count_does() -> None:
    """Few, long requests: 16 ongoing of 32 per replica, but the KV cache is 95% full."""
    policy = EngineAutoscalingPolicy(target_kv_usage=0.8)
    wanted, _ = policy(FakeContext(2, 16, _engine([0, 0], [8, 8], [0.95, 0.95])))
    assert wanted == pytest.approx(2 * 0.95 / 0.8)
    assert EngineAutoscalingPolicy(target_kv_usage=None)(FakeContext(2, 16, _engine([0, 0], [8, 8], [1, 1])))[0] == 0.5


def test_waiting_requests_scale_up_to_run_them_at_the_current_rate() -> None:
    """Each engine runs 4 and queues 12 (its batch is full): 4x the replicas would run them all."""
    policy = EngineAutoscalingPolicy(target_waiting_requests=2)
    wanted, state = policy(FakeContext(2, 32, _engine([12, 12], [4, 4], [0.5, 0.5])))
    assert wanted == pytest.approx(2 * (4 + 12) / 4) and state == {}
    assert policy(FakeContext(2, 32, _engine([2, 2], [4, 4], [0.4, 0.4])))[0] == 1  # at the targets: no
    assert desired_replicas(0, 5, 32, {}, 0.8, 2) == 1  # from zero: Serve's cold start rule


def test_worker_options_install_the_policy_and_size_the_drain() -> None:
    from ray.serve.config import AutoscalingConfig

    from cbserve.cluster.app import AUTOSCALING_POLICY, worker_options

    auto = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    opts = worker_options(ClusterArgs(worker={"autoscaling": auto, "target_kv_usage": 0.7, "num_cpus": 1}))
    cfg = AutoscalingConfig(**opts["autoscaling_config"])  # what Serve will build
    assert cfg.policy.policy_function == AUTOSCALING_POLICY
    assert cfg.policy.policy_kwargs == {"target_kv_usage": 0.7, "target_waiting_requests": 2.0}
    assert callable(cfg.policy.get_policy())  # Serve can import it
    off = worker_options(ClusterArgs(worker={"autoscaling": auto, "target_kv_usage": None,
                                             "target_waiting_requests": None, "num_cpus": 1}))
    assert "policy" not in off["autoscaling_config"]
    w = {"graceful_shutdown_timeout_s": 60, "graceful_shutdown_wait_loop_s": 2, "teardown_timeout_s": 10}
    fixed = worker_options(ClusterArgs(worker={**w, "num_cpus": 1}))
    assert fixed["graceful_shutdown_timeout_s"] == 72  # requests 60 (+ Serve's poll 2), then teardown 10


class SlowManager:
    """Records how `__del__` waits on it; a stop that takes `stop_s`."""

    def __init__(self, stop_s: float):
        self.stop_s, self.calls = stop_s, []

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self.calls.append(("stop", timeout))
        time.sleep(min(self.stop_s, timeout or 0))

    def destroy(self, timeout: float | None = None) -> None:
        self.calls.append(("destroy", timeout))


class SlowRanks:
    def __init__(self) -> None:
        self.timeout: float | None = None

    def stop(self, timeout: float = 30.0) -> None:
        self.timeout = timeout


def test_replica_teardown_fits_in_the_time_serve_gives_it() -> None:
    from cbserve.cluster.engine_replica import EngineReplica

    replica = object.__new__(EngineReplica)  # the fields `__del__` reads, no model
    replica.args = ClusterArgs(tp_size=2, worker={"teardown_timeout_s": 1.0, "num_cpus": 1})
    replica.replica, replica._board = "r", None
    replica.manager, replica.ranks = SlowManager(stop_s=5.0), SlowRanks()
    manager, ranks = replica.manager, replica.ranks
    t0 = time.monotonic()
    replica.__del__()
    elapsed = time.monotonic() - t0
    assert manager.calls == [("stop", 0.5), ("destroy", 0)]  # then the loop is hard-stopped
    assert ranks.timeout is not None and elapsed + ranks.timeout <= 1.0 + 0.05
    assert replica.manager is None
    replica.__del__()  # a second call does nothing
