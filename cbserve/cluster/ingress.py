"""The ingress deployment: the OpenAI HTTP API (FastAPI) and the gRPC `Generate` call.

HTTP: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/embeddings`,
`GET /v1/models`, `GET /health`, vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`
(with `lora_runtime_updates`),
`GET /metrics`, `GET /version`, and vLLM's `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`. Every
refusal is a JSON error in OpenAI's shape. gRPC: `Generate` of
`cbserve/serving/protos/generate.proto`, reached through Serve's gRPC proxy, which calls the
method of the same name here. The protocol itself (bodies, choices, replies) is in
`cbserve.serving`; this module adds Ray: the handle to the engine replicas and its failures.

With API keys (`api_key`, `api_keys`), every route but `/health` needs one (`/metrics` too when
`metrics_require_api_key`), unknown routes included: without a key a client learns nothing
but 401. Each key is a tenant of the engines' fair share (its digest on every choice it sends).
Client bytes are only ever parsed as JSON (then pydantic) or protobuf, never unpickled or
evaluated.
"""

import asyncio
import hmac
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cbserve.cluster.adapters import AdapterCatalog
from cbserve.cluster.metrics_relay import MetricsRelay, this_replica
from cbserve.cluster.migration import MigratingChoice, cancel_quietly
from cbserve.cluster.ray_compat import backpressure, serve_http_host, serve_request_id
from cbserve.cluster.settings import ClusterArgs
from cbserve.errors import InvalidRequestError
from cbserve.serving import tokenization
from cbserve.serving.api_errors import APIError, internal_error, openai_error, refusal
from cbserve.serving.front import grpc_service
from cbserve.serving.front.embeddings import EmbeddingRequest
from cbserve.serving.front.json_body import parse_request
from cbserve.serving.front.metrics import ServingMetrics
from cbserve.serving.front.openai_service import OpenAIService, Reply
from cbserve.serving.front.replies import ChoiceStream
from cbserve.serving.front.responses import ResponsesRequest
from cbserve.serving.front.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
)
from cbserve.serving.front.worker_requests import bind_call_tenant, key_tenant, with_call_tenant
from cbserve.serving.protocol import WorkerRequest

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-cbserve-replica"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
# Headers that Serve's proxy reads from the client and acts on, before the ingress sees them:
# keep a request running after its client left, stretch or cut its timeout, pin a replica or a
# multiplexed model. Refused (400 naming the header); compared with `_` as `-`, as Serve does.
SERVE_CONTROL_HEADERS = ("x-request-disconnect-disabled", "x-request-timeout-seconds", "serve-multiplexed-model-id",
                         "x-session-id")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the answer

# No /docs, /redoc or /openapi.json: they would describe the API to anyone, key or not.
app = FastAPI(title="cbserve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail)).response()


def cbserve_version() -> str:
    """The installed package's version (`GET /version`, as vLLM answers it)."""
    try:
        return importlib.metadata.version("cbserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _declared_routes(router: Any) -> Iterator[Any]:
    """Every route under `router`: Serve re-mounts the class's routes on an included router, which
    FastAPI >= 0.137 keeps as one nested node (`original_router`) instead of flattening."""
    for route in getattr(router, "routes", ()):
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _declared_routes(inner)
        elif hasattr(route, "path_regex"):
            yield route


def _open_error(exc: BaseException) -> APIError:
    """A failure to reach a worker, as the client should see it."""
    if isinstance(exc, APIError):
        return exc
    full = backpressure(exc)
    if full is not None:
        # Every engine replica has max_ongoing_requests and this ingress's queue for them is
        # full: refuse now rather than let requests pile up (memory, latency).
        return APIError(
            full.status_code,
            "The server is overloaded (all workers busy and the queue full); retry after a short wait.",
            code="overloaded", retry_after_s=full.retry_after_s,
        )
    logger.warning("worker call failed (request id %s): %r", serve_request_id(), exc)
    return APIError(503, "no worker could serve the request; retry it")


def check_control_headers(headers: Any) -> None:
    """Refuse the Serve headers a client must not set (`SERVE_CONTROL_HEADERS`)."""
    for key in headers:
        name = key.lower().replace("_", "-")
        if name in SERVE_CONTROL_HEADERS:
            raise APIError(400, f"header {key}: not accepted by this server (Serve's proxy would let it change how "
                           "the request is run); send the request without it", param=key)


@serve.ingress(app)
class OpenAIIngress:
    """Serve ingress (made a deployment in `app.py`)."""

    # API key -> its tenant (empty: no key needed, also for a handler built without __init__).
    _api_keys: Mapping[str, str] = MappingProxyType({})
    # The LoRA adapters clients may name (none for a handler built without __init__).
    adapters: AdapterCatalog = AdapterCatalog({})

    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle | None, args: ClusterArgs):
        self.args = args
        self._replicas = replicas  # the engine replicas' deployment
        self._model_len: int | None = None  # max_model_len, from a replica (`_max_model_len`)
        self._generate = replicas.options(stream=True, method_name="generate")
        self._board = board
        # Each key is a tenant of the engine's fair share, known by its digest only.
        self._api_keys = {key: key_tenant(key) for key in self.args.resolved_api_keys()}
        self.metrics = ServingMetrics(self.args.model_name)
        self._relay = MetricsRelay(self.metrics, board, this_replica(), self.args.routing.stats_period_s)
        self._relay.start()  # every ingress replica's series on /metrics, whichever answers
        self.adapters = AdapterCatalog(self.args.lora_modules, board, self.args.routing.stats_period_s)
        self.adapters.start()
        self.service = OpenAIService(self.args, self._open_choice, self.metrics, self.adapters)
        if not self._api_keys:
            self._warn_if_exposed()

    def _warn_if_exposed(self) -> None:
        host = serve_http_host()
        if host not in LOOPBACK_HOSTS:
            logger.warning(
                "No API key is set (args.api_key or $CBSERVE_API_KEY) and HTTP (and gRPC) is bound to %r: "
                "anyone who can reach it can use the model.", host
            )

    # -- plumbing -------------------------------------------------------------------------------

    async def _open_choice(self, wreq: WorkerRequest) -> ChoiceStream:
        wreq = with_call_tenant(wreq)  # the API key's tenant, never the client's `user`
        lora = wreq.sampling.lora
        if lora is not None:  # its folder, for a replica that does not hold it yet
            wreq = wreq.model_copy(update={"lora_path": self.adapters.get(lora)})
        first, gen = await self._open_on_a_replica(wreq)
        if first.kind == "error":
            raise refusal(first, self.args.worker.overload_status_code, self.args.worker.retry_after_s)
        if self.args.migration.max_attempts == 0 or not wreq.migrate:
            return ChoiceStream(start=first, events=gen, cancel=gen.cancel, lora=lora)
        choice = MigratingChoice(wreq, first, gen, self._open_on_a_replica, self.args.migration.max_attempts,
                                 self.metrics.on_migration)
        return ChoiceStream(start=first, events=choice.events(), cancel=choice.cancel, lora=lora)

    async def _open_on_a_replica(self, wreq: WorkerRequest) -> tuple[Any, Any]:
        """A worker replica's first event for `wreq` and the generator of the rest; raises the
        APIError a client should get when none can be reached."""
        try:
            # .remote() itself raises BackPressureError when the queue for the workers is full.
            gen = self._generate.remote(wreq)
        except Exception as exc:
            raise _open_error(exc) from exc
        try:
            return await gen.__anext__(), gen
        except asyncio.CancelledError:
            cancel_quietly(gen)
            raise
        except StopAsyncIteration:
            raise APIError(500, "the worker closed the stream before accepting the request") from None
        except Exception as exc:
            cancel_quietly(gen)
            raise _open_error(exc) from exc

    def _authorized(self, presented: str | None) -> bool:
        """The `Authorization` value holds one of the keys (or none is needed); the call's tenant
        is then that key's."""
        if not self._api_keys:
            bind_call_tenant(None)
            return True
        scheme, _, token = (presented or "").partition(" ")
        # Constant time, and every key compared: neither how much of a key matched nor which
        # key did is revealed.
        found = None
        for key, tenant in self._api_keys.items():
            if hmac.compare_digest(token.strip().encode(), key.encode()):
                found = tenant
        if scheme.lower() != "bearer":
            found = None
        bind_call_tenant(found)
        return found is not None

    def _check_auth(self, request: Request) -> None:
        if not self._authorized(request.headers.get("authorization")):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.args.limits.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"request body is larger than the limit of {limit} bytes", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        return bytes(body)

    def _error(self, exc: APIError) -> JSONResponse:
        if exc.code == "internal_error":  # the log line of the failure and the client share the id
            request_id = serve_request_id()
            logger.error("internal error answered (request id %s)", request_id)
            exc = internal_error(request_id)
        self.metrics.http_errors.labels(self.metrics.model_name, str(exc.status)).inc()
        return exc.response()

    def _client_left(self, request: Request) -> Response:
        """The client closed the connection while its body was being read: one quiet line."""
        logger.info("%s %s: client disconnected while sending the body (%d)", request.method, request.url.path,
                    CLIENT_CLOSED)
        self.metrics.http_errors.labels(self.metrics.model_name, str(CLIENT_CLOSED)).inc()
        return Response(status_code=CLIENT_CLOSED)

    def _unexpected(self, request: Request) -> JSONResponse:
        """A failure of ours: the traceback to the log, a request id to the client."""
        request_id = serve_request_id()
        logger.exception("unexpected error serving %s (request id %s)", request.url.path, request_id)
        return self._error(internal_error(request_id))

    async def _answer(self, request: Request, respond: Any) -> Any:
        """`await respond()` for an authorized request without Serve's control headers; a refusal
        or failure as the client should see it."""
        try:
            self._check_auth(request)
            check_control_headers(request.headers)
            return await respond()
        except APIError as exc:
            return self._error(exc)
        except ClientDisconnect:
            return self._client_left(request)
        except Exception:  # noqa: BLE001 - answered with a request id, logged with the traceback
            return self._unexpected(request)

    async def _serve(self, request: Request, schema: type, run: Any) -> Response:
        arrival = time.perf_counter()

        async def respond() -> Reply:
            req = parse_request(await self._read_body(request), schema)
            await self.adapters.knows(getattr(req, "model", None))
            # Serve's proxy echoes X-Request-Id (its own id when the client sent none).
            return await run(req, arrival, request.headers.get("x-request-id"))

        reply = await self._answer(request, respond)
        if isinstance(reply, Response):
            return reply
        headers = {REPLICA_HEADER: ",".join(reply.replicas)}
        if reply.stream is not None:
            headers["Cache-Control"] = "no-cache"
            return StreamingResponse(reply.stream, media_type="text/event-stream", headers=headers)
        body = reply.body if isinstance(reply.body, dict) else reply.body.model_dump()
        return JSONResponse(body, headers=headers)

    # -- HTTP routes ----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self.service.complete)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, self.service.chat)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._serve(request, ResponsesRequest, self.service.responses)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, EmbeddingRequest, self.service.embeddings)

    async def _on_replica(self, request: Request, call: Any) -> Response:
        """A tokenizer route: `call(body)` parses the body and returns a replica call's result."""
        try:
            self._check_auth(request)
            check_control_headers(request.headers)
            result = await call(await self._read_body(request) if request.method == "POST" else b"")
        except APIError as exc:
            return self._error(exc)
        except InvalidRequestError as exc:
            return self._error(openai_error(exc, "prompt"))
        except ClientDisconnect:
            return self._client_left(request)
        except Exception as exc:  # noqa: BLE001 - no replica answered
            return self._error(_open_error(exc))
        if "error" in result and isinstance(result["error"], dict):
            return self._error(openai_error(InvalidRequestError(**result["error"]), "prompt"))
        return JSONResponse(result)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        async def call(body: bytes) -> Any:
            req = tokenization.parse_tokenize(body)
            self.service.check_model(req.model)
            return await self._replicas.tokenize.remote(tokenization.tokenize_work(req))
        return await self._on_replica(request, call)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        async def call(body: bytes) -> Any:
            req = parse_request(body, tokenization.DetokenizeRequest)
            self.service.check_model(req.model)
            return await self._replicas.detokenize.remote(req.tokens)
        return await self._on_replica(request, call)

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> Response:
        return await self._on_replica(request, lambda _: self._replicas.tokenizer_info.remote())

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except APIError as exc:
            return self._error(exc)
        max_len = await self._max_model_len()
        card = ModelCard(id=self.args.model_name, root=self.args.model or self.args.model_name, max_model_len=max_len)
        adapters = [ModelCard(id=name, root=path, parent=self.args.model_name, max_model_len=max_len)
                    for name, path in sorted(self.adapters.items())]
        return JSONResponse(ModelList(data=[card, *adapters]).model_dump())

    async def _max_model_len(self) -> int | None:
        """The longest prompt + output, as a replica reports it (asked once; None while none answers)."""
        if self._model_len is None:
            try:
                info = await asyncio.wait_for(self._replicas.tokenizer_info.remote(), timeout=10)
                self._model_len = int(info["model_max_length"])
            except Exception as exc:  # noqa: BLE001 - the card is still valid without it
                logger.warning("/v1/models without max_model_len: no replica answered (%r)", exc)
        return self._model_len

    async def _adapter_update(self, request: Request, schema: type, update: Any) -> Response:
        """`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's bodies and plain-text answers."""

        async def respond() -> Response:
            if not self.args.lora_runtime_updates:
                raise APIError(404, f"{request.url.path}: loading and unloading LoRA adapters at run time is off "
                               "(the app's args: lora_runtime_updates: true)", code="not_found")
            return Response(await update(parse_request(await self._read_body(request), schema)),
                            media_type="text/plain")

        return await self._answer(request, respond)

    async def _load_adapter(self, req: LoadLoraAdapterRequest) -> str:
        name = req.lora_name
        if name in (self.args.model_name, self.args.model):
            raise APIError(400, f"lora_name: {name!r} is the base model's name; give the adapter another",
                           "lora_name")
        await self.adapters.knows(name)
        if name in self.adapters and not req.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        # A replica reads the folder now (a bad one is refused here); the replicas the router
        # sends its requests to load it with the first one.
        try:
            checked = await self._replicas.check_adapter.remote(req.lora_path)
        except Exception as exc:  # no replica answered
            raise _open_error(exc) from exc
        if "error" in checked:
            raise openai_error(InvalidRequestError(**checked["error"]), "lora_path")
        await self.adapters.add(name, req.lora_path, req.load_inplace)
        logger.info("LoRA adapter %s added from %s", name, req.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _unload_adapter(self, req: UnloadLoraAdapterRequest) -> str:
        await self.adapters.knows(req.lora_name)
        await self.adapters.remove(req.lora_name)  # replicas let go of it at their next stats report
        logger.info("LoRA adapter %s removed", req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return await self._adapter_update(request, LoadLoraAdapterRequest, self._load_adapter)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._adapter_update(request, UnloadLoraAdapterRequest, self._unload_adapter)

    @app.get("/version")
    async def version(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except APIError as exc:
            return self._error(exc)
        return JSONResponse({"version": cbserve_version()})

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self._replicas.ping.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            if backpressure(exc) is not None:
                # Saturated, not broken: a failing health check would take the server out of a
                # load balancer exactly when it is busiest.
                return JSONResponse({"status": "ok", "overloaded": True})
            logger.warning("health check: no worker replica answers: %r", exc)
            return APIError(503, "no worker replica answers").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        if self.args.metrics_require_api_key:
            try:
                self._check_auth(request)
            except APIError as exc:
                return self._error(exc)
        return Response(await self._relay.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # Last route: anything no route above matched. Without the key a client gets 401 whatever the
    # path, so it cannot probe which routes exist; with it, 404 (or 405 for a known path).
    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def unknown_route(self, request: Request, path: str) -> Response:
        try:
            self._check_auth(request)
            # `path` is relative to the app's route prefix, as the routes' own patterns are.
            known = any(
                r.path_regex.match(f"/{path}") and request.method not in (r.methods or ())
                for r in _declared_routes(request.app) if getattr(r, "path", None) != "/{path:path}"
            )
            if known:
                raise APIError(405, f"Method {request.method} is not allowed on /{path}.")
            raise APIError(404, f"Unknown route /{path}.", code="unknown_url")
        except APIError as exc:
            return self._error(exc)

    # -- gRPC -----------------------------------------------------------------------------------

    async def Generate(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        arrival = time.perf_counter()
        stream = await self._open_grpc(request, grpc_context)
        timer = self.metrics.timer(arrival, stream.start.prompt_tokens)
        async for message in grpc_service.replies(stream, timer, grpc_context):
            yield message

    async def _open_grpc(self, request: Any, grpc_context: Any) -> ChoiceStream:
        """The accepted choice of a `GenerateRequest`; a refusal ends the call with its status."""
        metadata = dict(grpc_context.invocation_metadata() or [])
        wreq = None
        try:
            if not self._authorized(metadata.get("authorization")):
                raise APIError(401, "Incorrect or missing API key: send metadata `authorization: Bearer <key>`.")
            await self.adapters.knows(getattr(request, "model", None) or None)
            wreq = grpc_service.to_worker_request(request, self.service)
            return await self._open_choice(wreq)
        except (APIError, InvalidRequestError) as exc:
            grpc_service.abort_with(grpc_context, exc, wreq)
        except Exception:  # Serve would send the exception's text as the details
            request_id = serve_request_id()
            logger.exception("unexpected error serving gRPC Generate (request id %s)", request_id)
            grpc_service.abort_with(grpc_context, internal_error(request_id), wreq)
