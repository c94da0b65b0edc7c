"""/metrics that do not depend on which ingress replica a scrape reaches.

Each ingress replica pushes its counters and histograms (`ServingMetrics.export`) to the stats
board every `routing.stats_period_s`, and once more right before it answers a scrape; the scrape
then renders every ingress replica's series (label `ingress`) and every worker replica's engine
series (label `replica`) from the board. A replica gone for `StatsBoard.max_age_s` drops out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cbserve.serving.front.metrics import ServingMetrics

logger = logging.getLogger(__name__)

BOARD_TIMEOUT_S = 5.0


def this_replica() -> str:
    """The Serve replica this runs in ("local" outside Serve)."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - constructed outside Serve (tests)
        return "local"


class MetricsRelay:
    def __init__(self, metrics: ServingMetrics, board: Any, ingress: str, period_s: float):
        self._metrics, self._board, self._ingress, self._period_s = metrics, board, ingress, period_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Push periodically from the running event loop (the replica's)."""
        if self._board is None or self._task is not None:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._push_forever())
        except RuntimeError:  # no loop (built outside Serve): pushed at each scrape only
            logger.debug("metrics relay of %s: no running loop", self._ingress)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _push_forever(self) -> None:
        while True:
            try:
                await self.push()
            except Exception as exc:  # noqa: BLE001 - the board may be restarting; try next period
                logger.debug("could not push ingress metrics: %r", exc)
            await asyncio.sleep(self._period_s)

    async def push(self) -> None:
        await asyncio.wait_for(self._board.report_ingress.remote(self._ingress, self._metrics.export()),
                               timeout=BOARD_TIMEOUT_S)

    async def render(self) -> bytes:
        """The exposition text of the whole app (this replica's own metrics if the board fails)."""
        if self._board is None:
            return self._metrics.render(None)
        try:
            await self.push()
            snap = await asyncio.wait_for(self._board.snapshot_all.remote(), timeout=BOARD_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - serve what this replica knows
            logger.warning("could not read the stats board for /metrics: %r", exc)
            return self._metrics.render(None)
        ingress = dict(snap["ingress"])
        ingress[self._ingress] = self._metrics.export()  # fresher than what the board holds
        return self._metrics.render(snap["workers"], ingress)
