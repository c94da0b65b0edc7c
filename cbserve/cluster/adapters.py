"""LoRA adapters across the app (issue 33): which ones clients may name, and which ones a worker
replica holds.

- `AdapterCatalog` (each ingress replica): adapter name -> PEFT folder, the `lora_modules` of the
  args plus those loaded at run time (`POST /v1/load_lora_adapter`). The stats board holds the
  app's copy; an ingress replica reads it every stats period, and at once (at most once a
  period) when a request names an adapter it does not know, so an adapter loaded through one
  ingress replica is known to the others before their next period.
- `ReplicaAdapters` (each worker replica): adapters are loaded the first time a request sent to
  the replica names one (the request carries the folder), at most `max_cpu_loras` kept in host
  memory, least recently used idle ones unloaded past it, and unloaded too once the catalog no
  longer has them. The request router (`router.py`) sends an adapter's requests to the replicas
  that hold it while their load allows, so loads are rare once warm.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import APIError

logger = logging.getLogger(__name__)

BOARD_TIMEOUT_S = 5.0


class AdapterCatalog(Mapping[str, str]):
    """The adapters clients may name as `model`: name -> PEFT folder."""

    def __init__(self, declared: Mapping[str, str], board: Any = None, period_s: float = 1.0):
        self._paths = dict(declared)
        self._board = board
        self._period_s = period_s
        self._fetched_at = -math.inf
        self._task: asyncio.Task[None] | None = None

    def __getitem__(self, name: str) -> str:
        return self._paths[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def start(self) -> None:
        """Read the board every period from the running event loop (the replica's)."""
        if self._board is None or self._task is not None:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())
        except RuntimeError:  # no loop (built outside Serve): refreshed on misses only
            logger.debug("adapter catalog: no running loop")

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._period_s)

    async def refresh(self) -> None:
        if self._board is None:
            return
        self._fetched_at = time.monotonic()
        try:
            self._paths = dict(await asyncio.wait_for(self._board.adapters.remote(), timeout=BOARD_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - keep what is known; the next period asks again
            logger.debug("could not read the adapter catalog: %r", exc)

    async def knows(self, name: str | None) -> None:
        """Before a request naming `name` is checked: a name not known here is looked up on the
        board, at most once a period (an unknown name cannot make every request call it)."""
        if name is None or name in self._paths or time.monotonic() - self._fetched_at < self._period_s:
            return
        await self.refresh()

    async def add(self, name: str, path: str, replace: bool) -> None:
        if self._board is not None:
            refused = await asyncio.wait_for(self._board.add_adapter.remote(name, path, replace),
                                             timeout=BOARD_TIMEOUT_S)
            if refused:
                raise APIError(400, refused, "lora_name")
        elif name in self._paths and not replace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self._paths[name] = path

    async def remove(self, name: str) -> None:
        found = name in self._paths
        if self._board is not None:
            found = await asyncio.wait_for(self._board.remove_adapter.remote(name), timeout=BOARD_TIMEOUT_S)
        if not found:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")
        self._paths.pop(name, None)


class ReplicaAdapters:
    """The adapters one worker replica's manager holds (loaded on first use, bounded, LRU)."""

    def __init__(self, manager: Any, capacity: int):
        self._manager = manager
        self.capacity = capacity
        self._paths: collections.OrderedDict[str, str] = collections.OrderedDict()  # least recently used first
        self._known: dict[str, str] = {}  # the app's catalog as last heard (declared adapters at first)
        self._users: collections.Counter[str] = collections.Counter()  # this replica's live requests per adapter
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._check_lock = asyncio.Lock()
        self.loads: collections.Counter[str] = collections.Counter()
        self.unloads = 0

    def names(self) -> list[str]:
        return list(self._paths)

    def room(self) -> int:
        """Adapters it can load before it must unload one."""
        return max(0, self.capacity - len(self._paths))

    async def check(self, path: str) -> None:
        """Read the adapter folder `path` as a load would (`InvalidRequestError` naming `lora_path`
        when it does not read), without keeping it."""
        async with self._check_lock:
            name = f"check:{path}"  # not a name clients can give (`ADAPTER_NAME`)
            await asyncio.to_thread(self._manager.load_lora, name, path)
            self._manager.unload_lora(name)

    def adopt(self, name: str, path: str) -> None:
        """Load an adapter now (the declared ones, at start)."""
        self._known[name] = path
        self._manager.load_lora(name, path)
        self._paths[name] = path
        self.loads[name] += 1

    async def load(self, name: str, path: str) -> None:
        """Hold `name` from `path`: loaded if it is not held, reloaded if held from another folder
        (refused while requests of this replica use it). A bad folder raises `InvalidRequestError`
        naming `lora_path`; the adapter is then not held."""
        async with self._locks[name]:
            held = self._paths.get(name)
            if held == path:
                self._paths.move_to_end(name)
                return
            if held is not None:
                if self._users[name]:
                    raise APIError(503, f"adapter {name!r} is being replaced while requests use it; retry", "model",
                                   retry_after_s=1)
                self._unload(name)
            await asyncio.to_thread(self._manager.load_lora, name, path)
            self._paths[name] = path
            self.loads[name] += 1
            logger.info("LoRA adapter %s loaded from %s", name, path)
        self._evict()

    async def acquire(self, name: str, path: str | None) -> None:
        """A request of adapter `name` starts here: it is loaded if needed (`path`: its folder, from
        the ingress's catalog; None, from a caller without one such as the batch job: the folder
        the app's catalog had when last heard, else the engine resolves the name itself)."""
        path = path or self._known.get(name)
        if path is not None:
            try:
                await self.load(name, path)
            except InvalidRequestError as exc:  # the catalog's folder no longer reads: the request's `model`
                raise InvalidRequestError("model", f"LoRA adapter {name!r} could not be loaded: {exc.message}") from exc
        elif name in self._paths:
            self._paths.move_to_end(name)
        self._users[name] += 1

    def release(self, name: str) -> None:
        self._users[name] -= 1
        if self._users[name] <= 0:
            del self._users[name]
            self._evict()

    def retain(self, catalog: Mapping[str, str]) -> None:
        """Unload the idle adapters the catalog no longer has (or has from another folder)."""
        self._known = dict(catalog)
        for name, path in list(self._paths.items()):
            if catalog.get(name) != path and not self._users[name]:
                self._unload(name)

    def _evict(self) -> None:
        for name in [n for n in self._paths if not self._users[n]]:
            if len(self._paths) <= self.capacity:
                return
            self._unload(name)

    def _unload(self, name: str) -> None:
        try:
            self._manager.unload_lora(name)
        except InvalidRequestError as exc:  # a request not yet finished in the engine: next time
            logger.debug("LoRA adapter %s stays loaded: %s", name, exc.message)
            return
        self._paths.pop(name, None)
        self.unloads += 1
        logger.info("LoRA adapter %s unloaded", name)

    def stats(self) -> dict[str, Any]:
        return {"lora_adapter_loads": dict(self.loads), "lora_adapter_unloads": self.unloads,
                "lora_adapters_held": len(self._paths)}
