"""The default model: GGUF -> cached safetensors, tokenizer, and a greedy answer that makes sense."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from cbserve.kernels import cpu_isa
from cbserve.models import CACHE_ENV, DEFAULT_MODEL_NAME, SOURCE_FILE, load_model

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cbserve_cache")


@pytest.fixture(scope="module")
def loaded(cache_dir: Path) -> tuple[object, object, float, float]:
    """Load twice into an empty cache: the first load dequantizes the GGUF, the second reads the cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache_dir))
        start = time.perf_counter()
        load_model()
        first = time.perf_counter() - start
        start = time.perf_counter()
        model, tokenizer = load_model(DEFAULT_MODEL_NAME)
        second = time.perf_counter() - start
    return model, tokenizer, first, second


def test_cache_is_built_once_and_is_faster(loaded, cache_dir: Path) -> None:
    _, _, first, second = loaded
    folder = cache_dir / DEFAULT_MODEL_NAME
    assert folder.is_dir()
    assert (folder / SOURCE_FILE).is_file()
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")], "temp dir left behind"
    assert second < first / 3, f"cached load {second:.1f}s is not much faster than the first {first:.1f}s"


def test_model_and_tokenizer(loaded) -> None:
    model, tokenizer, _, _ = loaded
    assert not model.training
    assert model.dtype == cpu_isa.auto_dtype()  # dtype="auto": bfloat16 on CPUs with native bfloat16
    assert getattr(model.config, "quantization_config", None) is None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.chat_template is not None


def test_greedy_answer(loaded) -> None:
    model, tokenizer, _, _ = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=20, do_sample=False
        )
    answer = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_dtype_is_applied(cache_dir: Path, loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(cache_dir))
    model, _ = load_model(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training


def test_missing_hub_id_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="local files"):
        load_model("no-such-org/no-such-model-cbserve")
