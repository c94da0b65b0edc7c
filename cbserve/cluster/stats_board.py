"""A one-replica deployment holding the latest engine stats of every worker replica.

Workers push their `manager.stats()` to it from `record_routing_stats` (which Serve's controller
calls on every replica every `request_routing_stats_period_s`); the ingress reads it when
`/metrics` is scraped. Serve routes a handle call to *some* replica, so this is how the
ingress sees all of them.

It also carries what every replica must learn without being called one by one: `stop_streams()`
(called by `cluster/run.py` on Ctrl-C) makes every later `report` answer `stopping`, and each
replica then ends its streams at once; and the LoRA adapters clients may name (`lora_modules`, and
those loaded or unloaded at run time through an ingress replica, `cluster/adapters.py`), which
every `report` answers too.
"""

from __future__ import annotations

import time
from typing import Any


class StatsBoard:
    def __init__(self, max_age_s: float = 30.0, adapters: dict[str, str] | None = None):
        self._max_age_s = max_age_s
        self._adapters = dict(adapters or {})  # LoRA adapter name -> PEFT folder
        self._stats: dict[str, tuple[float, dict[str, Any]]] = {}
        self._ingress: dict[str, tuple[float, list[Any]]] = {}
        self._stopping = False

    def report(self, replica: str, stats: dict[str, Any]) -> dict[str, Any]:
        """Store a replica's stats; answers whether the server is stopping (`stop_streams`) and the
        adapters clients may name."""
        self._stats[replica] = (time.monotonic(), dict(stats))
        return {"stopping": self._stopping, "adapters": dict(self._adapters)}

    # -- LoRA adapters (one catalog for every ingress and worker replica) --------------------------

    def adapters(self) -> dict[str, str]:
        return dict(self._adapters)

    def add_adapter(self, name: str, path: str, replace: bool = False) -> str | None:
        """Register an adapter; the reason when refused (the name is taken and `replace` is off)."""
        if name in self._adapters and not replace:
            return f"The lora adapter '{name}' has already been loaded."
        self._adapters[name] = path
        return None

    def remove_adapter(self, name: str) -> bool:
        """Unregister an adapter; False when none has that name."""
        return self._adapters.pop(name, None) is not None

    def stop_streams(self) -> None:
        self._stopping = True

    def forget(self, replica: str) -> None:
        self._stats.pop(replica, None)

    def report_ingress(self, ingress: str, families: list[Any]) -> None:
        """An ingress replica's own counters and histograms (`ServingMetrics.export`), pushed every
        stats period and before it answers a scrape: /metrics then shows every ingress replica's
        series, whichever one the scrape reached."""
        self._ingress[ingress] = (time.monotonic(), families)

    def snapshot_all(self) -> dict[str, Any]:
        """{"workers": `snapshot()`, "ingress": {ingress replica: its families}}."""
        now = time.monotonic()
        for ingress in [r for r, (t, _) in self._ingress.items() if now - t > self._max_age_s]:
            del self._ingress[ingress]
        return {"workers": self.snapshot(), "ingress": {r: f for r, (_, f) in self._ingress.items()}}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._stats.items() if now - t > self._max_age_s]:
            del self._stats[replica]  # a replica that stopped reporting is gone
        return {replica: {**stats, "age_s": now - t} for replica, (t, stats) in self._stats.items()}
