"""Overload: a worker deployment with `max_ongoing_requests` 2 and `max_queued_requests` 2 (per
ingress replica). Requests beyond 2 running + 2 queued are refused at once with OpenAI's error
shape (HTTP 503 + Retry-After, gRPC RESOURCE_EXHAUSTED) instead of piling up; accepted ones
complete with the right tokens; the engine never holds more than max_ongoing_requests; no page
leaks. One local Ray and one Serve app for the module.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import serve_app, tiny_model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
MAX_ONGOING, MAX_QUEUED, RETRY_AFTER = 2, 2, 2.0
HOLD_PROMPT = "hello world"  # greedy on the tiny model runs to max_tokens (no early EOS)
HOLD_TOKENS = 450
HOLD_LOGPROBS = 5  # per-token work for the ingress, so a held stream lasts a while on a fast CPU too
# The held streams must outlast the queue check and the burst (a few hundred ms): slower machines
# hold for seconds; one that streams HOLD_TOKENS faster than this cannot show the slots busy.
MIN_HOLD_S = 1.0


def _args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "served_model_name": MODEL,
        "engine": {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 256},
        "generation": {"max_tokens": 16},
        "limits": {"max_tokens": 480},
        "routing": {"stats_period_s": 0.2},
        "worker": {"max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED,
                   "retry_after_s": RETRY_AFTER},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with serve_app(_args(tiny_model_dir(tmp_path_factory))) as (serve, http_port, grpc_port):
        yield {"http": http_port, "grpc": grpc_port, "serve": serve}


def _post(cluster: dict[str, Any], body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, str], bytes, float]:
    """POST /v1/completions; returns status, headers, body and the seconds it took."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw, time.perf_counter() - t0
    finally:
        conn.close()


def _completion(prompt: str, max_tokens: int, stream: bool = False, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **fields}


def _hold(stream: bool = False) -> dict[str, Any]:
    return _completion(HOLD_PROMPT, HOLD_TOKENS, stream, logprobs=HOLD_LOGPROBS)


def _text(raw: bytes, stream: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of a completion response or SSE stream."""
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, finish = "", None
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
    assert raw.rstrip().endswith(b"data: [DONE]")
    return text, finish


def _assert_overload_refusal(status: int, headers: dict[str, str], raw: bytes) -> None:
    assert status == 503, raw
    assert headers.get("retry-after") == str(int(RETRY_AFTER))
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "overloaded" and "overloaded" in err["message"]


def _worker_stats(cluster: dict[str, Any]) -> dict[str, Any]:
    return cluster["serve"].get_deployment_handle("LLMWorker", app_name="cbserve").stats.remote().result(timeout_s=60)


def _wait_idle(cluster: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    stats = _worker_stats(cluster)
    while time.monotonic() < deadline and (stats["live_requests"] or stats["free_pages"] != stats["total_pages"]):
        time.sleep(0.2)
        stats = _worker_stats(cluster)
    return stats


class _HeldStream:
    """A long streaming completion that occupies one of the replica's max_ongoing slots."""

    def __init__(self, cluster: dict[str, Any]):
        self.conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=120)
        self.conn.request("POST", "/v1/completions", body=json.dumps(_hold(stream=True)).encode(),
                          headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.received = b""
        while b"data: {" not in self.received:  # tokens flow: the engine runs it
            self.received += self.resp.read1(4096)

    def finish(self) -> tuple[tuple[str, str | None], float]:
        """Read to the end; returns the text, the finish reason, and when the stream ended."""
        self.received += self.resp.read()
        ended = time.perf_counter()
        self.conn.close()
        return _text(self.received, stream=True), ended


def test_excess_requests_are_refused_fast_and_accepted_ones_complete(cluster: dict[str, Any]) -> None:
    import grpc

    from cbserve.serving.protos import generate_pb2, generate_pb2_grpc

    expected = {p: _text(_post(cluster, _completion(p, 8))[2], False) for p in ("the sea", "one two")}
    _, _, raw, hold_s = _post(cluster, _hold())
    held_expected = _text(raw, False)
    assert held_expected[1] == "length", "the hold prompt must not stop early for this test to hold its slot"
    if hold_s < MIN_HOLD_S:
        pytest.skip(f"{HOLD_TOKENS} tokens took {hold_s:.2f} s here: too fast to keep both slots busy through "
                    f"the queue check and the burst (needs {MIN_HOLD_S} s)")

    # The requests above have left the worker (Serve counts a slot free when they have).
    _wait_idle(cluster)
    # Two long streams take the replica's two slots ...
    held = [_HeldStream(cluster) for _ in range(MAX_ONGOING)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        # ... two more wait in the ingress's queue for the worker ...
        queued = [pool.submit(_post, cluster, _completion(p, 8)) for p in expected]
        time.sleep(0.3)  # an 8-token answer takes ~50 ms: one that did not wait would be back
        answered = [f.result()[:3] for f in queued if f.done()]
        assert not answered, f"a queued request was answered while both slots were busy: {answered}"
        # ... and everything beyond is refused at once, on HTTP and on gRPC.
        burst = [pool.submit(_post, cluster, _completion("the sea", 8, stream=i % 2 == 1)) for i in range(8)]
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster['grpc']}"))
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="the sea"),
                               metadata=[("application", "cbserve")], timeout=60))
        grpc_latency = time.perf_counter() - t0
        refused = [f.result(timeout=60) for f in burst]
        burst_done = time.perf_counter()
        assert not any(f.done() for f in queued), "the queued requests must still be waiting during the burst"
        stats = _worker_stats_nowait(cluster)

        for status, headers, raw, _ in refused:
            _assert_overload_refusal(status, headers, raw)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        latencies = sorted(r[3] for r in refused)
        print(f"\nrefusal latency: HTTP median {statistics.median(latencies) * 1000:.0f} ms, "
              f"max {latencies[-1] * 1000:.0f} ms; gRPC {grpc_latency * 1000:.0f} ms")
        assert latencies[-1] < 2.0 and grpc_latency < 2.0  # refused, not queued behind 450-token streams

        # The held streams ran to the end, after the burst: the slots really were busy meanwhile.
        for stream in held:
            result, ended = stream.finish()
            assert result == held_expected
            assert ended > burst_done
        # The queued requests then ran, with the right tokens.
        for prompt, future in zip(expected, queued):
            status, _, raw, _ = future.result(timeout=120)
            assert status == 200, raw
            assert _text(raw, False) == expected[prompt]
    assert stats is None or stats["running"] + stats["waiting"] <= MAX_ONGOING
    final = _wait_idle(cluster)
    assert final["free_pages"] == final["total_pages"] and final["running"] == final["waiting"] == 0


def _worker_stats_nowait(cluster: dict[str, Any]) -> dict[str, Any] | None:
    """The replica's latest stats from the stats board (a handle call to the worker itself would
    wait for a free slot)."""
    board = cluster["serve"].get_deployment_handle("StatsBoard", app_name="cbserve")
    snapshot = board.snapshot.remote().result(timeout_s=30)
    return next(iter(snapshot.values()), None)


def test_flood_keeps_engine_bounded_and_answers_correct(cluster: dict[str, Any]) -> None:
    """32 concurrent clients, mixed lengths, half streaming: every answer is either correct or a
    quick 503; the engine never holds more than max_ongoing_requests; no page leaks."""
    prompts = ["the sea", "one two", "hello world", "café naïve", "paris france"]
    lengths = [32, 96, 160]  # accepted requests take seconds: a refusal that queued would too
    expected = {(p, n): _text(_post(cluster, _completion(p, n))[2], False) for p in prompts for n in lengths}

    peak = {"engine": 0, "live": 0, "samples": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = _worker_stats_nowait(cluster)
            if s is not None:
                peak["engine"] = max(peak["engine"], s["running"] + s["waiting"])
                peak["live"] = max(peak["live"], s["live_requests"])
                peak["samples"] += 1
            time.sleep(0.05)

    jobs = [(prompts[i % len(prompts)], lengths[i % len(lengths)], i % 2 == 0) for i in range(32)]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda job: _post(cluster, _completion(job[0], job[1], job[2])), jobs))
    finally:
        stop.set()
        sampler.join(timeout=30)

    accepted, refusals, served = 0, [], []
    for (prompt, n, stream), (status, headers, raw, seconds) in zip(jobs, results):
        if status == 503:
            _assert_overload_refusal(status, headers, raw)
            refusals.append(seconds)
        else:
            assert status == 200, raw
            assert _text(raw, stream) == expected[(prompt, n)]
            accepted += 1
            served.append(seconds)
    assert refusals, "32 clients against 2 slots + 2 queued: some must be refused"
    assert accepted >= MAX_ONGOING + MAX_QUEUED
    refusals.sort()
    print(f"\nflood: {accepted} accepted, {len(refusals)} refused; refusal latency median "
          f"{statistics.median(refusals) * 1000:.0f} ms, max {refusals[-1] * 1000:.0f} ms; accepted median "
          f"{statistics.median(served) * 1000:.0f} ms; engine peak {peak['engine']} requests over "
          f"{peak['samples']} samples")
    # Refused at the door, not after queueing: every client starts at once, so a refusal that had
    # waited for a slot would come after the first accepted request ended. (A ratio to the served
    # median, 0.5x, failed once at 0.504x on a VM with steal time: 32 client threads on a loaded
    # 2-core machine add their own scheduling delay, hence no tighter absolute bound.)
    assert statistics.median(refusals) < min(served)
    assert refusals[-1] < 5.0
    assert peak["samples"] > 0 and peak["engine"] <= MAX_ONGOING and peak["live"] <= MAX_ONGOING
    final = _wait_idle(cluster)
    assert final["free_pages"] == final["total_pages"] and final["running"] == final["waiting"] == 0
    # Still serving: a probe gets the same tokens as before the flood.
    assert _text(_post(cluster, _completion("the sea", 32))[2], False) == expected[("the sea", 32)]


def test_health_stays_ok_while_overloaded(cluster: dict[str, Any]) -> None:
    """A saturated server is busy, not broken: /health must not take it out of a load balancer."""
    held = [_HeldStream(cluster) for _ in range(MAX_ONGOING)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        queued = [pool.submit(_post, cluster, _completion("the sea", 4)) for _ in range(MAX_QUEUED)]
        time.sleep(0.3)
        conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=60)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 200 and body["status"] == "ok", body
        for stream in held:
            assert stream.finish()[0][1] == "length"
        assert all(f.result(timeout=120)[0] == 200 for f in queued)
    final = _wait_idle(cluster)
    assert final["free_pages"] == final["total_pages"]
