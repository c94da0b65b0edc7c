"""LoRA adapters across the app without Ray (`cluster/adapters.py`, issue 33): a worker replica
loads an adapter with the first request that names it, keeps at most `max_cpu_loras` (least
recently used idle ones unloaded) and lets go of those the catalog dropped; the ingress's catalog
learns adapters from the stats board; the board answers reports with the catalog."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cbserve.cluster.adapters import AdapterCatalog, ReplicaAdapters
from cbserve.cluster.settings import ClusterArgs
from cbserve.cluster.stats_board import StatsBoard
from cbserve.errors import InvalidRequestError
from cbserve.serving.api_errors import APIError


class FakeManager:
    """The manager's LoRA calls: loads take a while (another thread), a folder named "bad" does
    not read, an adapter with live requests cannot be unloaded."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.busy: set[str] = set()
        self.load_calls = 0

    def load_lora(self, name: str, path: str) -> None:
        self.load_calls += 1
        time.sleep(0.01)
        if "bad" in path:
            raise InvalidRequestError("lora_path", f"{path}: no adapter_config.json")
        if name in self.loaded:
            raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded")
        self.loaded[name] = path

    def unload_lora(self, name: str) -> None:
        if name in self.busy:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is used by 1 unfinished requests")
        del self.loaded[name]


def test_a_replica_loads_an_adapter_once_with_its_first_requests() -> None:
    async def scenario() -> None:
        manager = FakeManager()
        held = ReplicaAdapters(manager, capacity=2)
        await asyncio.gather(*(held.acquire("sql", "/a/sql") for _ in range(5)))  # at once: one load
        assert manager.loaded == {"sql": "/a/sql"} and manager.load_calls == 1 and held.loads == {"sql": 1}
        for _ in range(5):
            held.release("sql")
        await held.acquire("sql", "/a/sql")
        assert manager.load_calls == 1
        held.release("sql")
        with pytest.raises(InvalidRequestError) as bad:  # the request's `model` is at fault
            await held.acquire("broken", "/a/bad")
        assert bad.value.field == "model" and "broken" in bad.value.message and "broken" not in held.names()
        await held.acquire("named", None)  # no folder: the engine resolves the name itself
        held.release("named")
        assert held.room() == 1
        await held.check("/a/other")  # read and let go (POST /v1/load_lora_adapter)
        assert manager.load_calls == 3 and set(manager.loaded) == {"sql"} and held.room() == 1
        with pytest.raises(InvalidRequestError) as unreadable:
            await held.check("/a/bad")
        assert unreadable.value.field == "lora_path"

    asyncio.run(scenario())


def test_idle_adapters_past_max_cpu_loras_are_unloaded_least_recently_used_first() -> None:
    async def scenario() -> None:
        manager = FakeManager()
        held = ReplicaAdapters(manager, capacity=2)
        await held.acquire("a", "/a")  # a stays in use
        for name in ("b", "c"):
            await held.acquire(name, f"/{name}")
            held.release(name)
        assert set(manager.loaded) == {"a", "c"} and held.unloads == 1  # b: idle and least recent
        await held.acquire("b", "/b")
        held.release("b")
        assert set(manager.loaded) == {"a", "b"}  # c went: a is in use
        held.release("a")
        assert held.stats() == {"lora_adapter_loads": {"a": 1, "b": 2, "c": 1}, "lora_adapter_unloads": 2,
                                "lora_adapters_held": 2}

    asyncio.run(scenario())


def test_a_replica_lets_go_of_adapters_the_catalog_dropped_or_moved() -> None:
    async def scenario() -> None:
        manager = FakeManager()
        held = ReplicaAdapters(manager, capacity=8)
        held.adopt("declared", "/d")
        for name in ("x", "y"):
            await held.acquire(name, f"/{name}")
        held.release("x")
        manager.busy.add("y")
        held.retain({"declared": "/d"})  # x unloaded; y has a request running: kept for now
        assert set(manager.loaded) == {"declared", "y"}
        held.release("y")
        manager.busy.discard("y")
        held.retain({"declared": "/d2"})  # declared now comes from another folder
        assert manager.loaded == {}
        await held.acquire("declared", "/d2")
        assert manager.loaded == {"declared": "/d2"}
        # Replaced while a request of this replica uses it: refused with a retry, not mixed up.
        with pytest.raises(APIError) as busy:
            await held.load("declared", "/d3")
        assert busy.value.status == 503 and manager.loaded == {"declared": "/d2"}

    asyncio.run(scenario())


class _Remote:
    def __init__(self, fn: Any, calls: list[str]):
        self._fn, self._calls = fn, calls

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            self._calls.append(self._fn.__name__)
            return self._fn(*args)
        return call()


class FakeBoardHandle:
    def __init__(self, board: StatsBoard):
        self.calls: list[str] = []
        for method in ("adapters", "add_adapter", "remove_adapter"):
            setattr(self, method, _Remote(getattr(board, method), self.calls))


def test_ingress_catalogs_share_adapters_through_the_board() -> None:
    async def scenario() -> None:
        board = StatsBoard(adapters={"sql": "/a/sql"})
        handles = [FakeBoardHandle(board), FakeBoardHandle(board)]
        first, second = (AdapterCatalog({"sql": "/a/sql"}, h, period_s=0.2) for h in handles)
        await first.add("chat", "/a/chat", replace=False)
        assert dict(first) == {"sql": "/a/sql", "chat": "/a/chat"} and "chat" not in second
        await second.knows("chat")  # not known here: read from the board at once
        assert second["chat"] == "/a/chat"
        calls = len(handles[1].calls)
        for _ in range(20):  # an unknown name asks the board at most once a period
            await second.knows("nope")
        assert len(handles[1].calls) == calls
        with pytest.raises(APIError) as taken:
            await second.add("chat", "/elsewhere", replace=False)
        assert taken.value.status == 400 and "already been loaded" in taken.value.message
        await second.add("chat", "/a/chat2", replace=True)
        await second.remove("sql")
        with pytest.raises(APIError) as gone:
            await first.remove("sql")
        assert gone.value.status == 404 and gone.value.param == "lora_name"
        assert board.report("w", {}) == {"stopping": False, "adapters": {"chat": "/a/chat2"}}
        await first.knows("sql")  # known here: no board call on the request path
        assert "sql" in first
        first.start()  # its periodic read: the board's catalog replaces the old view
        await asyncio.sleep(0.05)
        assert dict(first) == {"chat": "/a/chat2"}

    asyncio.run(scenario())


def test_runtime_updates_need_enable_lora_and_max_cpu_loras_defaults() -> None:
    with pytest.raises(ValueError, match="lora_runtime_updates needs engine.enable_lora"):
        ClusterArgs(lora_runtime_updates=True)
    args = ClusterArgs(engine={"enable_lora": True, "max_loras": 3}, lora_modules={f"a{i}": "/a" for i in range(5)})
    assert args.host_loras == 5
    assert ClusterArgs(engine={"enable_lora": True, "max_loras": 3}).host_loras == 3
    assert ClusterArgs(engine={"enable_lora": True}, max_cpu_loras=16).host_loras == 16
    with pytest.raises(ValueError, match="max_cpu_loras"):
        ClusterArgs(max_cpu_loras=0)
