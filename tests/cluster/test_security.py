"""Security: the API key guards every route but `/health` (`/metrics` too, with
`metrics_require_api_key`), unknown routes and gRPC included, and a refusal tells an
unauthenticated client nothing; no code in the serving, cluster or batch packages evaluates or unpickles data; a chat
message is data, never template code. One local Ray and one Serve app (key set) for the module.
"""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import serve_app, tiny_model_dir

API_KEY = "s3cret-key-for-tests"
MODEL = "tiny"
PACKAGE = Path(__file__).resolve().parents[2] / "cbserve"
# Where client bytes arrive (HTTP, gRPC, batch lines) and go (engine replicas).
CLIENT_PACKAGES = [PACKAGE / "serving", PACKAGE / "cluster", PACKAGE / "batch"]

COMPLETION = json.dumps({"model": MODEL, "prompt": "the sea", "max_tokens": 2, "temperature": 0}).encode()
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
EMBEDDING = json.dumps({"model": MODEL, "input": "the sea"}).encode()

# (method, path, body, status with the right key)
ROUTES = [
    ("POST", "/v1/completions", COMPLETION, 200),
    ("POST", "/v1/chat/completions", CHAT, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/version", None, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/v1/nothing-here", None, 404),
    ("POST", "/v1/embeddings", EMBEDDING, 200),
    ("GET", "/openapi.json", None, 404),  # no schema published, even with the key
    ("GET", "/docs", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("DELETE", "/v1/models", None, 405),
    ("PUT", "/health/../v1/models", None, 404),
]


# ---- unit level (no Ray) ------------------------------------------------------------------------


def test_settings_for_metrics_key_and_overload() -> None:
    from pydantic import ValidationError

    from cbserve.cluster.app import worker_options
    from cbserve.cluster.settings import ClusterArgs

    args = ClusterArgs()
    assert args.metrics_require_api_key is False  # Prometheus scrapes without a key unless asked
    assert ClusterArgs(metrics_require_api_key=True).metrics_require_api_key
    opts = worker_options(ClusterArgs(worker={"max_queued_requests": 7, "overload_status_code": 429,
                                              "retry_after_s": 3}))
    assert opts["max_queued_requests"] == 7
    assert opts["backpressure_config"].status_code == 429 and opts["backpressure_config"].retry_after_s == 3
    assert worker_options(ClusterArgs(worker={"max_queued_requests": -1}))["max_queued_requests"] == -1
    for bad in ({"max_queued_requests": 0}, {"max_queued_requests": -2}, {"overload_status_code": 500},
                {"retry_after_s": -1}, {"retry_after_s": float("nan")}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ClusterArgs(worker=bad)


# Calls that turn bytes into code or arbitrary objects. Ray moves Python objects between our own
# actors (trusted); client bytes must only ever go through json, pydantic or protobuf.
_DANGEROUS = re.compile(
    r"\b(pickle|cPickle|dill|marshal|shelve|cloudpickle|jsonpickle)\b|(?<![\w.])(eval|exec|compile)\("
    r"|builtins\.(eval|exec)|yaml\.(load|unsafe_load)\(|__import__\(|shell\s*=\s*True|os\.system\("
    r"|subprocess\.|torch\.load\("
)


def test_no_code_evaluates_or_unpickles_data() -> None:
    hits = []
    paths = sorted(p for package in CLIENT_PACKAGES for p in package.rglob("*.py"))
    assert len(paths) > 20
    for path in paths:
        if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
            continue  # generated protobuf stubs
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _DANGEROUS.search(code):
                hits.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not hits, "review these for client data reaching them:\n" + "\n".join(hits)


def test_audit_pattern_catches_what_it_should() -> None:
    """The audit above can fail: its pattern matches the calls it is meant to catch."""
    for line in ("data = pickle.loads(body)", "eval(expr)", "yaml.load(text)", "exec(code)",
                 "subprocess.run(cmd, shell=True)", "x = torch.load(f)"):
        assert _DANGEROUS.search(line), line
    for line in ("json.loads(body)", "yaml.safe_load(text)", "evaluate(x)", "model.eval()"):
        assert not _DANGEROUS.search(line), line


def test_api_key_compare_is_constant_time() -> None:
    """`_authorized` compares with hmac.compare_digest (timing does not reveal matched bytes), and
    accepts only the exact key under the Bearer scheme."""
    import inspect

    from cbserve.cluster import ingress

    source = inspect.getsource(ingress)
    body = source[source.index("def _authorized"):source.index("def _check_auth")]
    assert "hmac.compare_digest" in body and "==" not in body


# ---- the real app ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = tiny_model_dir(tmp_path_factory)
    args = {"model": str(model_dir), "served_model_name": MODEL, "api_key": API_KEY,
            "metrics_require_api_key": True,
            "engine": {"page_size": 8, "num_blocks": 128, "max_batch_tokens": 256},
            "generation": {"max_tokens": 4}, "limits": {"max_tokens": 16}}
    with serve_app(args) as (_serve, http_port, grpc_port):
        yield {"http": http_port, "grpc": grpc_port, "model_dir": model_dir}


def _raw(cluster: dict[str, Any], method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster["http"], timeout=120)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


BAD_CREDENTIALS = [
    None,
    "Bearer wrong-key",
    "Bearer ",
    f"Bearer {API_KEY}x",
    f"Bearer {API_KEY[:-1]}",
    f"Basic {API_KEY}",
    API_KEY,
    f"Bearer{API_KEY}",
    f"Bearer {API_KEY.upper()}",
]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "body", "status"), ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_every_route_needs_the_key(cluster: dict[str, Any], method: str, path: str, body: bytes | None,
                                   status: int) -> None:
    for credential in BAD_CREDENTIALS:
        headers = {"Authorization": credential} if credential is not None else {}
        got, resp_headers, raw = _raw(cluster, method, path, body, headers)
        assert got == 401, (credential, raw)
        assert resp_headers.get("www-authenticate") == "Bearer"
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        # Nothing about the server or the route: not the model, not the path, not the key tried.
        for secret in (MODEL, path.strip("/").split("/")[-1], "wrong-key", API_KEY):
            assert secret.lower() not in raw.decode().lower(), (secret, raw)
    for scheme in ("Bearer", "bearer", "BEARER"):
        got, _, raw = _raw(cluster, method, path, body, {"Authorization": f"{scheme} {API_KEY}"})
        assert got == status, raw
        if status >= 400:
            assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.ray
@pytest.mark.slow
def test_health_is_open_and_says_nothing_more(cluster: dict[str, Any]) -> None:
    status, _, raw = _raw(cluster, "GET", "/health")
    assert status == 200 and json.loads(raw) == {"status": "ok"}
    status, _, raw = _raw(cluster, "GET", "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and b"vllm:num_requests_running" in raw  # behind the key, and working


@pytest.mark.ray
@pytest.mark.slow
def test_grpc_needs_the_key_and_leaks_nothing(cluster: dict[str, Any]) -> None:
    import grpc

    from cbserve.serving.protos import generate_pb2, generate_pb2_grpc

    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster['grpc']}"))
    request = generate_pb2.GenerateRequest(model="not-the-model", prompt="the sea",
                                           sampling=generate_pb2.SamplingParams(max_tokens=2))
    for credential in BAD_CREDENTIALS:
        metadata = [("application", "cbserve")] + ([("authorization", credential)] if credential else [])
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=metadata, timeout=60))
        # UNAUTHENTICATED before anything else: not NOT_FOUND for the wrong model name.
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (credential, info.value)
        assert MODEL not in (info.value.details() or "")
    good = [("application", "cbserve"), ("authorization", f"Bearer {API_KEY}")]
    request.model = MODEL
    replies = list(stub.Generate(request, metadata=good, timeout=60))
    assert replies[-1].finish_reason in ("stop", "length")


@pytest.mark.ray
@pytest.mark.slow
def test_chat_content_is_data_not_template_code(cluster: dict[str, Any]) -> None:
    """Jinja in a message is rendered as text by the chat template (transformers' sandboxed
    environment), never evaluated: the prompt is exactly the literal text's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cluster["model_dir"]))
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for content in ("{{ 7 * 7 }}", "{% for i in range(3) %}x{% endfor %}", "{{ ''.__class__.__mro__ }}"):
        messages = [{"role": "user", "content": content}]
        literal = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}).encode()
        status, _, raw = _raw(cluster, "POST", "/v1/chat/completions", body, auth)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] == len(tokenizer(literal).input_ids), content
