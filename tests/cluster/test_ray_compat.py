"""`cbserve/cluster/ray_compat.py` is the only module using Ray Serve's private API, and every
private member it uses exists in the installed Ray (`pyproject.toml` pins the Ray versions this
passed on). No Ray cluster is started."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from cbserve.cluster import ray_compat

PACKAGE = Path(__file__).resolve().parents[2] / "cbserve"


def _router() -> Any:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve.request_router import RequestRouter

    class Probe(RequestRouter):
        async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list:
            return [candidate_replicas]

    return Probe(deployment_id=DeploymentID(name="LLMWorker", app_name="app"),
                 handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)


@pytest.mark.parametrize(("owner", "name"), ray_compat.PRIVATE_MEMBERS, ids=lambda x: str(x))
def test_every_private_member_exists_in_the_installed_ray(owner: str, name: str) -> None:
    if owner == "RequestRouter":  # instance attributes too: look on a constructed router
        assert hasattr(_router(), name), f"RequestRouter has no {name}"
        return
    obj: Any = importlib.import_module(owner)
    for part in name.split("."):
        obj = getattr(obj, part)
    assert obj is not None


@pytest.mark.parametrize("path", [ray_compat.DEFAULT_ROUTER_CLASS, ray_compat.RAY_LLM_PREFIX_ROUTER_CLASS])
def test_router_classes_resolve(path: str) -> None:
    module, name = path.split(":")
    from ray.serve.request_router import RequestRouter

    assert issubclass(getattr(importlib.import_module(module), name), RequestRouter)


def test_backpressure_error_is_found_and_read_through_its_public_api() -> None:
    from ray.serve.exceptions import BackPressureError

    err = BackPressureError(num_queued_requests=3, max_queued_requests=2, status_code=429, retry_after_s=2.5)
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = err
    assert ray_compat.backpressure(err) is err and ray_compat.backpressure(wrapped) is err
    assert ray_compat.backpressure(RuntimeError("other")) is None
    assert (err.status_code, err.retry_after_s) == (429, 2.5)


def test_no_other_module_uses_rays_private_api() -> None:
    private_names = {name.split(".")[-1] for owner, name in ray_compat.PRIVATE_MEMBERS if owner == "RequestRouter"}
    pattern = re.compile(r"ray\.serve\._private|ray\.llm\._internal|get_http_config|\b(" + "|".join(map(re.escape, private_names)) + r")\b"
                         r"|\._status_code\b|\._retry_after_s\b")
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "ray_compat.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                hits.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not hits, "Ray's private API outside ray_compat.py:\n" + "\n".join(hits)


def test_a_local_ray_whose_gcs_never_reported_its_port_is_started_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' `start_local_ray`: one more `ray.init` after Ray's "Timed out waiting for file"
    (a GCS server that never started), never after any other error, and not a third time."""
    import ray

    from tests.support.cluster import start_local_ray

    calls: list[dict[str, Any]] = []
    errors = [RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y"), None]
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append({"shutdown": True}))

    def init(**kwargs: Any) -> None:
        calls.append(kwargs)
        error = errors.pop(0)
        if error is not None:
            raise error

    monkeypatch.setattr(ray, "init", init)
    start_local_ray(num_cpus=2)
    assert calls == [{"address": "local", "num_cpus": 2}, {"shutdown": True}, {"address": "local", "num_cpus": 2}]

    errors[:] = [RuntimeError("Timed out waiting for file a"), RuntimeError("Timed out waiting for file b")]
    with pytest.raises(RuntimeError, match="file b"):
        start_local_ray()
    errors[:] = [RuntimeError("another failure")]
    with pytest.raises(RuntimeError, match="another failure"):
        start_local_ray()
