"""Load balancing without shared state: consistent hashing with bounded loads, and power-of-two
choices. Plain Python on replica ids and queue lengths (no Ray); `router.py` applies it in Serve.

- A request whose prompt has a routing key (the hash of its first `key_chunks` prefix chunks,
  `serving/front/prefix.py`) walks a hash ring of the live replicas from the key's point. Every ingress
  replica builds the same ring from the same replica ids, so they all send a prefix to the same
  replica without talking to each other; when a replica joins or leaves, only the keys next to
  its points move.
- Bounded load (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads"):
  the walk takes the first replica whose queue is below `capacity(...)`, about `load_factor`
  times the mean queue (plus a slack of `imbalance_threshold` requests, so that light load never
  breaks affinity). A hot prefix overflows to the next replica on *its* walk, the same one for
  every ingress replica, so the overflow builds a second warm cache instead of scattering.
- A request without a key goes to the less loaded of two replicas drawn at random (power of
  two choices): unlike "the shortest queue", two ingress replicas with the same stale view of
  the queues do not both pick the same replica.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

R = TypeVar("R", bound=Hashable)


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def routing_key(hashes: Sequence[int], key_chunks: int) -> int | None:
    """The hash of the prompt's first `key_chunks` chunks (fewer if the prompt is shorter); None
    when the prompt is shorter than one chunk."""
    if not hashes:
        return None
    return hashes[min(len(hashes), key_chunks) - 1]


class HashRing:
    """`virtual_nodes` points per replica on a 64-bit ring, placed by the hash of the replica's
    name: the same names give the same ring in every process."""

    def __init__(self, names: Iterable[str], virtual_nodes: int = 64):
        points = sorted(
            (_point(f"{name}#{i}".encode()), name) for name in set(names) for i in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]
        self.names = frozenset(self._names)

    def walk(self, key: int) -> list[str]:
        """Every replica once, in the order met going clockwise from `key`'s point."""
        if not self._names:
            return []
        start = bisect.bisect_left(self._hashes, _point(key.to_bytes(8, "little")))
        seen: dict[str, None] = {}
        n = len(self._names)
        for i in range(n):
            seen.setdefault(self._names[(start + i) % n], None)
            if len(seen) == len(self.names):
                break
        return list(seen)


def capacity(total_load: int, replicas: int, load_factor: float, slack: int) -> int:
    """Most requests a replica may hold and still take a keyed one: `ceil(load_factor x mean)`
    counting the new request, plus `slack`."""
    return math.ceil(load_factor * (total_load + 1) / max(1, replicas)) + slack


def bounded_load_choice(walk: Sequence[R], loads: dict[R, int], load_factor: float, slack: int) -> R:
    """The first replica of `walk` whose load is below capacity (the least loaded if none is:
    every queue is then above the bound only when `slack` and `load_factor` are tiny)."""
    cap = capacity(sum(loads.get(r, 0) for r in walk), len(walk), load_factor, slack)
    for r in walk:
        if loads.get(r, 0) < cap:
            return r
    return min(walk, key=lambda r: loads.get(r, 0))


def two_choices(candidates: Sequence[R], key: Callable[[R], tuple[float, ...]],
                rng: random.Random | None = None) -> list[R]:
    """Two distinct candidates drawn at random, the better (smaller `key`) first; one when there
    is only one. Ties keep the random draw's order: routing decisions made concurrently on one
    stale view (all awaiting the same queue-length probe) would otherwise all pick the first
    candidate Serve lists."""
    return sorted((rng or random).sample(list(candidates), min(2, len(candidates))), key=key)
