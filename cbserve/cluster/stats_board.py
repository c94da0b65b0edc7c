"""A one-replica deployment holding the latest engine stats of every worker replica.

Workers push their `manager.stats()` to it from `record_routing_stats` (which Serve's controller
calls on every replica every `request_routing_stats_period_s`); the ingress reads it when
`/metrics` is scraped. Serve routes a handle call to *some* replica, so this is how the
ingress sees all of them.

It also carries the one broadcast the app needs: `stop_streams()` (called by `cluster/run.py` on
Ctrl-C) makes every later `report` answer True, and each replica then ends its streams at once.
"""

from __future__ import annotations

import time
from typing import Any


class StatsBoard:
    def __init__(self, max_age_s: float = 30.0):
        self._max_age_s = max_age_s
        self._stats: dict[str, tuple[float, dict[str, Any]]] = {}
        self._ingress: dict[str, tuple[float, list[Any]]] = {}
        self._stopping = False

    def report(self, replica: str, stats: dict[str, Any]) -> bool:
        """Store a replica's stats; True when the server is stopping (`stop_streams`)."""
        self._stats[replica] = (time.monotonic(), dict(stats))
        return self._stopping

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
