"""Multi-LoRA serving on Ray (issue 33): two worker replicas behind their own ingress, an adapter
declared in `lora_modules`, others loaded and unloaded at run time through vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`; requests naming an adapter return the
Python API's tokens with that adapter, go to the replicas that hold it (loads stay below 5% of
requests once warm), and show on /metrics per adapter."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import running_manager, serve_app, tiny_model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("peft")

API_KEY = "lora-key"
MODEL = "tiny"
ENGINE = {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 256, "enable_lora": True, "max_loras": 2,
          "max_lora_rank": 8}
PROMPTS = [[5, 9, 14, 3, 7, 22, 30, 11], [40, 2, 8, 19, 25, 6], [12, 13, 31, 4, 17, 9, 2]]


def _adapter(model_dir: Path, folder: Path, seed: int) -> str:
    """A random rank-4 PEFT adapter of the tiny model, saved to `folder`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    peft_model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = tiny_model_dir(tmp_path_factory)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {name: _adapter(model_dir, root / name, seed) for seed, name in enumerate(["declared", "hot", "cold"])}
    args = {
        "model": str(model_dir), "served_model_name": MODEL, "engine": ENGINE, "api_key": API_KEY,
        "generation": {"max_tokens": 8}, "lora_modules": {"declared": adapters["declared"]},
        "lora_runtime_updates": True, "max_cpu_loras": 2, "ingress_placement": "own",
        "routing": {"stats_period_s": 0.5},
        "worker": {"num_replicas": 2, "num_cpus": 1.0},
    }
    with serve_app(args) as (serve, http_port, _):
        yield {"http": http_port, "adapters": adapters, "model_dir": model_dir, "serve": serve}


@pytest.fixture(scope="module")
def reference(served: dict[str, Any]) -> dict[str | None, list[list[str]]]:
    """Greedy tokens (each token's text) of every prompt through the Python API, per adapter
    (None: the base model)."""
    import cbserve

    model, tokenizer = cbserve.load_model(str(served["model_dir"]), dtype="float32")
    out: dict[str | None, list[list[str]]] = {}
    with running_manager(model, **ENGINE) as mgr:
        for name, folder in served["adapters"].items():
            mgr.load_lora(name, folder)
        for lora in [None, *served["adapters"]]:
            rids = [mgr.add_request(p, max_new_tokens=8, temperature=0.0, lora=lora) for p in PROMPTS]
            ids = [[o for o in mgr.request_id_iter(rid)][-1].generated_tokens for rid in rids]
            out[lora] = [[tokenizer.decode([t]) for t in seq] for seq in ids]
    return out


def _post(served: dict[str, Any], path: str, body: dict[str, Any], key: str | None = API_KEY
          ) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", served["http"], timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST" if body is not None else "GET", path, body=json.dumps(body) if body is not None else None,
                     headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _complete(served: dict[str, Any], model: str, prompt: list[int]) -> tuple[int, Any]:
    status, text = _post(served, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0.0, "logprobs": 1})
    return status, json.loads(text)


def _tokens(served: dict[str, Any], model: str) -> list[list[str]]:
    outs = []
    for prompt in PROMPTS:
        status, body = _complete(served, model, prompt)
        assert status == 200, body
        assert body["model"] == model
        outs.append(body["choices"][0]["logprobs"]["tokens"])
    return outs


def _metric(served: dict[str, Any], name: str) -> dict[str, float]:
    """Samples of one metric from /metrics: labels' `lora_name` (or "") -> value summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = _post(served, "/metrics", None)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (name, f"{name}_total"):
                lora = s.labels.get("lora_name", "")
                found[lora] = found.get(lora, 0.0) + s.value
    return found


def test_adapters_load_and_unload_at_run_time(served: dict[str, Any], reference: dict[Any, Any]) -> None:
    adapters = served["adapters"]
    load = {"lora_name": "hot", "lora_path": adapters["hot"]}
    assert _post(served, "/v1/load_lora_adapter", load, key=None)[0] == 401
    assert _post(served, "/v1/load_lora_adapter", load) == (200, "Success: LoRA adapter 'hot' added successfully.")
    status, text = _post(served, "/v1/load_lora_adapter", load)
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_name" and "already" in text
    status, text = _post(served, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent/folder"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    for bad in ({"lora_name": "two words", "lora_path": adapters["hot"]}, {"lora_name": MODEL, "lora_path": "/x"},
                {"lora_name": "x", "lora_path": "/x", "lora_int_id": 3}):
        status, text = _post(served, "/v1/load_lora_adapter", bad)
        assert status == 400 and json.loads(text)["error"]["param"] in ("lora_name", "lora_int_id"), text
    _, text = _post(served, "/v1/models", None)
    cards = {c["id"]: c for c in json.loads(text)["data"]}
    assert set(cards) == {MODEL, "declared", "hot"}
    assert cards["hot"]["parent"] == MODEL and cards["hot"]["root"] == adapters["hot"]

    # Each adapter's tokens are the Python API's with it, and differ from the base model's.
    assert _tokens(served, "hot") == reference["hot"] != reference[None]
    assert _tokens(served, "declared") == reference["declared"] != reference[None]
    assert _tokens(served, MODEL) == reference[None]

    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "hot"}) == (
        200, "Success: LoRA adapter 'hot' removed successfully.")
    status, body = _complete(served, "hot", PROMPTS[0])
    assert status == 404 and body["error"]["param"] == "model"
    status, text = _post(served, "/v1/unload_lora_adapter", {"lora_name": "hot"})
    assert status == 404 and json.loads(text)["error"]["param"] == "lora_name"


def test_adapter_requests_stay_where_their_adapter_is(served: dict[str, Any], reference: dict[Any, Any]) -> None:
    adapters = served["adapters"]
    for name in ("hot", "cold"):
        status, text = _post(served, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name],
                                                               "load_inplace": True})
        assert status == 200, text
    names = ["declared", "hot", "cold"]
    rng = random.Random(5)

    def run(count: int) -> None:
        jobs = [(rng.choice(names), rng.randrange(len(PROMPTS))) for _ in range(count)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda job: (job, _complete(served, job[0], PROMPTS[job[1]])), jobs))
        for (name, p), (status, body) in results:
            assert status == 200, body
            assert body["choices"][0]["logprobs"]["tokens"] == reference[name][p]

    def loads() -> float:
        time.sleep(1.5)  # the replicas' stats reach the board every stats period
        return sum(v for k, v in _metric(served, "cbserve:lora_adapter_loads").items() if k)

    run(12)  # warm: each adapter on a replica or two
    before = loads()
    run(60)
    assert loads() - before < 0.05 * 60
    requests = _metric(served, "cbserve:lora_requests")
    assert all(requests.get(name, 0) > 0 for name in names)
    assert sum(_metric(served, "cbserve:lora_generation_tokens").values()) > 0
