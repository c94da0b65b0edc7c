"""`/v1/embeddings` (issue 31) on the in-process service over the tiny model: every `input` shape,
both encodings, the deployment's pooling, usage, and what is refused, naming the field. The
vectors are transformers' last hidden state pooled and normalized (float32 here; the float64
exactness is tests/workers/test_embeddings.py)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import pytest
import torch

from cbserve.cluster.settings import ClusterArgs
from cbserve.serving.api_errors import APIError
from cbserve.serving.front.embeddings import EmbeddingRequest
from cbserve.serving.front.json_body import parse_request
from cbserve.serving.front.openai_service import OpenAIService
from tests.serving import test_openai_parity as parity

model_dir, loaded, manager, info, service = parity.model_dir, parity.loaded, parity.manager, parity.info, parity.service


def embed(service: OpenAIService, **body: Any) -> dict[str, Any]:
    req = parse_request(json.dumps({"model": "tiny", **body}).encode(), EmbeddingRequest)
    return asyncio.run(service.embeddings(req)).body.model_dump()


def reference(loaded: tuple[Any, Any], ids: list[int], method: str) -> np.ndarray:
    model = loaded[0]
    with torch.no_grad():
        hidden = model.base_model(torch.tensor([ids])).last_hidden_state[0].double()
    pooled = hidden.mean(0) if method == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


def test_every_input_shape_gives_the_pooled_hidden_state(service: OpenAIService, loaded: tuple[Any, Any]) -> None:
    tok = loaded[1]
    texts = ["the sea is calm tonight", "one two three four five six seven eight nine ten " * 8]
    ids = [tok(t).input_ids for t in texts]
    for body, expected in ((texts[0], ids[:1]), (texts, ids), (ids[1], ids[1:]), (ids, ids)):
        out = embed(service, input=body)
        assert out["object"] == "list" and out["model"] == "tiny"
        assert [d["index"] for d in out["data"]] == list(range(len(expected)))
        assert out["usage"] == {"prompt_tokens": sum(map(len, expected)), "total_tokens": sum(map(len, expected))}
        for d, prompt in zip(out["data"], expected):
            assert d["object"] == "embedding"
            np.testing.assert_allclose(d["embedding"], reference(loaded, prompt, "mean"), atol=2e-5)
            assert np.linalg.norm(d["embedding"]) == pytest.approx(1.0)


def test_base64_is_the_float32_vector(service: OpenAIService) -> None:
    floats = embed(service, input=["hello there", "general kenobi"])["data"]
    packed = embed(service, input=["hello there", "general kenobi"], encoding_format="base64")["data"]
    for f, b in zip(floats, packed):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype="<f4"))


def test_the_deployments_pooling(service: OpenAIService, loaded: tuple[Any, Any], model_dir: Any) -> None:
    args = ClusterArgs(model=str(model_dir), served_model_name="tiny", embeddings={"pooling": "last"})
    last = OpenAIService(args, service._open_choice)
    ids = loaded[1]("the last token speaks for all").input_ids
    got = embed(last, input=ids)["data"][0]["embedding"]
    np.testing.assert_allclose(got, reference(loaded, ids, "last"), atol=2e-5)
    with pytest.raises(ValueError, match="pooling"):
        ClusterArgs(embeddings={"pooling": "max"})


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": [3] * (parity.CONTEXT + 1)}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": [[5, 6]] * 65}, "input"),  # limits.max_prompts
])
def test_refusals_name_the_field(service: OpenAIService, body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        embed(service, **body)
    assert err.value.status == 400 and err.value.param == param, err.value.body()
    with pytest.raises(APIError) as err:
        embed(service, input="x", model="other")
    assert err.value.status == 404
