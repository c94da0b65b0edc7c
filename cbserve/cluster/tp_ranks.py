"""Tensor-parallel ranks of one worker replica, as Ray actors in the replica's placement group.

The replica is rank 0 and runs the manager; ranks 1..N-1 are `TPRank` actors, one per bundle
of the placement group `app.worker_options` reserves (STRICT_PACK: one node). All ranks join one
`torch.distributed` group through the replica's rendezvous (bound before its port is
published); the engine then sees an externally launched group (`tp_launcher="external"`,
`cbserve.workers.parallel.launch`): rank 0's engine broadcasts each step and the actors follow
(`serve_tensor_parallel_rank`) until the manager shuts down. Each rank loads only its own shard
of the weights (`cbserve.load_model_shard`). The actors are owned by the replica, so Ray stops
them if the replica dies.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from cbserve.cluster.settings import MODEL_PROCESS_ENV, runtime_env
from cbserve.config import ContinuousBatchingConfig

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_on_device(model_name: str | None, dtype_name: str, rank: int = 0, world: int = 1) -> tuple[Any, Any]:
    """This rank's part of the model on this node's device: the whole model when `world` is 1,
    else only its tensor-parallel shard, read slice by slice from the checkpoint (never the whole
    weights); the tokenizer on rank 0 only."""
    import cbserve

    if world > 1:
        return cbserve.load_model_shard(model_name, rank, world, dtype=dtype_name, device=_device(), tokenizer=rank == 0)
    model, tokenizer = cbserve.load_model(name_or_path=model_name, dtype=dtype_name)
    device = _device()
    if device.type != "cpu":
        model = model.to(device)
    return model, tokenizer


RANK_NAMESPACE = "cbserve"  # a fixed namespace for the named rank actors, so they can be looked up


def rank_actor_name(replica: str, rank: int) -> str:
    return f"{replica}-tp-rank{rank}"


@ray.remote(max_concurrency=2)  # `follow` blocks one thread; `ping` answers on the other
class TPRank:
    def __init__(self, model_name: str | None, dtype_name: str, rank: int, world: int):
        self.rank = rank
        self.model, _ = load_on_device(model_name, dtype_name, rank, world)

    def ping(self) -> int:
        return self.rank

    def follow(self, address: str, port: int, world: int, engine: ContinuousBatchingConfig) -> str:
        """Join the group, then run every step rank 0 broadcasts until it shuts down."""
        from cbserve.workers.parallel.launch import join_rendezvous, serve_tensor_parallel_rank

        join_rendezvous(address, port, self.rank, world, _device(), JOIN_TIMEOUT_S)
        serve_tensor_parallel_rank(self.model, engine)
        return f"rank {self.rank} done"


class RankGroup:
    """Starts ranks 1..N-1 in the current placement group; `join` makes this process rank 0."""

    def __init__(self, model_name: str | None, dtype_name: str, world: int, engine: ContinuousBatchingConfig,
                 num_cpus: float, num_gpus: float, name: str | None = None):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("tp_size > 1 needs the replica's placement group (see app.worker_options)")
        from cbserve.workers.parallel.launch import Rendezvous

        address = ray.util.get_node_ip_address()
        # Listening before its port is published: nothing else can take the port meanwhile.
        self.rendezvous = Rendezvous(address, world, JOIN_TIMEOUT_S)
        port = self.rendezvous.port
        # Named after their replica (`<name>-tp-rank<r>`, namespace `cbserve`) so that `ray list
        # actors` shows whose ranks they are, and an operator (or a test) can find one.
        self.actors = [
            TPRank.options(
                name=None if name is None else rank_actor_name(name, rank),
                namespace=None if name is None else RANK_NAMESPACE,
                num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env(MODEL_PROCESS_ENV),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=rank),
            ).remote(model_name, dtype_name, rank, world)
            for rank in range(1, world)
        ]
        self.done = [a.follow.remote(address, port, world, engine) for a in self.actors]
        self._address, self._port, self._world = address, port, world

    def join(self) -> None:
        """Join as rank 0 (after loading this replica's model, while the actors load theirs)."""
        self.rendezvous.join(_device())  # returns once every rank has joined
        logger.info("tensor-parallel group of %d ranks joined at %s:%d", self._world, self._address, self._port)

    def stop(self, timeout: float = 30.0) -> None:
        """After the manager is destroyed (which releases the followers): reap the actors."""
        ready, _ = ray.wait(self.done, num_returns=len(self.done), timeout=timeout)
        if len(ready) < len(self.done):
            logger.warning("%d tensor-parallel ranks did not finish; killing them", len(self.done) - len(ready))
        for actor in self.actors:
            ray.kill(actor)
