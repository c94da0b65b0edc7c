"""Faults under load, end to end (issue 9, SPEC section 7): a local Ray, Serve on loopback, the
tiny model, many concurrent streaming HTTP clients that count every request.

One Ray and two applications per module (deployed together, so their replicas load at once):

- `faults` at `/faults`: two worker replicas; client disconnects, a killed replica, then a
  scale-down and `serve.shutdown()` during load (the last test);
- `tp` at `/tp`: one worker replica with `tp_size=2`; a killed rank actor.

Every client ends in exactly one of: `ok` (all tokens, `finish_reason`, `[DONE]`, and the text
equals the Python API's greedy answer), `http_error` / `stream_error` (an error in OpenAI's shape,
as the HTTP body or as an SSE event), `reset` (the connection broke and the client noticed), or
`dropped` (the client itself hung up). `truncated` (a clean end without `[DONE]` or a finish
reason: what a client cannot tell from success) and `hang` (no byte within the socket timeout)
are always failures. Two fast tests without Ray come first: the client harness tells these
endings apart, and the OpenAI service turns a worker dying mid-request into an error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import WORDS, free_port, start_local_ray, throttled, tiny_model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
ENGINE = {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 256}
TP_GROUP_TIMEOUT_S = 8.0
GRACE_S = 4.0  # graceful_shutdown_timeout_s of the `faults` workers: long requests outlive it
SOCKET_TIMEOUT_S = 60.0  # a client that gets no byte for this long counts as a hang
REPLICA_HEADER = "x-cbserve-replica"
WORKER = "LLMWorker"


def _args(model_dir: Path, **extra: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": MODEL,
        "engine": ENGINE,
        "generation": {"max_tokens": 16},
        "limits": {"max_tokens": 480},
        "routing": {"chunk_chars": 16, "stats_period_s": 0.5},
    }
    args.update(extra)
    return args


def _faults_args(model_dir: Path, replicas: int) -> dict[str, Any]:
    # Health checks every second: a dead replica is noticed (and replaced) quickly.
    return _args(model_dir, worker={"num_replicas": replicas, "num_cpus": 0.5, "health_check_period_s": 1.0,
                                    "graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": GRACE_S,
                                    "teardown_timeout_s": 5.0})


def _tp_args(model_dir: Path) -> dict[str, Any]:
    return _args(model_dir, tp_size=2, engine={**ENGINE, "cpu_group_timeout": TP_GROUP_TIMEOUT_S},
                 worker={"num_cpus": 0.5, "health_check_period_s": 1.0, "graceful_shutdown_timeout_s": 10})


def _wait_running(serve: Any, apps: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = serve.status().applications
        if all(a in statuses and str(statuses[a].status).endswith("RUNNING") for a in apps):
            return
        bad = [a for a in apps if a in statuses and str(statuses[a].status).endswith("DEPLOY_FAILED")]
        assert not bad, {a: statuses[a].message for a in bad}
        time.sleep(0.5)
    raise AssertionError(f"apps {apps} not running after {timeout}s: {serve.status()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from cbserve.cluster.app import build_app

    model_dir = tiny_model_dir(tmp_path_factory)
    http_port = free_port()
    # address="local": a new cluster, never one that `ray start` left on this machine. Logical
    # CPUs: 2 x 0.5 (faults) + 2 x 0.5 (tp) + room for replacements started before the old go.
    # Every Ray worker at the node's priority, Serve's proxy included, as `make serve` and the Helm
    # chart start them (`cluster/run.py`): the proxy's disconnects are what the tests time.
    try:  # ray.init inside: a start that times out still gets its processes shut down
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RAY_worker_niceness", "0")  # read by the raylet that ray.init starts
            start_local_ray(num_cpus=6, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        t0 = time.monotonic()
        serve.run_many([RunTarget(build_app(_faults_args(model_dir, 2)), name="faults", route_prefix="/faults"),
                        RunTarget(build_app(_tp_args(model_dir)), name="tp", route_prefix="/tp")],
                       wait_for_applications_running=False)
        _wait_running(serve, ["faults", "tp"], timeout=300)
        print(f"\n[faults] both apps running after {time.monotonic() - t0:.1f}s")
        yield {"http": http_port, "model_dir": model_dir, "serve": serve, "ray": ray}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> Any:
    """Greedy answers of the Python API on the same model in this process: what every
    completed request must return. `expect([(prompt, max_tokens), ...])` -> [(text, finish, n)]."""
    from transformers import GenerationConfig

    import cbserve

    # The cluster's dtype (ClusterArgs.dtype), not load_model's "auto".
    model, tokenizer = cbserve.load_model(str(cluster["model_dir"]), dtype="float32")
    cfg = cbserve.ContinuousBatchingConfig(per_request_processors=True, return_logprobs=True, **ENGINE)
    mgr = cbserve.init_continuous_batching(
        model, generation_config=GenerationConfig(max_new_tokens=16, eos_token_id=model.config.eos_token_id),
        continuous_batching_config=cfg,
    )
    mgr.start()
    cache: dict[tuple[str, int], tuple[str, str, int]] = {}

    def expect(jobs: list[tuple[str, int]]) -> list[tuple[str, str, int]]:
        todo = {job: mgr.add_request(tokenizer(job[0]).input_ids, max_new_tokens=job[1], temperature=0.0)
                for job in set(jobs) if job not in cache}
        for job, rid in todo.items():
            out = mgr.get_result(rid, timeout=120)
            assert out is not None and out.request_id == rid
            reason = getattr(out.finish_reason, "value", out.finish_reason)
            cache[job] = (tokenizer.decode(out.generated_tokens, skip_special_tokens=True),
                          "length" if reason == "length" else "stop", len(out.generated_tokens))
        return [cache[job] for job in jobs]

    yield expect
    mgr.stop(timeout=30)
    mgr.destroy()


# ---- the client: one streaming request, classified ----------------------------------------------


@dataclass
class Outcome:
    kind: str = "truncated"  # ok | dropped | http_error | stream_error | reset | truncated | hang
    status: int = 0
    replica: str = ""
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    events: int = 0
    started: float = 0.0
    ended: float = 0.0
    detail: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # `stream_body`: each choice's text, by index
    finishes: dict[int, str] = field(default_factory=dict)
    usage: dict[str, int] | None = None


def _lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The body's lines. Not `resp.readline()`: on a chunked body it turns a connection that
    broke mid-body into a clean end (its `peek` swallows the IncompleteRead); `read1` raises."""
    buf = b""
    while True:
        data = resp.read1(65536)
        if not data:  # the terminating chunk: a clean end
            if buf:
                yield buf
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        yield from lines


def _post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any], out: Outcome) -> http.client.HTTPResponse:
    """POST `body` as JSON; the reply's status and replica header go to `out`."""
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out.status, out.replica = resp.status, resp.getheader(REPLICA_HEADER) or ""
    return resp


def stream(port: int, path: str, prompt: str, max_tokens: int, drop_after: int | None = None,
           on_event: Callable[[Outcome], None] | None = None) -> Outcome:
    """POST a streaming completion and read it to the end (or hang up after `drop_after`
    chunks). Never raises: every way it can end is an `Outcome.kind`."""
    out = Outcome(started=time.monotonic())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SOCKET_TIMEOUT_S)
    try:
        resp = _post(conn, path, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "stream": True}, out)
        if resp.status != 200:
            raw = resp.read()
            out.kind = "http_error"
            try:
                out.error = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                out.detail = raw[:300].decode(errors="replace")  # not OpenAI's shape: checked by callers
            return out
        assert resp.chunked, "a streamed body must be chunked, or a broken connection would look like its end"
        for line in _lines(resp):
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                if out.error is not None:
                    out.kind = "stream_error"
                else:
                    out.kind = "ok" if out.finish_reason else "truncated"
                return out
            obj = json.loads(data)
            if "error" in obj:
                out.error = obj["error"]
                continue
            choice = obj["choices"][0]
            out.text += choice["text"]
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
            out.events += 1
            if on_event is not None:
                on_event(out)
            if drop_after is not None and out.events >= drop_after and out.finish_reason is None:
                out.kind = "dropped"
                conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                return out
        out.kind = "stream_error" if out.error else "truncated"  # a clean end of the body without [DONE]
    except TimeoutError as exc:
        out.kind, out.detail = "hang", repr(exc)
    except (http.client.HTTPException, OSError) as exc:  # IncompleteRead, reset, refused: noticed
        out.kind, out.detail = "reset", repr(exc)
    finally:
        out.ended = time.monotonic()
        conn.close()
    return out


def complete(port: int, path: str, prompt: str, max_tokens: int, drop_after: int | None = None,
             on_event: Callable[[Outcome], None] | None = None) -> Outcome:
    """A non-streaming completion (`on_event` once the request is sent)."""
    out = Outcome(started=time.monotonic())
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SOCKET_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        if on_event is not None:
            on_event(out)
        resp = conn.getresponse()
        out.status, out.replica = resp.status, resp.getheader(REPLICA_HEADER) or ""
        reply = json.loads(resp.read())
        if resp.status == 200:
            out.kind, out.text = "ok", reply["choices"][0]["text"]
            out.finish_reason = reply["choices"][0]["finish_reason"]
        else:
            out.kind, out.error = "http_error", reply.get("error")
    except TimeoutError as exc:
        out.kind, out.detail = "hang", repr(exc)
    except (http.client.HTTPException, OSError, ValueError) as exc:
        out.kind, out.detail = "reset", repr(exc)
    finally:
        out.ended = time.monotonic()
        conn.close()
    return out


def stream_body(port: int, path: str, prompt: str, max_tokens: int, drop_after: int | None = None,
                on_event: Callable[[Outcome], None] | None = None, extra: dict[str, Any] | None = None) -> Outcome:
    """A streaming completion with more body fields (`extra`: n, seed, stop, response_format...),
    read to the end: each choice's text and finish reason by index, and the usage chunk."""
    assert drop_after is None
    out = Outcome(started=time.monotonic())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SOCKET_TIMEOUT_S)
    try:
        resp = _post(conn, path, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}, out)
        if resp.status != 200:
            out.kind, out.detail = "http_error", resp.read()[:300].decode(errors="replace")
            return out
        for line in _lines(resp):
            data = line.removeprefix(b"data: ").strip() if line.startswith(b"data: ") else None
            if data == b"[DONE]":
                done = len(out.finishes) == (extra or {}).get("n", 1) and out.usage is not None
                out.kind = "stream_error" if out.error else "ok" if done else "truncated"
                return out
            obj = json.loads(data) if data else {}
            out.error = obj.get("error", out.error)
            out.usage = obj.get("usage") or out.usage
            for choice in obj.get("choices", []):
                i = choice["index"]
                out.texts[i] = out.texts.get(i, "") + choice["text"]
                if choice.get("finish_reason"):
                    out.finishes[i] = choice["finish_reason"]
                out.events += 1
                if on_event is not None:
                    on_event(out)
        out.kind = "truncated"
    except (TimeoutError, http.client.HTTPException, OSError) as exc:
        out.kind, out.detail = "reset", repr(exc)
    finally:
        out.ended = time.monotonic()
        conn.close()
    return out


def openai_stream(port: int, path: str, prompt: str, max_tokens: int, drop_after: int | None = None,
                  on_event: Callable[[Outcome], None] | None = None) -> Outcome:
    """`stream` through the official `openai` client: what a real client notices of each way
    a request can end (`path` as for `stream`; no `drop_after`)."""
    import openai

    assert drop_after is None
    out = Outcome(started=time.monotonic())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}{path.removesuffix('/completions')}",
                           api_key="none", max_retries=0, timeout=SOCKET_TIMEOUT_S)
    try:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True)
        out.status, out.replica = chunks.response.status_code, chunks.response.headers.get(REPLICA_HEADER, "")
        for chunk in chunks:
            choice = chunk.choices[0]
            out.text += choice.text
            out.finish_reason = choice.finish_reason or out.finish_reason
            out.events += 1
            if on_event is not None:
                on_event(out)
        out.kind = "ok" if out.finish_reason else "truncated"  # the client saw a normal end
    except openai.APITimeoutError as exc:
        out.kind, out.detail = "hang", repr(exc)
    except openai.APIConnectionError as exc:  # the connection broke: the client raises
        out.kind, out.detail = "reset", repr(exc.__cause__ or exc)
    except openai.APIStatusError as exc:
        out.kind, out.status = "http_error", exc.status_code
        out.error = exc.body if isinstance(exc.body, dict) and "message" in exc.body else None
    except openai.APIError as exc:  # an error event in the stream: the client raises it
        out.kind, out.error = "stream_error", exc.body if isinstance(exc.body, dict) else None
    finally:
        out.ended = time.monotonic()
        client.close()
    return out


def _check_error_shape(out: Outcome) -> None:
    """An explicit failure: a server error in OpenAI's shape."""
    assert out.error is not None, out
    assert {"message", "type", "param", "code"} <= set(out.error), out
    assert out.error["message"], out
    assert out.error["type"] in ("internal_server_error", "service_unavailable", "server_error"), out
    if out.kind == "http_error":
        assert out.status >= 500, out  # a fault of the server, not of the request


def _check_completed(outs: list[Outcome], jobs: list[tuple[str, int]], reference: Any) -> None:
    for out, (text, finish, _), job in zip(outs, reference(jobs), jobs):
        assert out.kind == "ok", (job, out)
        assert out.text == text and out.finish_reason == finish, (job, out, text, finish)


def _prompts(rng: random.Random, n: int, tag: str) -> list[str]:
    return [f"{tag} {i} " + " ".join(rng.sample(WORDS, 6)) for i in range(n)]


def _board(cluster: dict[str, Any], app: str) -> dict[str, dict[str, Any]]:
    handle = cluster["serve"].get_deployment_handle("StatsBoard", app_name=app)
    return handle.snapshot.remote().result(timeout_s=30)


def _wait_idle(cluster: dict[str, Any], app: str, since: float, replicas: int, timeout: float = 30.0
               ) -> dict[str, dict[str, Any]]:
    """Poll the workers' stats (pushed every 0.5 s) until every live replica reports, after
    `since`, no running or waiting request and all its KV pages free."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        fresh = {r: s for r, s in _board(cluster, app).items() if s["age_s"] < now - since}
        idle = all(s["running"] == 0 and s["waiting"] == 0 and s["live_requests"] == 0
                   and s["free_pages"] == s["total_pages"] for s in fresh.values())
        if len(fresh) == replicas and idle:
            return fresh
        if now > deadline:
            raise AssertionError(f"workers not idle {timeout}s after the load: {fresh}")
        time.sleep(0.25)


def _replica_actor(app: str, replica: str) -> str:
    return f"SERVE_REPLICA::{app}#{WORKER}#{replica}"


def _alive(prefix: str) -> list[dict[str, Any]]:
    import ray

    return [a for a in ray._private.state.actors().values()  # private: list_actors needs the dashboard
            if a["State"] == "ALIVE" and (a.get("Name") or "").startswith(prefix)]


def _running_replicas(serve: Any, app: str) -> int:
    states = serve.status().applications[app].deployments[WORKER].replica_states
    return sum(n for state, n in states.items() if str(state).endswith("RUNNING"))


def _probe_until_new_replica(cluster: dict[str, Any], app: str, since: float, old: set[str], reference: Any,
                             timeout: float = 180.0) -> tuple[float, str, list[Outcome]]:
    """Send short requests one after another until one succeeds on a replica not in `old`.
    Returns the time from `since` to that success, the new replica, and every probe's outcome,
    each of which must be a correct answer or an explicit server error (never a hang)."""
    outs: list[Outcome] = []
    while time.monotonic() < since + timeout:
        out = stream(cluster["http"], f"/{app}/v1/completions", f"probe {len(outs)} hello world", 8)
        outs.append(out)
        if out.kind == "ok" and out.replica not in old:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no new replica of {app} served a request within {timeout}s: {outs[-3:]}")
    for out in outs:
        assert out.kind in ("ok", "http_error", "stream_error"), out
        if out.kind != "ok":
            _check_error_shape(out)
    ok = [k for k, o in enumerate(outs) if o.kind == "ok"]
    _check_completed([outs[k] for k in ok], [(f"probe {k} hello world", 8) for k in ok], reference)
    return outs[-1].ended - since, outs[-1].replica, outs


class Load:
    """Runs clients on threads; `wait_flowing` returns once each has seen `n` chunks (or ended)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.pool = concurrent.futures.ThreadPoolExecutor(64)
        self.futures: list[concurrent.futures.Future[Outcome]] = []
        self.live: list[Outcome | None] = []  # each client's outcome so far, once it has one
        self._seen: list[threading.Event] = []

    def start(self, path: str, prompt: str, max_tokens: int, drop_after: int | None = None,
              flowing_after: int = 2, client: Callable[..., Outcome] = stream) -> int:
        seen = threading.Event()
        idx = len(self.futures)
        self.live.append(None)

        def on_event(out: Outcome) -> None:
            self.live[idx] = out  # the replica header is in once the first chunk is
            if out.events >= flowing_after:
                seen.set()

        def run() -> Outcome:
            try:
                return client(self.port, path, prompt, max_tokens, drop_after, on_event)
            finally:
                seen.set()

        self._seen.append(seen)
        self.futures.append(self.pool.submit(run))
        return len(self.futures) - 1

    def wait_flowing(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for seen in self._seen:
            assert seen.wait(max(0.0, deadline - time.monotonic())), "clients got no tokens"

    def results(self, timeout: float) -> list[Outcome]:
        """Every client's outcome; a client still running after `timeout` is a hang."""
        deadline = time.monotonic() + timeout
        outs = []
        for f in self.futures:
            try:
                outs.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                outs.append(Outcome(kind="hang", detail="still running at the deadline"))
        self.pool.shutdown(wait=False, cancel_futures=True)
        return outs


# ---- 0. the client harness itself -----------------------------------------------------------------


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _FakeSSE(threading.Thread):
    """A loopback server that streams one SSE body per connection and ends it as the path says:
    `ok` (finish_reason, [DONE], last chunk), `cut` (the socket closes mid-body), `end` (the last
    chunk without [DONE]: clean-looking), `error` (an error event, [DONE])."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(65536)
                mode = head.split(b" ")[1].split(b"/")[1].decode()
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = head.split(b"\r\n\r\n", 1)[1]
                while len(body) < length:
                    body += conn.recv(65536)
                event = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "text": "hi", "finish_reason": None, "logprobs": None}]}
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
                conn.sendall(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
                if mode == "cut":
                    continue
                if mode == "ok":
                    event["choices"][0].update(text="", finish_reason="length")
                    conn.sendall(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
                if mode == "error":
                    error = {"error": {"message": "boom", "type": "service_unavailable", "param": None, "code": None}}
                    conn.sendall(_chunk(b"data: " + json.dumps(error).encode() + b"\n\n"))
                if mode != "end":
                    conn.sendall(_chunk(b"data: [DONE]\n\n"))
                conn.sendall(b"0\r\n\r\n")


@pytest.mark.parametrize("client", [stream, openai_stream])
def test_client_harness_tells_every_ending_apart(client: Callable[..., Outcome]) -> None:
    """Without this the other tests could pass on a broken connection read as a clean end
    (`HTTPResponse.readline` does that) or on a clean-looking early end read as success."""
    server = _FakeSSE()
    server.start()
    try:
        kinds = {mode: client(server.port, f"/{mode}/v1/completions", "hi", 4).kind
                 for mode in ("ok", "cut", "end", "error")}
    finally:
        server.sock.close()
    assert kinds == {"ok": "ok", "cut": "reset", "end": "truncated", "error": "stream_error"}


def _service_with_failing_worker(ending: str) -> Any:
    """An `OpenAIService` whose worker streams one delta, then dies (`raise`, as Ray's handle
    does when the replica's actor dies) or stops without its `end` event (`stop`)."""
    import asyncio

    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.front.openai_service import OpenAIService
    from cbserve.serving.front.replies import ChoiceStream
    from cbserve.serving.protocol import WorkerEvent

    async def events() -> Any:
        yield WorkerEvent(kind="delta", text="hi", token_ids=[5])
        await asyncio.sleep(0)
        if ending == "raise":
            raise RuntimeError("The actor died unexpectedly before finishing this task.")

    async def open_choice(wreq: Any) -> ChoiceStream:
        return ChoiceStream(start=WorkerEvent(kind="start", replica="r", prompt_tokens=1), events=events(),
                            cancel=lambda: None)

    return OpenAIService(ClusterArgs(served_model_name=MODEL), open_choice)


@pytest.mark.parametrize("ending", ["raise", "stop"])
def test_service_turns_a_worker_dying_mid_request_into_an_error(ending: str) -> None:
    """Streamed: an error event in OpenAI's shape, then [DONE] (not a clean-looking end, not an
    exception that cuts the body). Not streamed: a 503."""
    import asyncio

    from cbserve.serving.api_errors import APIError
    from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest

    async def sse(reply: Any) -> list[str]:
        return [line async for line in (await reply).stream]

    for request, call in ((CompletionRequest(model=MODEL, prompt="hi", stream=True), "complete"),
                          (ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True), "chat")):
        service = _service_with_failing_worker(ending)
        lines = asyncio.run(sse(getattr(service, call)(request)))
        assert lines[-1] == "data: [DONE]\n\n"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "retry" in error["message"], error
        assert all("finish_reason\": \"" not in line for line in lines)  # nothing looks finished
    with pytest.raises(APIError) as info:
        asyncio.run(_service_with_failing_worker(ending).complete(CompletionRequest(model=MODEL, prompt="hi")))
    assert info.value.status == 503



@pytest.mark.parametrize("ending", ["raise", "stop"])
def test_grpc_generate_turns_a_worker_dying_mid_request_into_unavailable(ending: str, monkeypatch) -> None:
    """gRPC: a status (UNAVAILABLE), never UNKNOWN and never an OK stream cut short."""
    import asyncio

    import grpc

    from cbserve.cluster.ingress import OpenAIIngress
    from cbserve.serving.front import grpc_service
    from cbserve.serving.front.metrics import ServingMetrics

    service = _service_with_failing_worker(ending)
    ingress = object.__new__(OpenAIIngress)  # the handler alone: no Serve, no FastAPI app
    ingress._api_key, ingress.metrics, ingress.service = None, ServingMetrics(MODEL), service
    ingress._open_choice = service._open_choice
    monkeypatch.setattr(grpc_service, "to_worker_request", lambda request, service: None)

    class Context:
        code = None

        def invocation_metadata(self) -> list:
            return []

        def set_code(self, code: Any) -> None:
            self.code = code

        def set_details(self, details: str) -> None:
            self.details = details

    async def collect(ctx: Context) -> list[Any]:
        return [m async for m in ingress.Generate(None, ctx)]

    ctx = Context()
    with pytest.raises(grpc_service.GrpcAbort):
        asyncio.run(collect(ctx))
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and "before the request finished" in ctx.details

# ---- 1. disconnects under load ------------------------------------------------------------------


def test_disconnects_under_load_free_every_page(cluster: dict[str, Any], reference: Any) -> None:
    """32 concurrent streams over two replicas; 30% hang up at a random point mid-stream. The
    others get their complete greedy answers; afterwards both workers are idle with every KV
    page free, and the dropped requests were cancelled, not run to the end."""
    rng = random.Random(1)
    n, n_drop = 32, 10
    prompts = _prompts(rng, n, "drop")
    # Droppers ask for long answers (so they are still generating when they hang up), and are
    # chosen among prompts whose greedy answer is long (no early EOS).
    long_jobs = [(p, 300) for p in prompts]
    long_lens = [k for _, _, k in reference(long_jobs)]
    droppers = set(rng.sample([i for i in range(n) if long_lens[i] >= 100], n_drop))
    jobs = [(p, 300 if i in droppers else rng.randint(8, 48)) for i, p in enumerate(prompts)]
    expected = reference(jobs)
    before = _wait_idle(cluster, "faults", time.monotonic(), replicas=2)

    load = Load(cluster["http"])
    for i, (prompt, max_tokens) in enumerate(jobs):
        load.start("/faults/v1/completions", prompt, max_tokens, drop_after=rng.randint(1, 12) if i in droppers else None)
    outs = load.results(timeout=180)
    t_end = time.monotonic()

    kept = [i for i in range(n) if i not in droppers]
    _check_completed([outs[i] for i in kept], [jobs[i] for i in kept], reference)
    assert [outs[i].kind for i in sorted(droppers)] == ["dropped"] * n_drop, [outs[i] for i in sorted(droppers)]
    assert len({o.replica for o in outs}) == 2  # the load was spread over both replicas

    after = _wait_idle(cluster, "faults", t_end, replicas=2)
    drain_s = time.monotonic() - t_end
    generated = sum(s["generated_tokens"] for s in after.values()) - sum(s["generated_tokens"] for s in before.values())
    full = sum(k for _, _, k in expected)
    dropped_full = sum(expected[i][2] for i in droppers)
    print(f"\n[faults] disconnects: {n} clients, {n_drop} dropped, {len(kept)} complete and correct; "
          f"tokens generated {generated} of {full} if all had finished ({dropped_full} for the dropped); "
          f"workers idle with all pages free {drain_s:.2f}s after the last client")
    # The dropped requests were cancelled in the engine: well under their full answers were generated.
    assert generated < full - dropped_full / 2


# ---- 2. a worker replica crashes under load ------------------------------------------------------


def test_killed_replica_streams_migrate_and_it_is_replaced(cluster: dict[str, Any], reference: Any) -> None:
    """Kill one of two worker replicas (`ray.kill` of its actor) with streams on both. Its
    streams and non-streamed requests go on on the other replica (stream migration) and complete
    with exactly the undisturbed text, as the other replica's do; requests sent during the outage
    get an answer or an explicit error; Serve starts a new replica, which serves new requests."""
    import ray

    serve = cluster["serve"]
    rng = random.Random(2)
    prompts = _prompts(rng, 8, "crash")
    jobs = [(p, 400) for p in prompts]
    whole_jobs = [(f"whole {k} the sea", 400) for k in range(4)]
    reference(jobs + whole_jobs)
    workers = _alive(f"SERVE_REPLICA::faults#{WORKER}#")
    alive = {a["Name"].rsplit("#", 1)[1] for a in workers}
    with throttled([a["Pid"] for a in workers]):  # until the kill: the streams are mid-generation then
        whole = Load(cluster["http"])  # non-streaming requests, sent first: in flight on both replicas
        for prompt, max_tokens in whole_jobs:
            whole.start("/faults/v1/completions", prompt, max_tokens, client=complete, flowing_after=0)
        whole.wait_flowing()
        load = Load(cluster["http"])
        for k, (prompt, max_tokens) in enumerate(jobs):  # half through the official client
            load.start("/faults/v1/completions", prompt, max_tokens, client=openai_stream if k % 2 else stream)
        load.wait_flowing()
        # Routing hashes each prompt's first chunk onto the replicas, whose names are new each run: all
        # 8 may land on one (about 1 run in 128). Then more streams, until the other serves one too.
        for k in range(8):
            if {o.replica for o in load.live if o is not None} == alive:
                break
            jobs.append((f"crash more {k} " + " ".join(rng.sample(WORDS, 6)), 400))
            reference(jobs[-1:])
            load.start("/faults/v1/completions", *jobs[-1], client=stream)
            load.wait_flowing()

    # The victim: the replica serving the most streams (both must serve some).
    per_replica = collections.Counter(o.replica for o in load.live if o is not None)
    assert len(alive) == 2 and set(per_replica) == alive, (alive, per_replica)
    victim = per_replica.most_common(1)[0][0]
    survivor = (alive - {victim}).pop()
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(_replica_actor("faults", victim), namespace="serve"), no_restart=True)

    # During the outage, short requests keep coming: each gets an answer or an explicit error.
    recovery_s, new_replica, probe_outs = _probe_until_new_replica(cluster, "faults", t_kill, {victim, survivor},
                                                                   reference)

    outs = load.results(timeout=120)
    on_victim = [(o, j) for o, j in zip(outs, jobs) if o.replica == victim]
    on_survivor = [(o, j) for o, j in zip(outs, jobs) if o.replica == survivor]
    assert on_victim and on_survivor and len(on_victim) + len(on_survivor) == len(outs), outs
    # Every stream completes with the undisturbed text: no token lost or repeated at the splice.
    _check_completed([o for o, _ in on_victim], [j for _, j in on_victim], reference)
    _check_completed([o for o, _ in on_survivor], [j for _, j in on_survivor], reference)
    done_s = max(o.ended for o, _ in on_victim) - t_kill

    # Non-streaming requests on the victim migrate too: every one is answered, correctly.
    whole_outs = whole.results(timeout=60)
    assert all(o.kind == "ok" for o in whole_outs), whole_outs
    _check_completed(whole_outs, whole_jobs, reference)
    # Each stream still generating on the victim when it died was continued elsewhere. A fast machine
    # may finish some of their 400 tokens before the kill (a CI run counted 1 migration of 10 victim
    # streams): those reach their clients within milliseconds of it, so a stream that ended half a
    # second after the kill or later was surely continued (a lower bound); and at least one choice was.
    migrated = _migrations(cluster["http"], "/faults")
    cut = [o for o, _ in on_victim if o.ended > t_kill + 0.5]
    assert migrated.get("replica_failed", 0) >= max(1, len(cut)), (migrated, len(cut), len(on_victim))

    probe_kinds = [o.kind for o in probe_outs]
    assert _running_replicas(serve, "faults") == 2
    print(f"\n[faults] replica kill: {len(on_victim)} streams on the killed replica all completed on the other "
          f"(correct text) within {done_s:.2f}s of the kill (ended at "
          f"{sorted(round(o.ended - t_kill, 2) for o, _ in on_victim)} s; streams started "
          f"{t_kill - min(o.started for o in outs):.2f} s before it); "
          f"migrations {migrated}; {len(whole_outs)} non-streamed "
          f"requests all answered; {len(on_survivor)} streams on the other "
          f"replica completed; outage probes "
          f"{ {k: probe_kinds.count(k) for k in set(probe_kinds)} }; new replica {new_replica} served a "
          f"request {recovery_s:.1f}s after the kill")
    assert recovery_s < 120
    _wait_idle(cluster, "faults", time.monotonic(), replicas=2)


# Issue 32's mix: greedy, a JSON schema, n=2 with seeded sampling, seeded sampling with nucleus
# and penalties, stop strings; each request's body beside the completion fields.
MIX = [
    {},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}},
    {"n": 2, "temperature": 0.9, "seed": 11},
    {"temperature": 1.0, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.5},
    {"stop": ["sea", "ten"], "temperature": 0.7, "seed": 3},
]


def test_a_32_stream_mix_migrates_off_a_killed_replica_unchanged(cluster: dict[str, Any]) -> None:
    """32 streams over both replicas, every kind of `MIX`, run once undisturbed, then again with
    the replica serving the most killed mid-generation: every stream completes with each choice's
    text, finish reason and usage equal to the undisturbed run's (no token lost, repeated or
    counted twice at the splice)."""
    import functools

    import ray

    rng = random.Random(32)
    prompts = _prompts(rng, 32, "mix")
    jobs = [(p, 48 + 8 * (k % 4), MIX[k % len(MIX)]) for k, p in enumerate(prompts)]

    def run(kill: bool) -> tuple[list[Outcome], dict[str, int]]:
        load = Load(cluster["http"])
        pids = [a["Pid"] for a in _alive(f"SERVE_REPLICA::faults#{WORKER}#")] if kill else []
        with throttled(pids):  # until the kill: the streams are mid-generation then
            for prompt, max_tokens, extra in jobs:
                load.start("/faults/v1/completions", prompt, max_tokens,
                           client=functools.partial(stream_body, extra=extra), flowing_after=1)
            load.wait_flowing()
        # The replica header names each choice's replica (n=2: two, comma-separated).
        per_replica = collections.Counter(r for o in load.live if o is not None for r in o.replica.split(",") if r)
        if kill:
            victim = per_replica.most_common(1)[0][0]
            ray.kill(ray.get_actor(_replica_actor("faults", victim), namespace="serve"), no_restart=True)
        return load.results(timeout=180), per_replica

    undisturbed, _ = run(kill=False)
    assert all(o.kind == "ok" for o in undisturbed), [o for o in undisturbed if o.kind != "ok"]
    before = _migrations(cluster["http"], "/faults").get("replica_failed", 0)
    outs, per_replica = run(kill=True)
    assert len(per_replica) == 2, per_replica  # streams on both replicas when one was killed
    for out, calm, job in zip(outs, undisturbed, jobs):
        assert out.kind == "ok", (job, out)
        assert (out.texts, out.finishes, out.usage) == (calm.texts, calm.finishes, calm.usage), (job, out, calm)
    migrated = _migrations(cluster["http"], "/faults").get("replica_failed", 0) - before
    assert migrated >= 1
    print(f"\n[faults] 32-stream mix: {migrated} choices migrated off the killed replica, every stream equal "
          f"to its undisturbed run")
    deadline = time.monotonic() + 180  # Serve replaces the replica before the next test
    while _running_replicas(cluster["serve"], "faults") < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
    _wait_idle(cluster, "faults", time.monotonic(), replicas=2, timeout=120)


def _migrations(port: int, prefix: str) -> dict[str, float]:
    """`cbserve:migrations_total` of the app's /metrics, by reason."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", f"{prefix}/metrics")
    text = conn.getresponse().read().decode()
    found: dict[str, float] = collections.Counter()
    for line in text.splitlines():
        if line.startswith("cbserve:migrations_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] += float(line.rsplit(" ", 1)[1])
    return dict(found)


# ---- 3. a tensor-parallel rank dies under load ---------------------------------------------------


def test_tp_rank_death_fails_in_flight_requests_and_replaces_the_replica(cluster: dict[str, Any],
                                                                          reference: Any) -> None:
    """Kill rank 1 (a Ray actor) of a tp_size=2 replica with streams in flight. They end with an
    error event naming the tensor-parallel failure within about `cpu_group_timeout`; the replica
    reports itself unhealthy, Serve replaces it (with a new rank actor) and new requests succeed."""
    import ray

    from cbserve.cluster.tp_ranks import RANK_NAMESPACE, rank_actor_name

    rng = random.Random(3)
    jobs = [(p, 400) for p in _prompts(rng, 4, "tp")]
    reference(jobs)
    [old] = [a["Name"].rsplit("#", 1)[1] for a in _alive(f"SERVE_REPLICA::tp#{WORKER}#")]
    load = Load(cluster["http"])
    for prompt, max_tokens in jobs:
        load.start("/tp/v1/completions", prompt, max_tokens)
    load.wait_flowing()
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(rank_actor_name(f"cbserve-{old}", 1), namespace=RANK_NAMESPACE), no_restart=True)

    outs = load.results(timeout=TP_GROUP_TIMEOUT_S + 60)
    for out in outs:
        assert out.replica == old and out.kind == "stream_error", out
        _check_error_shape(out)
        assert "tensor-parallel" in out.error["message"], out
    detect_s = max(o.ended for o in outs) - t_kill
    recovery_s, new, probes = _probe_until_new_replica(cluster, "tp", t_kill, {old}, reference)
    kinds = [o.kind for o in probes]
    print(f"\n[faults] tp rank death: {len(outs)} in-flight streams failed with a tensor-parallel error "
          f"within {detect_s:.2f}s of the kill (cpu_group_timeout {TP_GROUP_TIMEOUT_S:g}s); probes "
          f"{ {k: kinds.count(k) for k in set(kinds)} }; replacement {new} served a request "
          f"{recovery_s:.1f}s after the kill")
    assert detect_s < TP_GROUP_TIMEOUT_S + 10
    assert recovery_s < 150
    # The failed replica and its ranks are gone; the new one has exactly one rank actor.
    assert not _alive(_replica_actor("tp", old))
    ranks = [a["Name"] for a in _alive("cbserve-") if "-tp-rank" in a["Name"]]
    assert ranks == [rank_actor_name(f"cbserve-{new}", 1)], ranks
    _wait_idle(cluster, "tp", time.monotonic(), replicas=1)


def test_tp_rank_hang_fails_within_cpu_group_timeout(cluster: dict[str, Any], reference: Any) -> None:
    """Freeze rank 1 (SIGSTOP: alive but silent, so no connection breaks) mid-stream. Only the
    collectives' `cpu_group_timeout` can notice: the streams fail after about that long (not
    much sooner, not never) and the replica is replaced; the frozen rank is not left behind."""
    import os
    import signal

    from cbserve.cluster.tp_ranks import rank_actor_name

    rng = random.Random(5)
    jobs = [(p, 400) for p in _prompts(rng, 3, "hang")]
    reference(jobs)
    [old] = [a["Name"].rsplit("#", 1)[1] for a in _alive(f"SERVE_REPLICA::tp#{WORKER}#")]
    [rank] = _alive(rank_actor_name(f"cbserve-{old}", 1))
    load = Load(cluster["http"])
    for prompt, max_tokens in jobs:
        load.start("/tp/v1/completions", prompt, max_tokens)
    load.wait_flowing()
    t_stop = time.monotonic()
    os.kill(rank["Pid"], signal.SIGSTOP)  # a process of this test's own Ray cluster
    try:
        outs = load.results(timeout=TP_GROUP_TIMEOUT_S + 60)
        for out in outs:
            assert out.replica == old and out.kind == "stream_error", out
            _check_error_shape(out)
            assert "tensor-parallel" in out.error["message"], out
        detect_s = max(o.ended for o in outs) - t_stop
        recovery_s, _, _ = _probe_until_new_replica(cluster, "tp", t_stop, {old}, reference)
        print(f"\n[faults] tp rank hang: {len(outs)} in-flight streams failed {detect_s:.2f}s after SIGSTOP "
              f"(cpu_group_timeout {TP_GROUP_TIMEOUT_S:g}s); replacement served a request {recovery_s:.1f}s after")
        assert TP_GROUP_TIMEOUT_S - 1 <= detect_s < TP_GROUP_TIMEOUT_S + 15
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _pid_alive(rank["Pid"]):
            time.sleep(0.5)
        assert not _pid_alive(rank["Pid"]), "the frozen rank outlived its replica"
    finally:
        if _pid_alive(rank["Pid"]):
            os.kill(rank["Pid"], signal.SIGKILL)  # never leave a stopped process behind


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is gone, just not reaped
    except FileNotFoundError:
        return False


# ---- 4. scale-down and shutdown under load ---------------------------------------------------------


def _check_accounted(outs: list[Outcome], jobs: list[tuple[str, int]], reference: Any, allowed: set[str]
                     ) -> dict[str, int]:
    """Every request completed correctly or failed explicitly (kinds in `allowed`)."""
    for out, job in zip(outs, jobs):
        assert out.kind in allowed, (job, out)
        if out.kind in ("http_error", "stream_error"):
            _check_error_shape(out)
    ok = [k for k, o in enumerate(outs) if o.kind == "ok"]
    _check_completed([outs[k] for k in ok], [jobs[k] for k in ok], reference)
    kinds = [o.kind for o in outs]
    return {k: kinds.count(k) for k in sorted(set(kinds))}


def test_scale_down_then_shutdown_under_load_account_for_every_request(cluster: dict[str, Any],
                                                                       reference: Any) -> None:
    """Redeploy `faults` with one replica instead of two while streams run and new requests
    arrive, then `serve.shutdown()` while streams run. The client side counts: the streams
    running when the redeploy starts all complete (those the old replicas still held when they
    went continue on the new one: stream migration); every other request completed (correct
    text) or failed explicitly; none hangs or ends like a success without being one. Runs last:
    it shuts Serve down."""
    from cbserve.cluster.app import build_app

    serve = cluster["serve"]
    rng = random.Random(4)
    # Short requests finish within the drain; 400-token ones may outlive it (GRACE_S).
    jobs = [(p, rng.choice([12, 24, 400])) for p in _prompts(rng, 16, "scale")]
    reference(jobs)
    running = len(jobs)
    old = {a["Name"].rsplit("#", 1)[1] for a in _alive(f"SERVE_REPLICA::faults#{WORKER}#")}
    load = Load(cluster["http"])
    for prompt, max_tokens in jobs:
        load.start("/faults/v1/completions", prompt, max_tokens)
    load.wait_flowing()

    t0 = time.monotonic()
    deploy = threading.Thread(target=serve.run, args=(build_app(_faults_args(cluster["model_dir"], 1)),),
                              kwargs={"name": "faults", "route_prefix": "/faults"}, daemon=True)
    deploy.start()
    while time.monotonic() < t0 + 180:  # requests keep arriving until the old replicas are gone
        k = len(jobs)
        jobs.append((f"during {k} hello world", 8))
        load.start("/faults/v1/completions", *jobs[-1])
        time.sleep(0.3)
        if not deploy.is_alive() and not any(_alive(_replica_actor("faults", r)) for r in old):
            break
    deploy.join(timeout=10)
    assert not deploy.is_alive() and _running_replicas(serve, "faults") == 1
    scaled_s = time.monotonic() - t0
    reference(jobs)
    outs = load.results(timeout=90)
    counts = _check_accounted(outs, jobs, reference, {"ok", "http_error", "stream_error"})
    _check_completed(outs[:running], jobs[:running], reference)
    print(f"\n[faults] redeploy 2 -> 1 replica under load: {len(jobs)} requests {counts}; old replicas gone "
          f"after {scaled_s:.1f}s; errors: {sorted({o.error['message'][:90] for o in outs if o.error})}")

    jobs = [(p, rng.choice([24, 400])) for p in _prompts(rng, 10, "shutdown")]
    reference(jobs)
    load = Load(cluster["http"])
    for k, (prompt, max_tokens) in enumerate(jobs):  # half through the official client
        load.start("/faults/v1/completions", prompt, max_tokens, client=openai_stream if k % 2 else stream)
    load.wait_flowing()
    t0 = time.monotonic()
    serve.shutdown()
    shutdown_s = time.monotonic() - t0
    # The proxy itself goes away: a broken connection the client notices is explicit too.
    outs = load.results(timeout=60)
    counts = _check_accounted(outs, jobs, reference, {"ok", "http_error", "stream_error", "reset"})
    print(f"[faults] serve.shutdown() under load took {shutdown_s:.1f}s: {len(jobs)} requests {counts}; "
          f"{sorted({o.detail[:90] for o in outs if o.detail})}")
