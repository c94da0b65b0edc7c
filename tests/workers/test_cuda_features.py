"""The engine's features on a CUDA device, against `generate()` on the same device: chunked prefill,
preemption and prefix hits over the paged Triton kernels, LoRA adapters through the masked GEMMs
(against peft's merged models), n-gram and draft-model speculation, seeded sampling, embeddings.

Skipped without a GPU (bench/gpu_check.sh runs them on one). float32 models: the Triton kernels'
dot products are IEEE float32 and cuBLAS's are too (TF32 stays off), so tokens must be equal and
log-probabilities close."""

from __future__ import annotations

import copy

import pytest
import torch

import cbserve
from cbserve.scheduler.request import SamplingParams
from tests.support.exactness import assert_matches_reference, run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (bench/gpu_check.sh runs it)")
MAX_NEW = 8
TOL = 1e-3


def cuda_model(arch: str = "qwen3", seed: int = 0):
    return tiny_model(arch, dtype=torch.float32, seed=seed).cuda()


def config(**fields) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 64, "max_batch_tokens": 64,
                                               "return_logprobs": True, **fields})


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_chunked_prefill_preemption_and_prefix_hits(arch: str) -> None:
    model = cuda_model(arch)
    shared = random_prompts([48], seed=7)[0]
    prompts = random_prompts([1, 9, 40, 70, 130]) + [shared + p for p in random_prompts([3, 20], seed=8)]
    # 14 pages of 16 for 7 requests of up to 138 tokens: preemption; 64-token steps: chunked prefill.
    requests, engine = run_engine(model, prompts, config(num_blocks=14), MAX_NEW)
    assert_matches_reference(requests, [reference_generate(model, p, MAX_NEW) for p in prompts], tol=TOL)
    graphs = engine.runner.graphs  # the defaults on CUDA: graphs of both kinds (varlen only with sliding windows)
    assert graphs is not None and graphs.max_varlen_tokens > 0 and bool(graphs.decode_width) == (arch != "gemma2")
    assert engine.async_batching


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_lora_adapters_equal_peft_merged_models(kernel: str, monkeypatch) -> None:
    import peft

    monkeypatch.setenv("CBSERVE_LORA_KERNEL", kernel)
    base = tiny_model("llama", dtype=torch.float32)
    folders, merged = {}, {None: base.cuda()}
    for i, (name, targets) in enumerate({"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"], "attn": ["q_proj", "v_proj"]}.items()):
        lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4 * (i + 1), lora_alpha=8,
                                                                         target_modules=targets))
        torch.manual_seed(i + 1)
        with torch.no_grad():
            for param_name, param in lora.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0, 0.3)
        folders[name] = f"/tmp/cbserve-cuda-lora-{name}"
        lora.save_pretrained(folders[name])
        merged[name] = copy.deepcopy(lora).merge_and_unload().cuda()
    prompts = random_prompts([3, 17, 40, 9, 25, 60])
    names = [None, "all", "attn", "all", None, "attn"]
    refs = [reference_generate(merged[n], p, MAX_NEW) for p, n in zip(prompts, names)]

    def load(engine) -> None:
        for name, folder in folders.items():
            engine.load_lora(name, folder)

    requests, _ = run_engine(base, prompts, config(enable_lora=True, max_loras=2, max_lora_rank=8), MAX_NEW, load,
                             per_request=[{"lora": n} for n in names])
    assert_matches_reference(requests, refs, tol=TOL)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_equals_generate(method: str, tmp_path) -> None:
    model = cuda_model("llama")
    unit = random_prompts([6], seed=2)[0]
    prompts = [unit * 5, random_prompts([17], seed=3)[0], unit * 3 + random_prompts([4], seed=4)[0]]
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    if method == "draft_model":
        model.save_pretrained(tmp_path / "draft")  # the target as its own draft: every proposal right
        spec["model"] = str(tmp_path / "draft")
    else:
        spec["prompt_lookup_max"] = 4
    requests, engine = run_engine(model, prompts, config(speculative=spec), 16)
    assert_matches_reference(requests, [reference_generate(model, p, 16) for p in prompts], tol=TOL)
    assert engine.scheduler.num_accepted_tokens > 0
    assert not engine.async_batching  # proposals are verified on the host each step


def test_seeded_sampling_is_reproducible_across_batches() -> None:
    """A seeded request draws the same tokens alone and beside others (its own generator)."""
    model = cuda_model("qwen3")
    prompts = random_prompts([5, 30, 12])

    def sample(batch: list[list[int]]) -> list[list[int]]:
        sampling = [{"sampling": SamplingParams(do_sample=True, temperature=0.9, top_p=0.9, seed=1234 + i)}
                    for i in range(len(batch))]
        requests, _ = run_engine(model, batch, config(), MAX_NEW, per_request=sampling)
        return [r.generated for r in requests]

    together = sample(prompts)
    assert together[0] == sample(prompts[:1])[0]
    assert together == sample(prompts)


def test_embeddings_equal_the_last_hidden_state() -> None:
    model = cuda_model("qwen3")
    prompts = random_prompts([4, 33, 70])
    requests, _ = run_engine(model, prompts, config(max_batch_tokens=32), 1,
                             per_request=[{"pooling": "mean"}] * len(prompts))
    with torch.no_grad():
        for request, prompt in zip(requests, prompts):
            hidden = model.base_model(torch.tensor([prompt], device="cuda")).last_hidden_state[0].mean(0)
            got = torch.tensor(request.pooling.embedding, dtype=torch.float32)
            torch.testing.assert_close(got, torch.nn.functional.normalize(hidden, dim=0).cpu(), rtol=0, atol=1e-4)
