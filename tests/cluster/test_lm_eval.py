"""lm-evaluation-harness against the served default model (issue 17): its `local-completions`
model runs a loglikelihood task (echo + logprobs, token-id prompts in batches) and a
generate_until task on small JSONL tasks kept in `tests/data/lm_eval/` (no download), and the
loglikelihoods equal lm-eval's own `hf` model on the same weights (float32) within 1e-3.

The loglikelihood run reads the tokenizer from the model's local folder (`tokenizer_backend:
huggingface`); the generate_until run finds the server's `/tokenizer_info` and `/tokenize` and
uses them (lm-eval's remote tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import serve_app

pytestmark = [pytest.mark.default_model, pytest.mark.ray, pytest.mark.slow]
lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parents[1] / "data" / "lm_eval"
SERVED = "SmolLM2-135M-Instruct"
CAPITALS = """task: cbserve_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/capitals.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
ARITHMETIC = """task: cbserve_arithmetic
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/arithmetic.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    (folder / "capitals.yaml").write_text(CAPITALS.format(data=DATA))
    (folder / "arithmetic.yaml").write_text(ARITHMETIC.format(data=DATA))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def server() -> Any:
    import cbserve

    cbserve.load_model()  # builds the default model's local folder (the hf baseline reads it too)
    args = {"model": None, "engine": {"page_size": 16, "num_blocks": 256, "max_batch_tokens": 512},
            "generation": {"max_tokens": 16}}
    with serve_app(args) as (_, http_port, _grpc):
        yield f"http://127.0.0.1:{http_port}/v1/completions"


def _samples(result: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


def _evaluate(tasks: Any, task: str, model: Any, model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                                   log_samples=True)


def test_loglikelihoods_equal_lm_evals_hf_model(server: str, tasks: Any) -> None:
    import cbserve

    folder = str(cbserve.models.checkpoint_folder())
    served = _evaluate(tasks, "cbserve_capitals", "local-completions", {
        "model": SERVED, "base_url": server, "tokenizer_backend": "huggingface", "tokenizer": folder,
        "batch_size": 4, "num_concurrent": 2, "max_retries": 1})
    local = _evaluate(tasks, "cbserve_capitals", "hf", {"pretrained": folder, "dtype": "float32", "device": "cpu"})
    pairs = [(a, b) for s, h in zip(_samples(served, "cbserve_capitals"), _samples(local, "cbserve_capitals"))
             for a, b in zip(s["filtered_resps"], h["filtered_resps"])]
    assert len(pairs) == 24
    worst = max(abs(a[0] - b[0]) for a, b in pairs)
    print(f"largest loglikelihood difference from lm-eval's hf model: {worst:.2e} over {len(pairs)} requests")
    assert worst < 1e-3, f"largest loglikelihood difference {worst}"
    assert [a[1] for a, _ in pairs] == [b[1] for _, b in pairs]  # is_greedy, from the top logprobs
    assert served["results"]["cbserve_capitals"]["acc,none"] == local["results"]["cbserve_capitals"]["acc,none"]


def test_generate_until_with_the_servers_tokenizer(server: str, tasks: Any) -> None:
    from lm_eval.api.registry import get_model

    import cbserve

    lm = get_model("local-completions")(model=SERVED, base_url=server, tokenizer_backend="auto", num_concurrent=2,
                                        max_retries=1)
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    served = _evaluate(tasks, "cbserve_arithmetic", lm)
    local = _evaluate(tasks, "cbserve_arithmetic", "hf", {
        "pretrained": str(cbserve.models.checkpoint_folder()), "dtype": "float32", "device": "cpu"})
    texts = [s["filtered_resps"][0] for s in _samples(served, "cbserve_arithmetic")]
    assert len(texts) == 4 and all(isinstance(t, str) and "\n" not in t for t in texts)
    same = sum(t == s["filtered_resps"][0] for t, s in zip(texts, _samples(local, "cbserve_arithmetic")))
    assert same >= 3, (texts, [s["filtered_resps"][0] for s in _samples(local, "cbserve_arithmetic")])
