"""/metrics with several ingress replicas, without Ray: each replica's counters reach the stats
board, and a scrape renders every replica's series whichever replica answers it."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cbserve.cluster.metrics_relay import MetricsRelay
from cbserve.cluster.stats_board import StatsBoard
from cbserve.serving.front.metrics import ServingMetrics

WORKERS = {"w1": {"running": 2, "waiting": 1, "total_pages": 10, "free_pages": 4, "prefix_hit_tokens": 30,
                  "prompt_tokens_computed": 70, "preemptions": 3, "spec_decode_num_drafts": 4,
                  "spec_decode_num_draft_tokens": 16, "spec_decode_num_accepted_tokens": 9,
                  "spec_decode_num_accepted_tokens_per_pos": [4, 3, 2, 0]}}


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


class _Remote:
    def __init__(self, fn: Any):
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self._fn(*args)
        return call()


class FakeBoardHandle:
    """A deployment handle on one `StatsBoard` (method.remote(...) is awaitable)."""

    def __init__(self, board: StatsBoard):
        self.report_ingress = _Remote(board.report_ingress)
        self.snapshot_all = _Remote(board.snapshot_all)


def _serve_some(metrics: ServingMetrics, prompt_tokens: int, generated: int) -> None:
    timer = metrics.timer(0.0, prompt_tokens)
    timer.on_tokens(generated)
    timer.on_end("length")


def test_a_scrape_shows_every_ingress_replica_whichever_answers() -> None:
    board = StatsBoard()
    board.report("w1", WORKERS["w1"])
    ingress = {name: ServingMetrics("m") for name in ("i1", "i2")}
    relays = {name: MetricsRelay(m, FakeBoardHandle(board), name, period_s=1.0) for name, m in ingress.items()}
    _serve_some(ingress["i1"], 5, 3)
    _serve_some(ingress["i2"], 7, 4)
    _serve_some(ingress["i2"], 1, 1)

    async def scrapes() -> list[bytes]:
        await relays["i1"].push()
        await relays["i2"].push()
        return [await relays["i1"].render(), await relays["i2"].render()]

    first, second = (_samples(t) for t in asyncio.run(scrapes()))
    assert {k: v for k, v in first.items() if not k[0].endswith("_created")} == {
        k: v for k, v in second.items() if not k[0].endswith("_created")}
    for scrape in (first, second):
        tokens = {dict(k[1])["ingress"]: v for k, v in scrape.items() if k[0] == "vllm:prompt_tokens_total"}
        assert tokens == {"i1": 5.0, "i2": 8.0}
        assert scrape[("cbserve:ingress_replicas", (("model_name", "m"),))] == 2
        assert scrape[("vllm:num_preemptions_total", (("model_name", "m"), ("replica", "w1")))] == 3
        assert scrape[("vllm:prefix_cache_hits_total", (("model_name", "m"), ("replica", "w1")))] == 30
        w1 = (("model_name", "m"), ("replica", "w1"))
        assert scrape[("vllm:spec_decode_num_draft_tokens_total", w1)] == 16
        assert scrape[("vllm:spec_decode_num_accepted_tokens_total", w1)] == 9
        assert [scrape[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*w1[:1], ("position", str(p)), w1[1]))]
                for p in range(4)] == [4, 3, 2, 0]
        success = sum(v for k, v in scrape.items() if k[0] == "vllm:request_success_total")
        assert success == 3


def test_board_forgets_an_ingress_replica_that_stopped_reporting() -> None:
    board = StatsBoard(max_age_s=0.0)
    board.report_ingress("gone", ServingMetrics("m").export())
    assert board.snapshot_all() == {"workers": {}, "ingress": {}}


def test_without_a_board_a_replica_serves_its_own_metrics() -> None:
    metrics = ServingMetrics("m")
    _serve_some(metrics, 4, 2)
    relay = MetricsRelay(metrics, None, "i1", period_s=1.0)
    relay.start()  # nothing to push to
    text = _samples(asyncio.run(relay.render()))
    assert text[("vllm:prompt_tokens_total", (("model_name", "m"),))] == 4
