"""The one module that uses Ray Serve's private API; everything else uses Ray's public API only.

What is private, and why it is used:

- `ray.serve._private.constants` and the Serve controller's `get_http_config`: the host Serve's
  HTTP proxy is bound to (the ingress warns when it is open beyond loopback without an API key).
- `ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter`: Serve's default router,
  named when prefix routing is off (Serve has no public name for it).
- `ray.llm._internal...:PrefixCacheAffinityRouter`: Ray Serve LLM's prefix router, whose public
  name cannot be imported without vLLM or SGLang (the routing benchmark compares it with ours).
- `ray.serve._private.default_impl.add_grpc_address`, which Serve's proxy calls with `[::]:<port>`
  whatever `http_options.host` says (`gRPCOptions` has no host): `bind_grpc_to_host`, run in each
  proxy through Serve's `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` hook before its gRPC server
  starts, binds it to `$CBSERVE_GRPC_HOST` instead (`proxy_env_vars` sets both).
- `ray.serve._private.haproxy.HAPROXY_CONFIG_TEMPLATE`: with Serve's HAProxy ingress
  (`RAY_SERVE_ENABLE_HA_PROXY=1`, what `make serve` runs) HAProxy's stats page and Prometheus
  frontend bind every interface whatever `http_options.host` says, and its admin socket is open to
  every local user; `harden_haproxy_config`, the job's `worker_process_setup_hook` (run in
  each of Ray's worker processes, the HAProxyManager actor's included), fixes the template. And the
  request id Serve gives each request (`x-request-id`), read from its request context.
- Members of `RequestRouter` that `CompatRouter` reads or overrides: the replica queue-length
  cache and its probe (`_use_replica_queue_len_cache`, `_replica_queue_len_cache`,
  `_probe_queue_lens`), and the matching of a routed replica to its pending request
  (`_fulfill_next_pending_request` and the pending-request bookkeeping it touches).

`PRIVATE_MEMBERS` lists them; `tests/cluster/test_ray_compat.py` checks that each exists in the installed
Ray, and `pyproject.toml` pins the Ray versions that test passed on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)

DEFAULT_ROUTER_CLASS = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
# Ray Serve LLM's prefix router (compared with ours in bench/routing.py). Its public name,
# `ray.serve.llm.request_router:PrefixCacheAffinityRouter`, imports only with vLLM or SGLang installed.
RAY_LLM_PREFIX_ROUTER_CLASS = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)

# (module, name) of private module-level names; ("RequestRouter", name) of private router members.
PRIVATE_MEMBERS: list[tuple[str, str]] = [
    ("ray.serve._private.constants", "SERVE_CONTROLLER_NAME"),
    ("ray.serve._private.constants", "SERVE_NAMESPACE"),
    ("ray.serve._private.request_router", "PowerOfTwoChoicesRequestRouter"),
    ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router", "PrefixCacheAffinityRouter"),
    ("ray.serve._private.controller", "ServeController.get_http_config"),
    ("ray.serve._private.default_impl", "add_grpc_address"),
    ("ray.serve._private.grpc_util", "start_grpc_server"),
    ("ray.serve._private.constants", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"),
    ("ray.serve._private.http_util", "configure_http_middlewares"),  # calls the proxy callback
    ("ray.serve._private.haproxy", "HAPROXY_CONFIG_TEMPLATE"),
    ("ray.serve.context", "_get_serve_request_context"),
    ("RequestRouter", "_use_replica_queue_len_cache"),
    ("RequestRouter", "_replica_queue_len_cache"),
    ("RequestRouter", "_probe_queue_lens"),
    ("RequestRouter", "_fulfill_next_pending_request"),
    ("RequestRouter", "_pending_requests_to_fulfill"),
    ("RequestRouter", "_cancel_routing_task_for_pending_request"),
    ("RequestRouter", "_record_queue_wait_time"),
    ("RequestRouter", "_remove_pending_request_from_indices"),
]


def serve_http_host(timeout_s: float = 10.0) -> str | None:
    """The host Serve's HTTP proxies are bound to; None when it cannot be read."""
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=timeout_s).host
    except Exception as exc:  # noqa: BLE001 - advisory only; never fail startup over it
        logger.debug("could not read Serve's HTTP config: %r", exc)
        return None


# Environment of Serve's proxies (`proxy_env_vars`): the proxy calls the callback at start-up and
# reads the message cap when it imports Serve's constants.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
GRPC_HOST_ENV = "CBSERVE_GRPC_HOST"
PROXY_CALLBACK = "cbserve.cluster.ray_compat.bind_grpc_to_host"
# Serve's HAProxy ingress (Ray's documented high-throughput mode): HAProxy on each node answers
# HTTP and gRPC and forwards them to the ingress replicas' own servers, with no Python proxy between.
HA_PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
SETUP_HOOK = "cbserve.cluster.ray_compat.harden_haproxy_config"


def proxy_env_vars(host: str, max_message_bytes: int) -> dict[str, str]:
    """Environment variables for Serve's proxies (the controller's `runtime_env`, which they
    inherit): gRPC bound to `host` as HTTP is, and gRPC messages capped at `max_message_bytes`
    (Serve's default is 2 GiB; larger messages get RESOURCE_EXHAUSTED before they are buffered)."""
    return {PROXY_CALLBACK_ENV: PROXY_CALLBACK, GRPC_HOST_ENV: host, GRPC_MAX_MESSAGE_ENV: str(max_message_bytes)}


def harden_haproxy_config() -> None:
    """A worker process's setup hook: where Serve's HAProxy ingress is on, HAProxy's config is
    rendered with `haproxy_template`'s fixes (its listeners on `$CBSERVE_GRPC_HOST`, the configured
    host; its admin socket for Ray's user only)."""
    host = os.environ.get(GRPC_HOST_ENV)
    if not host or os.environ.get(HA_PROXY_ENV) != "1":
        return
    from ray.serve._private import haproxy

    haproxy.HAPROXY_CONFIG_TEMPLATE = haproxy_template(haproxy.HAPROXY_CONFIG_TEMPLATE, host)


def haproxy_template(template: str, host: str) -> str:
    """Serve's HAProxy config template with its stats page and Prometheus frontend bound to `host`
    (Serve binds them to every interface) and its admin socket mode 600 (Serve's is 666: any local
    user could take replicas out). Raises when a line to fix is missing (another Ray), so that the
    server does not start open."""
    fixes = {"bind *:{{ config.stats_port }}": "bind " + host + ":{{ config.stats_port }}",
             "bind :{{ config.metrics_port }}": "bind " + host + ":{{ config.metrics_port }}",
             " mode 666 level admin": " mode 600 level admin"}
    for old, new in fixes.items():
        if old not in template:
            raise RuntimeError(f"Serve's HAProxy template has no {old!r}: cannot make it {new!r}")
        template = template.replace(old, new)
    return template


def grpc_address(host: str, address: str) -> str:
    """`address` (Serve's `[::]:<port>`) with `host` in place of the wildcard."""
    port = address.rpartition(":")[2]
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind_grpc_to_host() -> list[Any]:
    """Serve's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`), run in the proxy
    before it starts its gRPC server: bind that server to `$CBSERVE_GRPC_HOST` instead of every
    interface. Returns no HTTP middleware."""
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return []
    from ray.serve._private import default_impl

    serve_add = getattr(default_impl.add_grpc_address, "__wrapped__", default_impl.add_grpc_address)

    def add_grpc_address(server: Any, address: str) -> None:
        serve_add(server, grpc_address(host, address))

    add_grpc_address.__wrapped__ = serve_add  # type: ignore[attr-defined]
    default_impl.add_grpc_address = add_grpc_address
    logger.info("Serve's gRPC proxy binds to %s (not every interface)", host)
    return []


def serve_request_id() -> str | None:
    """The id Serve gave the request being served (its `x-request-id`, in Serve's access log)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception as exc:  # noqa: BLE001 - outside a request, or another Ray
        logger.debug("no Serve request context: %r", exc)
        return None


def backpressure(exc: BaseException) -> BackPressureError | None:
    """The BackPressureError behind `exc` (raised by a handle call, or wrapped by Ray), if any."""
    for e in (exc, getattr(exc, "cause", None), exc.__cause__):
        if isinstance(e, BackPressureError):
            return e
    return None


class CompatRouter(RequestRouter):
    """A `RequestRouter` base with the private parts a custom router needs."""

    async def queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Outstanding requests per replica: Serve's cached lengths, else a probe (replicas that do
        not answer in time are left out)."""
        lens: dict[ReplicaID, int] = {}
        missing: list[RunningReplica] = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                missing.append(r)
            else:
                lens[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give `replica` to the very request it was chosen for.

        Serve's base router matches by internal request id, which every handle call made while
        serving one parent request inherits: the ingress's `n` choices (or batched prompts) share
        it, so all but one would wait forever. Match the request's own metadata object instead.
        """
        if request_metadata is not None:
            pending: PendingRequest
            for pending in self._pending_requests_to_fulfill:
                if pending.metadata is request_metadata and not pending.future.done():
                    self._cancel_routing_task_for_pending_request(pending)
                    self._record_queue_wait_time(pending)
                    pending.future.set_result(replica)
                    self._remove_pending_request_from_indices(pending)
                    return
        super()._fulfill_next_pending_request(replica, request_metadata)
