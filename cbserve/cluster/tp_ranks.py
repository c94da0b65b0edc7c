"""Tensor-parallel ranks of one worker replica, as Ray actors in the replica's placement group.

The replica is rank 0 and runs the manager; ranks 1..N-1 are `TPRank` actors, one per bundle
of the placement group `app.worker_options` reserves (STRICT_PACK: one node). All ranks join one
`torch.distributed` group over TCP at the replica's address; the engine then sees an
externally launched group (`tp_launcher="external"`, `cbserve.workers.parallel.launch`): rank 0's engine broadcasts each step
and the actors follow (`serve_tensor_parallel_rank`) until the manager shuts down. The actors
are owned by the replica, so Ray stops them if the replica dies.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Any

import ray

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _join(address: str, port: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    from cbserve.workers.parallel.groups import data_backend

    dist.init_process_group(data_backend(_device()), init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=JOIN_TIMEOUT_S))


def load_on_device(model_name: str | None, dtype_name: str) -> tuple[Any, Any]:
    import torch

    import cbserve

    model, tokenizer = cbserve.load_model(name_or_path=model_name, dtype=getattr(torch, dtype_name))
    device = _device()
    if device.type != "cpu":
        model = model.to(device)
    return model, tokenizer


RANK_NAMESPACE = "cbserve"  # a fixed namespace for the named rank actors, so they can be looked up


def rank_actor_name(replica: str, rank: int) -> str:
    return f"{replica}-tp-rank{rank}"


@ray.remote(max_concurrency=2)  # `follow` blocks one thread; `ping` answers on the other
class TPRank:
    def __init__(self, model_name: str | None, dtype_name: str, rank: int):
        self.rank = rank
        self.model, _ = load_on_device(model_name, dtype_name)

    def ping(self) -> int:
        return self.rank

    def follow(self, address: str, port: int, world: int, engine: dict[str, Any]) -> str:
        """Join the group, then run every step rank 0 broadcasts until it shuts down."""
        from cbserve.config import ContinuousBatchingConfig
        from cbserve.workers.parallel.launch import serve_tensor_parallel_rank

        _join(address, port, self.rank, world)
        serve_tensor_parallel_rank(self.model, ContinuousBatchingConfig(**engine))
        return f"rank {self.rank} done"


class RankGroup:
    """Starts ranks 1..N-1 in the current placement group; `join` makes this process rank 0."""

    def __init__(self, model_name: str | None, dtype_name: str, world: int, engine: dict[str, Any],
                 num_cpus: float, num_gpus: float, name: str | None = None):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("tp_size > 1 needs the replica's placement group (see app.worker_options)")
        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        # Named after their replica (`<name>-tp-rank<r>`, namespace `cbserve`) so that `ray list
        # actors` shows whose ranks they are, and an operator (or a test) can find one.
        self.actors = [
            TPRank.options(
                name=None if name is None else rank_actor_name(name, rank),
                namespace=None if name is None else RANK_NAMESPACE,
                num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=rank),
            ).remote(model_name, dtype_name, rank)
            for rank in range(1, world)
        ]
        self.done = [a.follow.remote(address, port, world, engine) for a in self.actors]
        self._address, self._port, self._world = address, port, world

    def join(self) -> None:
        """Join as rank 0 (after loading this replica's model, while the actors load theirs)."""
        _join(self._address, self._port, 0, self._world)  # returns once every rank has joined
        logger.info("tensor-parallel group of %d ranks joined at %s:%d", self._world, self._address, self._port)

    def stop(self, timeout: float = 30.0) -> None:
        """After the manager is destroyed (which releases the followers): reap the actors."""
        ready, _ = ray.wait(self.done, num_returns=len(self.done), timeout=timeout)
        if len(ready) < len(self.done):
            logger.warning("%d tensor-parallel ranks did not finish; killing them", len(self.done) - len(ready))
        for actor in self.actors:
            ray.kill(actor)
