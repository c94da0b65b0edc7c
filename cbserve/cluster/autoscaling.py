"""Autoscaling of the worker deployment on the engine's own signals, through Serve's custom
autoscaling metrics.

Each worker replica reports, besides Serve's count of ongoing requests, its engine's waiting
requests, running requests and KV usage (`EngineReplica.record_autoscaling_stats`); Serve's
controller averages them per replica over `look_back_period_s` and calls this policy, set as the
deployment's `autoscaling_config.policy` by `app.worker_options`. The replicas wanted are the most
that any one signal asks for:

- ongoing requests: Serve's own rule, `total ongoing / target_ongoing_requests`;
- KV usage: `replicas x mean usage / target_kv_usage` (pages are what a replica runs out of
  first with long prompts, well before its request count says so);
- waiting requests: while the engines queue more than `target_waiting_requests` each on average,
  enough replicas to run what waits at the rate they run now,
  `replicas x (running + waiting) / running`.

Serve then applies `min_replicas`/`max_replicas`, the up/down delays and scaling factors as for
its default policy. Without engine reports (replicas starting) only the first rule applies.
"""

from __future__ import annotations

import math
from typing import Any

# Metric names reported by the replicas (prefixed: Serve keeps its own keys in the same dict).
WAITING = "cbserve_waiting_requests"
RUNNING = "cbserve_running_requests"
KV_USAGE = "cbserve_kv_usage"


def desired_replicas(current: int, total_ongoing: float, target_ongoing: float, engine: dict[str, list[float]],
                     target_kv_usage: float | None, target_waiting: float | None) -> float:
    """Replicas wanted by the most demanding signal. `engine` holds each metric's per-replica
    averages (missing or empty: that signal is not used)."""
    if current == 0:
        return math.ceil(total_ongoing / target_ongoing) if total_ongoing > 0 else 0
    wanted = [total_ongoing / target_ongoing]
    kv = engine.get(KV_USAGE) or []
    if target_kv_usage and kv:
        wanted.append(current * (sum(kv) / len(kv)) / target_kv_usage)
    waiting, running = engine.get(WAITING) or [], engine.get(RUNNING) or []
    if target_waiting is not None and waiting and sum(waiting) / len(waiting) > target_waiting:
        mean_running = sum(running) / len(running) if running else 0.0
        mean_waiting = sum(waiting) / len(waiting)
        wanted.append(current * (mean_running + mean_waiting) / max(mean_running, 1.0))
    return max(wanted)


class EngineAutoscalingPolicy:
    """Serve's `AutoscalingPolicy.policy_function` (a class: Serve builds it once with
    `policy_kwargs` and calls it every control-loop tick with an `AutoscalingContext`)."""

    def __init__(self, target_kv_usage: float | None = 0.8, target_waiting_requests: float | None = 2.0):
        self.target_kv_usage = target_kv_usage
        self.target_waiting = target_waiting_requests

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        engine = {name: [float(v) for v in metrics.get(name, {}).values()] for name in (WAITING, RUNNING, KV_USAGE)}
        wanted = desired_replicas(
            ctx.current_num_replicas, float(ctx.total_num_requests), float(ctx.config.get_target_ongoing_requests()),
            engine, self.target_kv_usage, self.target_waiting,
        )
        return wanted, {}  # no state of its own; Serve keeps its delay counters beside it
