"""`bench/load.py`: SSE parsing, percentiles, the client's accounting against a fake SSE server (every
started request ends as completed or as one named error), the CLI, and one short real run against
the cbserve Serve app on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_load", ROOT / "bench" / "load.py")
load = importlib.util.module_from_spec(_spec)
sys.modules["bench_load"] = load  # dataclasses look their module up by name
_spec.loader.exec_module(load)


# -- SSE parser and percentiles ----------------------------------------------------------------

STREAM = (
    b": a comment\r\n"
    b"data: {\"a\": 1}\r\n\r\n"
    b"event: message\n"
    b"data: line one\n"
    b"data: line two\n\n"
    b"id: 7\n"
    b"data:no-space \xc3\xa9\xe6\x97\xa5\n\n"
    b"data: [DONE]\n\n"
)
EVENTS = ['{"a": 1}', "line one\nline two", "no-space é日", "[DONE]"]


def test_sse_parser_whole_and_split_anywhere() -> None:
    assert load.SSEParser().feed(STREAM) == EVENTS
    for cut in range(len(STREAM) + 1):  # two chunks, split at every byte (inside é, inside \r\n)
        parser = load.SSEParser()
        assert parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) + parser.close() == EVENTS, cut
    parser = load.SSEParser()
    assert [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i : i + 1])] == EVENTS


def test_sse_parser_close_flushes_an_unterminated_event() -> None:
    parser = load.SSEParser()
    assert parser.feed(b"data: x\n\ndata: last") == ["x"]
    assert parser.close() == ["last"]
    assert parser.close() == []


def test_percentile() -> None:
    assert load.percentile([], 50) is None
    assert load.percentile([3.0], 99) == 3.0
    values = list(range(1, 101))
    random.Random(0).shuffle(values)
    assert load.percentile(values, 50) == 50.5
    assert load.percentile(values, 0) == 1 and load.percentile(values, 100) == 100
    assert load.percentile(values, 90) == pytest.approx(90.1)
    assert load.percentile(values, 50) <= load.percentile(values, 90) <= load.percentile(values, 99)


def test_workload_is_deterministic_and_in_range() -> None:
    w = load.Workload(seed=3, min_words=5, max_words=9, min_tokens=16, max_tokens=20)
    assert w.spec(12) == w.spec(12)
    assert w.spec(12) != w.spec(13)
    for i in range(50):
        s = w.spec(i)
        assert 16 <= s.max_tokens <= 20
        assert 5 <= len(s.prompt.split(":", 1)[1].split()) <= 9


# -- a fake OpenAI streaming server ------------------------------------------------------------

CHUNKS = 6  # content chunks a normal fake answer streams (fewer when max_tokens is smaller)


def fake_kind(n: int) -> str:
    """What the fake server does with the n-th request it receives (mode `mixed`)."""
    if n % 5 == 1:
        return "http_429"
    if n % 7 == 3:
        return "truncated"
    if n % 11 == 5:
        return "disconnected"
    if n % 13 == 7:
        return "stream_error"
    return "ok"


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeServer:
    """OpenAI-shaped SSE answers at /<mode>/v1/chat/completions, in a thread with its own loop.

    Modes: `ok` (every request answers), `mixed` (see `fake_kind`), `hang` (one chunk, then
    nothing), `slow` (ok, after 0.2 s), `nodone` (like transformers serve: finish_reason and
    usage, no `data: [DONE]`).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.closing = False
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/{mode}/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    def close(self) -> None:
        self.closing = True
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        body = await request.json()
        n = self.counts[mode]
        self.counts[mode] += 1
        kind = fake_kind(n) if mode == "mixed" else "ok"
        if kind == "http_429":
            return web.json_response({"error": {"message": "busy", "type": "overloaded", "param": None,
                                                 "code": 429}}, status=429)
        if mode == "slow":
            await asyncio.sleep(0.2)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        tokens = min(CHUNKS, body["max_tokens"])
        for i in range(tokens):
            await resp.write(_event({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}))
            await asyncio.sleep(0.003)
            while mode == "hang" and not self.closing:  # until the client goes or the server closes
                await asyncio.sleep(0.02)
            if i == 1 and kind == "truncated":
                await resp.write_eof()
                return resp
            if i == 1 and kind == "disconnected":
                request.transport.close()
                return resp
            if i == 1 and kind == "stream_error":
                await resp.write(_event({"error": {"message": "engine failed", "type": "server_error"}}))
                await resp.write_eof()
                return resp
        await resp.write(_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
        await resp.write(_event({"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 3}}))
        if mode != "nodone":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


WORK = load.Workload(seed=1, min_words=2, max_words=6, min_tokens=2, max_tokens=10)


def _level(target: Any, concurrency: int, requests: int, duration: float, **kw: Any) -> dict[str, Any]:
    run = asyncio.run(load.run_level(target, WORK, load.Sampling(), concurrency, requests, duration, **kw))
    s = load.summarize(run)
    assert s["started"] == run.started == len(run.results)
    assert s["completed"] + s["errors"] == s["started"]  # every started request accounted for, once
    assert len({r.index for r in run.results}) == len(run.results)
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        d = s[key]
        if d["n"]:
            assert 0 <= d["p50"] <= d["p90"] <= d["p99"], (key, d)
    return s


def test_mixed_outcomes_are_all_counted_by_kind(fake: FakeServer) -> None:
    target = load.Target("fake", fake.url("mixed"), "fake")
    s = _level(target, concurrency=4, requests=40, duration=60)
    expected = Counter(fake_kind(n) for n in range(40))
    assert s["started"] == 40
    assert s["completed"] == expected.pop("ok")
    assert s["errors_by_kind"] == dict(expected)
    assert s["output_tokens"] > 0 and s["token_count_source"] == {"usage": s["completed"]}
    assert s["completed_without_done_marker"] == 0
    assert s["requests_per_s"] > 0 and s["output_tokens_per_s"] > 0


def test_a_stream_without_done_marker_but_with_finish_reason_completes(fake: FakeServer) -> None:
    s = _level(load.Target("fake", fake.url("nodone"), "fake"), concurrency=2, requests=4, duration=30)
    assert s["completed"] == 4 and s["completed_without_done_marker"] == 4


def test_duration_cap_stops_a_level(fake: FakeServer) -> None:
    t0 = time.perf_counter()
    s = _level(load.Target("fake", fake.url("slow"), "fake"), concurrency=3, requests=10**6, duration=1.0)
    assert time.perf_counter() - t0 < 10
    assert 3 <= s["started"] < 100 and s["errors"] == 0


def test_drain_timeout_cancels_and_counts_hung_requests(fake: FakeServer) -> None:
    t0 = time.perf_counter()
    s = _level(load.Target("fake", fake.url("hang"), "fake"), concurrency=2, requests=5, duration=0.2,
               drain_timeout=0.5)
    assert time.perf_counter() - t0 < 10
    assert s["started"] == 2 and s["errors_by_kind"] == {"unfinished_at_drain": 2}
    # What the cancelled streams had received still counts: one chunk each, and its first-token time.
    assert s["partial_tokens_of_failed"] == 2 and s["ttft_s"]["n"] == 2
    assert s["output_tokens"] == 0 and s["all_tokens_per_s"] > 0


def test_request_timeout_and_connect_errors(fake: FakeServer) -> None:
    s = _level(load.Target("fake", fake.url("hang"), "fake"), concurrency=2, requests=2, duration=5,
               request_timeout=0.5)
    assert s["errors_by_kind"] == {"timeout": 2}
    s = _level(load.Target("nobody", f"http://127.0.0.1:{load.free_port()}", "x"), concurrency=2, requests=3,
               duration=5)
    assert s["errors_by_kind"] == {"connect": 3}


def test_cli_against_a_running_server(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "load.json"
    rc = load.main(["--url", fake.url("ok") + "/v1", "--model-name", "fake", "--concurrency", "1,3",
                    "--requests", "6", "--duration", "20", "--warmup", "1", "--prompt-words", "2-4",
                    "--max-tokens", "2-8", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    levels = report["levels"]["url"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    assert all(lv["started"] == lv["completed"] == 6 for lv in levels)
    printed = capsys.readouterr().out
    assert "TTFT p50/p90/p99 ms" in printed and "url" in printed
    # The ratio table, as the cbserve-vs-transformers run prints it.
    rows = load.ratios({"cbserve": levels, "transformers": levels})
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert all(r["output_tokens_per_s"] == pytest.approx(1.0) for r in rows)
    assert "cbserve/transformers" in load.format_ratios(rows)


# -- one short real run ------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_short_real_run_against_cbserve(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.support.cluster import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path_factory)
    engine = {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 256}
    with contextlib.ExitStack() as stack:
        target = load.start_cbserve(stack, str(model_dir), cpus=2, engine=engine)
        assert target.model == model_dir.name and target.info["omp_num_threads"] == "2"
        work = load.Workload(seed=0, min_words=2, max_words=12, min_tokens=4, max_tokens=12)
        run = asyncio.run(load.run_level(target, work, load.Sampling(), concurrency=4, max_requests=8,
                                         duration=60, request_timeout=60, drain_timeout=60))
    s = load.summarize(run)
    assert s["started"] == 8 and s["completed"] == 8 and s["errors"] == 0, s["error_samples"]
    assert s["output_tokens"] > 0 and s["token_count_source"] == {"usage": 8}
    assert all(r.output_tokens <= work.spec(r.index).max_tokens for r in run.results)
    assert s["completed_without_done_marker"] == 0
    for key in ("ttft_s", "itl_s", "e2e_s"):
        d = s[key]
        assert d["n"] > 0 and 0 <= d["p50"] <= d["p90"] <= d["p99"], (key, d)
