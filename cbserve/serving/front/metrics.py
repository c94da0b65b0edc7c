"""Prometheus metrics of the ingress, with vLLM's names where vLLM has the metric.

Latency histograms and token counters are measured in the ingress, per choice. Engine state
(requests running and waiting, KV usage, prefix-cache hits, preemptions) comes from the workers'
latest stats on the `StatsBoard`, one series per worker replica (label `replica`).

With several ingress replicas a scrape reaches one of them; each pushes its own counters and
histograms (`export()`) to the board, and `render` shows every ingress replica's series under
the label `ingress`, so what a scrape returns does not depend on which replica answered it
(`sum without (ingress, replica)` gives the app's totals).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class WorkerStatsCollector:
    """Turns the stats board's snapshot into gauges and counters at scrape time."""

    def __init__(self, model_name: str):
        self._model_name = model_name
        self.snapshot: dict[str, dict[str, Any]] = {}

    def describe(self) -> list[Metric]:
        return []  # the series are only known at scrape time

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica"]

        def gauge(name: str, doc: str, key: Any) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for replica, s in self.snapshot.items():
                g.add_metric([self._model_name, replica], float(key(s)))
            return g

        def counter(name: str, doc: str, key: Any) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            for replica, s in self.snapshot.items():
                c.add_metric([self._model_name, replica], float(key(s)))
            return c

        yield gauge("vllm:num_requests_running", "Requests in the engine's batch.", lambda s: s.get("running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests queued in the engine.", lambda s: s.get("waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV pages in use (1 = full).", kv_usage)
        yield gauge("cbserve:kv_pages_total", "KV pages of the replica.", lambda s: s.get("total_pages", 0))
        yield gauge("cbserve:kv_pages_free", "Free KV pages of the replica.", lambda s: s.get("free_pages", 0))
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            lambda s: s.get("prefix_hit_tokens", 0) + s.get("prompt_tokens_computed", 0),
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      lambda s: s.get("prefix_hit_tokens", 0))
        yield counter("vllm:num_preemptions", "Requests preempted by the engine (pages needed elsewhere).",
                      lambda s: s.get("preemptions", 0))
        yield counter("vllm:spec_decode_num_drafts", "Speculative decoding: requests' steps with proposed tokens.",
                      lambda s: s.get("spec_decode_num_drafts", 0))
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.",
                      lambda s: s.get("spec_decode_num_draft_tokens", 0))
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
                      lambda s: s.get("spec_decode_num_accepted_tokens", 0))
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: proposed tokens accepted, by position in the proposal.",
                                      labels=[*labels, "position"])
        for replica, s in self.snapshot.items():
            for position, accepted in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos") or ()):
                per_pos.add_metric([self._model_name, replica, str(position)], float(accepted))
        yield per_pos
        yield counter("cbserve:engine_steps", "Forward steps the engine ran.", lambda s: s.get("steps", 0))
        yield counter("cbserve:engine_busy_seconds", "Wall time the engine spent in its steps (busy share = "
                      "its rate).", lambda s: s.get("busy_seconds", 0.0))
        yield from self._lora_series(gauge, counter, labels)
        replicas = GaugeMetricFamily("cbserve:worker_replicas", "Worker replicas reporting stats.",
                                     labels=["model_name"])
        replicas.add_metric([self._model_name], float(len(self.snapshot)))
        yield replicas


    def _lora_series(self, gauge: Any, counter: Any, labels: list[str]) -> Iterator[Metric]:
        yield gauge("cbserve:lora_adapters_held", "LoRA adapters the replica holds in host memory.",
                    lambda s: s.get("lora_adapters_held", 0))
        yield counter("cbserve:lora_adapter_unloads", "LoRA adapters the replica unloaded (past max_cpu_loras, "
                      "or no longer in the catalog).", lambda s: s.get("lora_adapter_unloads", 0))
        yield counter("cbserve:lora_slot_loads", "LoRA adapters copied into the engine's resident slots.",
                      lambda s: s.get("lora_slot_loads", 0))
        yield counter("cbserve:lora_slot_evictions", "Resident LoRA slots taken from an adapter (max_loras).",
                      lambda s: s.get("lora_evictions", 0))
        loads = CounterMetricFamily("cbserve:lora_adapter_loads", "LoRA adapters the replica read from their "
                                    "folder, by adapter.", labels=[*labels, "lora_name"])
        for replica, s in self.snapshot.items():
            for name, count in sorted((s.get("lora_adapter_loads") or {}).items()):
                loads.add_metric([self._model_name, replica, name], float(count))
        yield loads


def kv_usage(stats: dict[str, Any]) -> float:
    total = stats.get("total_pages", 0) or 0
    return 0.0 if total <= 0 else 1.0 - stats.get("free_pages", 0) / total


class ChoiceTimer:
    """Latency and tokens of one choice, timed from the request's arrival in the ingress.

    Tokens are counted as they stream, so a choice whose client went away still counts what it
    prefilled and generated; latency and success are recorded only for finished choices.
    """

    def __init__(self, metrics: ServingMetrics, arrival: float, prompt_tokens: int, lora: str | None = None):
        self._m = metrics
        self._arrival = arrival
        self._last: float | None = None
        self._unspaced = 0  # tokens of the first delta beyond the first, no gap observed yet
        self._lora = lora
        metrics.prompt_tokens.labels(metrics.model_name).inc(prompt_tokens)
        if lora is not None:
            metrics.lora_requests.labels(metrics.model_name, lora).inc()

    def on_tokens(self, n: int) -> None:
        """`n` new tokens arrived in one delta (several when the worker batches a stream's
        output): one inter-token gap per token, the delta's wait shared evenly among them; the
        first delta's extra tokens share the next delta's wait."""
        if n <= 0:
            return
        m, name = self._m, self._m.model_name
        now = time.perf_counter()
        if self._last is None:
            m.ttft.labels(name).observe(now - self._arrival)
            self._unspaced = n - 1
        else:
            gaps = n + self._unspaced
            for _ in range(gaps):
                m.itl.labels(name).observe((now - self._last) / gaps)
            self._unspaced = 0
        self._last = now
        m.generation_tokens.labels(name).inc(n)
        if self._lora is not None:
            m.lora_generation_tokens.labels(name, self._lora).inc(n)

    def on_end(self, finish_reason: str) -> None:
        m, name = self._m, self._m.model_name
        for _ in range(self._unspaced):  # every token came in the first delta: no time between them
            m.itl.labels(name).observe(0.0)
        m.e2e.labels(name).observe(time.perf_counter() - self._arrival)
        m.request_success.labels(name, finish_reason).inc()


class ServingMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency of a choice.", lab,
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", lab, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished choices by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.http_errors = Counter("cbserve:http_errors", "Requests refused, by HTTP status.",
                                   ["model_name", "status"], registry=r)
        self.migrations = Counter("cbserve:migrations", "Choices continued on another worker replica (stream "
                                  "migration), by why their replica lost them.", ["model_name", "reason"], registry=r)
        self.migration_stall = Histogram("cbserve:migration_stall_seconds", "Time from a choice's loss to its "
                                         "continuation's acceptance by another replica.", lab,
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.lora_requests = Counter("cbserve:lora_requests", "Choices run with a LoRA adapter, by adapter.",
                                     ["model_name", "lora_name"], registry=r)
        self.lora_generation_tokens = Counter("cbserve:lora_generation_tokens", "Tokens generated with a LoRA "
                                              "adapter, by adapter.", ["model_name", "lora_name"], registry=r)
        self.workers = WorkerStatsCollector(model_name)

    def on_migration(self, reason: str, stall_s: float) -> None:
        self.migrations.labels(self.model_name, reason).inc()
        self.migration_stall.labels(self.model_name).observe(stall_s)

    def timer(self, arrival: float, prompt_tokens: int, lora: str | None = None) -> ChoiceTimer:
        return ChoiceTimer(self, arrival, prompt_tokens, lora)

    def export(self) -> list[Any]:
        """This ingress replica's counters and histograms as plain data, for the stats board."""
        return [
            [m.name, m.documentation, m.type, m.unit, [[x.name, dict(x.labels), x.value] for x in m.samples]]
            for m in self.registry.collect()
        ]

    def render(self, worker_snapshot: dict[str, dict[str, Any]] | None,
               ingress_snapshot: dict[str, list[Any]] | None = None) -> bytes:
        """The exposition text: the workers' engine series and, given every ingress replica's
        `export()`, theirs labelled `ingress`; else this process's own."""
        self.workers.snapshot = worker_snapshot or {}
        out = CollectorRegistry(auto_describe=False)
        out.register(IngressSeries(self.registry, ingress_snapshot, self.model_name))
        out.register(self.workers)
        return generate_latest(out)


class IngressSeries:
    """The ingress replicas' families, merged by name (one HELP and TYPE each)."""

    def __init__(self, own: CollectorRegistry, snapshot: dict[str, list[Any]] | None, model_name: str):
        self._own, self._snapshot, self._model_name = own, snapshot, model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self._snapshot is None:
            yield from self._own.collect()
            return
        families: dict[str, Metric] = {}
        for ingress, exported in sorted(self._snapshot.items()):
            for name, doc, typ, unit, samples in exported:
                family = families.setdefault(name, Metric(name, doc, typ, unit))
                for sample_name, labels, value in samples:
                    family.add_sample(sample_name, {**labels, "ingress": ingress}, value)
        yield from families.values()
        count = GaugeMetricFamily("cbserve:ingress_replicas", "Ingress replicas reporting metrics.",
                                  labels=["model_name"])
        count.add_metric([self._model_name], float(len(self._snapshot)))
        yield count
