"""Multi-LoRA serving (issue 33): requests of several PEFT adapters and of the base model share
steps, and every request's greedy tokens and log-probabilities equal `model.generate()` of PEFT's
merged model for its adapter (`merge_and_unload`), float64, across chunked prefill, preemption,
prefix-cache hits and slot evictions; adapters PEFT can express that the engine does not serve are
refused naming the field, as are bad configs and unknown adapters.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError
from cbserve.workers.factory import build_engine
from tests.support.exactness import assert_matches_reference, run_engine
from tests.support.lora_adapters import (
    ADAPTERS,
    MAX_NEW,
    NAMES,
    adapter_dir,
    base_model,
    merged_model,
    reference,
)
from tests.support.tiny_models import random_prompts

pytest.importorskip("peft")

def lora_config(**fields) -> cbserve.ContinuousBatchingConfig:
    return cbserve.ContinuousBatchingConfig(**{"page_size": 4, "max_batch_tokens": 32, "return_logprobs": True,
                                               "enable_lora": True, "max_loras": 4, "num_blocks": 256, **fields})


def run(arch: str, prompts: list[list[int]], names: list[str | None], cfg, waves: int = 1, max_new: int = MAX_NEW):
    """The engine on `prompts`, request i with adapter `names[i]` (loaded by name first); `waves`:
    the requests are submitted in that many groups, each after the previous one finished."""
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    folders = {name: adapter_dir(arch, name) for name in ADAPTERS}  # made from the model before an engine takes it
    engine = build_engine(base_model(arch), gc, cfg)
    requests = []
    try:
        for name in ADAPTERS:
            engine.load_lora(name, folders[name])
        per_wave = -(-len(prompts) // waves)
        for start in range(0, len(prompts), per_wave):
            for i in range(start, min(start + per_wave, len(prompts))):
                requests.append(engine.make_request(prompts[i], f"req_{i}", lora=names[i]))
                engine.add_request(requests[-1])
            while engine.has_work:
                engine.step()
    finally:
        engine.release_model()
    return requests, engine


def check(arch: str, requests, prompts, names, max_new: int = MAX_NEW) -> None:
    refs = [reference(arch, name, tuple(p), max_new) for p, name in zip(prompts, names)]
    assert_matches_reference(requests, refs)


@pytest.mark.parametrize("kernel", ["auto", "torch"])  # the C++ kernel where it builds; the masked GEMMs
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_adapters_equal_peft_merged_models(arch: str, kernel: str, monkeypatch) -> None:
    """4 adapters and the base model in the same steps: chunked prefill (32-token budget), then
    decode steps on the fast path, each row with its own adapter."""
    from cbserve.kernels import lora

    monkeypatch.setenv(lora.KERNEL_ENV, kernel)
    prompts = random_prompts([3, 40, 17, 9, 60, 25, 1, 33, 12, 50], seed=3)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    requests, engine = run(arch, prompts, names, lora_config())
    check(arch, requests, prompts, names)
    assert engine.stats()["lora_slot_loads"] == 4 and engine.stats()["lora_evictions"] == 0
    # The adapters change the outputs: a run of the base model alone would not pass.
    assert len({tuple(reference(arch, n, tuple(prompts[1]))[0]) for n in NAMES}) == len(NAMES)


@pytest.mark.parametrize("offload", [0.0, 0.01])
def test_preemption_with_adapters(offload: float) -> None:
    """Preempted requests are recomputed (or, with a host pool, restored) with their adapter."""
    prompts = random_prompts([30, 45, 20, 38, 27, 41, 33, 24], seed=4)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    cfg = lora_config(num_blocks=24, allow_block_sharing=False, cpu_offload_space=offload)
    requests, engine = run("llama", prompts, names, cfg)
    check("llama", requests, prompts, names)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.stats()["restores"] > 0) == bool(offload)


def test_prefix_cache_pages_are_never_shared_across_adapters() -> None:
    """The same prompt for the base model and each adapter, then again: each run of an adapter
    finds its own pages the second time, and never another adapter's."""
    prompt = random_prompts([41], seed=5)[0]
    prompts, names = [prompt] * (2 * len(NAMES)), NAMES + NAMES
    requests, engine = run("llama", prompts, names, lora_config(), waves=2)
    check("llama", requests, prompts, names)
    pages = 40 // 4  # full pages of the prompt; the last token is always computed
    assert engine.scheduler.prefix_hit_tokens == len(NAMES) * pages * 4  # the second wave's, each its own


def test_slots_evict_the_least_recently_used_adapter(monkeypatch) -> None:
    """4 adapters through 2 slots, twice: the scheduler runs at most 2 adapters at once, and
    evicted ones come back from host memory, exact."""
    from cbserve.workers.lora_slots import LoraSlots

    per_step = []
    make_resident = LoraSlots._make_resident
    monkeypatch.setattr(LoraSlots, "_make_resident", lambda self, used: per_step.append(len(used)) or
                        make_resident(self, used))
    prompts = random_prompts([5, 30, 12, 22, 8, 16, 27, 10, 19, 6], seed=6)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    requests, engine = run("llama", prompts, names, lora_config(max_loras=2), waves=2)
    check("llama", requests, prompts, names)
    stats = engine.stats()
    assert max(per_step) == 2 and stats["lora_resident"] == 2
    assert stats["lora_evictions"] > 2 and stats["lora_slot_loads"] == 2 + stats["lora_evictions"] > 4


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_packed_float32_projections_carry_the_delta(kernel: str, monkeypatch) -> None:
    """float32 on a CPU: the lean forward's fused q/k/v and gate/up GEMMs and the other projections
    run packed, each wrapped once, and the deltas are still added (compared with the merged model's
    logits, at float32 precision), by the C++ kernel and by the masked GEMMs."""
    from cbserve.kernels import cpu_kernels, llama_forward, lora

    if kernel == "auto" and cpu_kernels.unavailable_reason():
        pytest.skip(f"the C++ kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    monkeypatch.setenv(lora.KERNEL_ENV, kernel)
    model = copy.deepcopy(base_model("llama")).float()
    engine = build_engine(model, GenerationConfig(max_new_tokens=1, do_sample=False),
                          lora_config(max_batch_tokens=64, prepack_weights=None))
    try:
        engine.load_lora("all", adapter_dir("llama", "all"))
        attn = model.model.layers[0].self_attn
        for wrapped in (getattr(attn, llama_forward.QKV), attn.o_proj, getattr(model.model.layers[0].mlp,
                                                                                llama_forward.GATE_UP)):
            assert type(wrapped).__name__ == "LoraLinear" and type(wrapped.base).__name__ == "PackedLinear"
            assert wrapped.kernel == ("cpp" if kernel == "auto" else "torch")
        assert type(attn.q_proj) is torch.nn.Linear  # transformers' forward outside the engine: untouched
        prompt = random_prompts([20], seed=8)[0]
        request = engine.make_request(prompt, "r", max_new_tokens=1, lora="all")
        engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # given back
    merged = merged_model("llama", "all")
    logits = merged(torch.tensor([prompt])).logits[0, -1].double()
    assert request.generated == [int(logits.argmax())]
    assert request.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-4)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_adapters_over_quantized_projections(kernel: str, monkeypatch) -> None:
    """A model on Q8_0 blocks with fused quantized q/k/v and gate/up (what quantization='auto' makes
    of a GGUF file): the adapters' deltas are added in float32 over the quantized projections, so
    each request equals PEFT's merged model over the dequantized weights (float32 precision)."""
    from cbserve.kernels import cpu_kernels, llama_forward, lora, quantized
    from tests.kernels.test_quantized import _quantized_tiny_llama
    from tests.support.tiny_models import reference_generate

    if cpu_kernels.unavailable_reason():
        pytest.skip(f"the quantized kernels are C++: {cpu_kernels.unavailable_reason()}")
    import peft

    monkeypatch.setenv(lora.KERNEL_ENV, kernel)
    model, dense = _quantized_tiny_llama("q8_0")
    assert quantized.fuse_projections(model) == 2 * model.config.num_hidden_layers
    prompts = random_prompts([3, 40, 17, 9, 25], seed=9)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    setup = lambda engine: [engine.load_lora(n, adapter_dir("llama", n)) for n in ADAPTERS]
    requests, _ = run_engine(model, prompts, lora_config(), max_new=8, setup=setup,
                             per_request=[{"lora": n} for n in names])
    assert isinstance(getattr(model.model.layers[0].self_attn, llama_forward.QKV), quantized.QuantizedLinear)
    refs = []
    for prompt, name in zip(prompts, names):
        merged = dense if name is None else peft.PeftModel.from_pretrained(
            copy.deepcopy(dense), adapter_dir("llama", name)).merge_and_unload()
        refs.append(reference_generate(merged, prompt, 8))
    assert_matches_reference(requests, refs, tol=1e-4)


def test_broken_delta_is_caught(monkeypatch) -> None:
    """The comparison can fail: without the delta, adapter rows get the base model's outputs."""
    from cbserve.kernels import lora

    monkeypatch.setattr(lora.LoraLinear, "forward", lambda self, x: self.base(x))
    prompts = random_prompts([12, 20], seed=9)
    requests, _ = run("llama", prompts, ["all", "mlp"], lora_config())
    with pytest.raises(AssertionError):
        check("llama", requests, prompts, ["all", "mlp"])


def test_prefix_hash_without_the_adapter_is_caught(monkeypatch) -> None:
    """The comparison can fail: with the adapter left out of the hash chain, an adapter's request
    reuses the base model's pages and its output is wrong."""
    from cbserve.scheduler import block_manager

    monkeypatch.setattr(block_manager, "chain_root", lambda request: block_manager.salt_root(request.cache_salt))
    prompt = random_prompts([41], seed=5)[0]
    requests, _ = run("llama", [prompt, prompt], [None, "all"], lora_config(), waves=2)
    with pytest.raises(AssertionError):
        check("llama", requests, [prompt, prompt], [None, "all"])


# -- the Python API --------------------------------------------------------------------------------


def test_manager_loads_lists_and_unloads_adapters() -> None:
    prompts = random_prompts([14, 9], seed=10)
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    with cbserve.continuous_batching(base_model("llama"), gc, lora_config()) as manager:
        manager.load_lora("attn", adapter_dir("llama", "attn"))
        assert manager.list_loras() == {"attn": adapter_dir("llama", "attn")}
        with pytest.raises(InvalidRequestError, match="already loaded") as error:
            manager.load_lora("attn", adapter_dir("llama", "attn"))
        assert error.value.field == "lora_name"
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'") as error:
            manager.add_request(prompts[0], lora="nope")
        assert error.value.field == "lora"
        rid = manager.add_request(prompts[0], lora="attn")
        by_path = manager.add_request(prompts[1], lora=adapter_dir("llama", "mlp"))  # a folder, loaded on first use
        with pytest.raises(InvalidRequestError, match="used by"):
            manager.unload_lora("attn")  # while its request is unfinished (queued or running)
        out, out_path = manager.get_result(rid, timeout=60), manager.get_result(by_path, timeout=60)
        manager.unload_lora("attn")
        assert list(manager.list_loras()) == [adapter_dir("llama", "mlp")]
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'attn'"):
            manager.add_request(prompts[0], lora="attn")
    assert out.generated_tokens == reference("llama", "attn", tuple(prompts[0]))[0]
    assert out_path.generated_tokens == reference("llama", "mlp", tuple(prompts[1]))[0]


def test_generate_batch_takes_one_adapter_per_prompt() -> None:
    prompts = random_prompts([7, 15, 11], seed=11)
    names = [None, "ko", "all"]
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    outs = cbserve.generate_batch(base_model("llama"), prompts, gc, lora_config(), progress_bar=False,
                                  lora=[None if n is None else adapter_dir("llama", n) for n in names])
    for out, prompt, name in zip(outs.values(), prompts, names):
        assert out.generated_tokens == reference("llama", name, tuple(prompt))[0]
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        cbserve.generate_batch(base_model("llama"), prompts, gc, lora_config(), lora=["a"])


def test_lora_needs_enable_lora() -> None:
    engine = build_engine(base_model("llama"), None, cbserve.ContinuousBatchingConfig(page_size=4))
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora=True") as error:
            engine.make_request([5, 6], "r", lora="all")
        assert error.value.field == "lora"
    finally:
        engine.release_model()


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"max_loras": 0}, "max_loras"),
    ({"max_loras": 65}, "max_loras"),
    ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"max_lora_rank": 513}, "max_lora_rank"),
    ({"default_compile_level": 1}, "torch.compile"),
    ({"batch_invariant": True}, "batch_invariant"),
    ({"node_kv_pool": "pool", "cpu_offload_space": 1.0}, "node_kv_pool"),
])
def test_config_refusals_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cbserve.ContinuousBatchingConfig(enable_lora=True, **fields)


def _edited_adapter(tmp_path: Path, arch: str = "llama", name: str = "all", **config_fields) -> str:
    """A copy of an adapter folder with fields of its adapter_config.json changed."""
    source = Path(adapter_dir(arch, name))
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    config = json.loads((source / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **config_fields}))
    return str(folder)


@pytest.mark.parametrize("fields, message", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"r": 3}, r"needs lora_A \[3, \d+\] and lora_B \[\d+, 3\] \(r=3\), got \[4, "),
    ({"target_modules": ["q_proj"]}, "target_modules"),
])
def test_unsupported_adapters_are_refused_naming_the_field(tmp_path: Path, fields: dict, message: str) -> None:
    engine = build_engine(base_model("llama"), None, lora_config())
    try:
        with pytest.raises(InvalidRequestError, match=message) as error:
            engine.load_lora("x", _edited_adapter(tmp_path, **fields))
        assert error.value.field == "lora_path"
    finally:
        engine.release_model()


def test_rank_above_max_lora_rank_is_refused() -> None:
    engine = build_engine(base_model("llama"), None, lora_config(max_lora_rank=8))
    try:
        with pytest.raises(InvalidRequestError, match=r"r=16 must be an integer in \[1, max_lora_rank=8\]"):
            engine.load_lora("ko", adapter_dir("llama", "ko"))
        assert engine.list_loras() == {}
    finally:
        engine.release_model()


def test_speculative_rows_carry_their_adapter() -> None:
    """n-gram speculation: a request's proposed rows run with its adapter too (verified exact)."""
    prompts = []
    for seed in (4, 7):  # prompts that repeat themselves: the proposer finds n-grams in them
        for n in (5, 12):
            seg = random_prompts([n], seed=seed)[0]
            prompts.append(seg + seg[: n // 2] + seg)
    names = ["all", "attn", None, "mlp"]
    requests, engine = run("llama", prompts, names, lora_config(speculative={"method": "ngram"}), max_new=32)
    check("llama", requests, prompts, names, max_new=32)
    assert engine.scheduler.num_accepted_tokens > 0
