"""Block-quantized weights (kernels/quantized.py, csrc/quant_linear_cpu.cpp): the C++ kernel and
dequantizer on every path this CPU has against the plain-torch reference of GGUF's Q8_0, Q4_0 and
Q4_1, the layers in a model against transformers on the dequantized weights, and the default
model's GGUF run on its own blocks."""

from __future__ import annotations

import copy

import pytest
import torch

import cbserve
from cbserve.kernels import cpu_isa, cpu_kernels, quantized
from cbserve.kernels.quantized import QuantizedEmbedding, QuantizedLinear, dequantize, quantize
from tests.support.exactness import run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

FORMATS = ("q8_0", "q4_0", "q4_1")
PATHS = ("generic", "avx2", "avx512")

pytestmark = pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason=cpu_kernels.unavailable_reason()
                                or "kernels available")


def _path(isa: str) -> str:
    """`isa`, or a skip saying why this CPU cannot run it."""
    if isa != "generic" and not torch.ops.cbserve_cpu.quant_isa_available(isa):
        pytest.skip(f"this CPU has no {isa} ({cpu_isa.why_not(isa) if isa in cpu_isa.ISAS else ''})")
    return isa


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_rounds_within_half_a_step(fmt: str) -> None:
    w = torch.randn(64, 128) * 3
    w[0, :32] = 0.0  # a block of zeros: d = 0 must not divide by zero
    back = dequantize(quantize(w, fmt), fmt, 128)
    blocks = w.reshape(64, 4, 32)
    span = blocks.abs().amax(-1) if fmt != "q4_1" else blocks.amax(-1) - blocks.amin(-1)
    step = span / {"q8_0": 127, "q4_0": 8, "q4_1": 15}[fmt]
    err = (back - w).abs().reshape(64, 4, 32).amax(-1)
    # Half a step (q4_0: a whole one at the end opposite its largest value, which its 16 levels
    # -8..7 reach only to -7/8 of), plus float16's rounding of d and m.
    allowed = step * (1.0 if fmt == "q4_0" else 0.5) + 1e-3 * span + 1e-6
    assert torch.all(err <= allowed)
    assert torch.all(back[0, :32] == 0)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_blocks_equals_the_reference(fmt: str, isa: str) -> None:
    blocks = quantize(torch.randn(48, 96), fmt)
    out = torch.ops.cbserve_cpu.dequantize_blocks(blocks, fmt, 96, _path(isa))
    assert torch.equal(out, dequantize(blocks, fmt, 96))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_the_reference_and_is_batch_invariant(fmt: str, isa: str) -> None:
    isa = _path(isa)
    torch.manual_seed(0)
    n, k = 42, 160  # 42: decode rows go 4 weight rows at a time, then a ragged tail
    blocks, bias = quantize(torch.randn(n, k), fmt), torch.randn(n)
    dense = dequantize(blocks, fmt, k).double()
    x = torch.randn(19, k)
    y = torch.ops.cbserve_cpu.quant_linear(x, blocks, fmt, bias, isa)
    expected = x.double() @ dense.T + bias.double()
    assert (y.double() - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
    for rows in (1, 2, 5, 8, 11):  # a row's result does not depend on the rows around it
        assert torch.equal(torch.ops.cbserve_cpu.quant_linear(x[:rows], blocks, fmt, bias, isa), y[:rows])
    no_bias = torch.ops.cbserve_cpu.quant_linear(x[:3], blocks, fmt, None, isa)
    assert torch.allclose(no_bias + bias, y[:3], atol=1e-5)
    for rows in (1, 19):  # bfloat16 in and out: the float32 call on the widened input, rounded once
        xb = x[:rows].bfloat16()
        want = torch.ops.cbserve_cpu.quant_linear(xb.float(), blocks, fmt, bias, isa).bfloat16()
        assert torch.equal(torch.ops.cbserve_cpu.quant_linear(xb, blocks, fmt, bias, isa), want)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_op_matches_the_reference(fmt: str, isa: str) -> None:
    """Calls of many rows: tiles of output features dequantized and multiplied by GEMMs (here K = 2048
    makes 64-row tiles: 3 tiles, the last one ragged), in float32 and bfloat16, under no_grad and
    under inference mode (the tasks' threads write an inference tensor)."""
    isa = _path(isa)
    torch.manual_seed(1)
    n, k = 150, 2048
    blocks, bias = quantize(torch.randn(n, k) / 8, fmt), torch.randn(n)
    dense = dequantize(blocks, fmt, k)
    x = torch.randn(2, 13, k)
    expected = x.double() @ dense.double().T + bias.double()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = torch.ops.cbserve_cpu.quant_linear_tiled(x, blocks, fmt, bias, isa)
            assert y.shape == (2, 13, n) and y.dtype == torch.float32
            assert (y.double() - expected).abs().max().item() < 1e-4
            y16 = torch.ops.cbserve_cpu.quant_linear_tiled(x.bfloat16(), blocks, fmt, None, isa)
            want16 = torch.nn.functional.linear(x.bfloat16(), dense.bfloat16())
            assert y16.dtype == torch.bfloat16 and torch.allclose(y16.float(), want16.float(), rtol=2e-2, atol=5e-2)


def test_kernel_refuses_what_it_cannot_run() -> None:
    blocks = quantize(torch.randn(8, 64), "q8_0")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.cbserve_cpu.quant_linear(torch.randn(2, 48), blocks, "q8_0", None, "generic")
    with pytest.raises(RuntimeError, match="unknown format"):
        torch.ops.cbserve_cpu.quant_linear(torch.randn(2, 64), blocks, "q5_k", None, "generic")
    with pytest.raises(ValueError, match="uint8"):
        QuantizedLinear(blocks[:, :10], "q8_0", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_every_row_count_in_the_input_dtype(dtype: torch.dtype) -> None:
    linear = torch.nn.Linear(96, 24)
    layer = QuantizedLinear.from_linear(linear, "q4_1")
    dense = dequantize(layer.blocks, "q4_1", 96)
    for rows in (1, quantized.GEMV_ROWS, quantized.GEMV_ROWS + 1, 40):  # the kernel, then the tiled GEMMs
        x = torch.randn(2, rows, 96).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (2, rows, 24)
        expected = torch.nn.functional.linear(x.float(), dense, linear.bias.detach())
        assert torch.allclose(y.float(), expected, atol=5e-2 if dtype == torch.bfloat16 else 1e-5)
    invariant = QuantizedLinear(layer.blocks, "q4_1", 96, linear.bias, batch_invariant=True)
    x = torch.randn(40, 96)
    assert torch.equal(invariant(x)[:1], invariant(x[:1]))  # the kernel for every row count


def test_embedding_rows_are_the_dequantized_rows() -> None:
    table = torch.randn(50, 64)
    blocks = quantize(table, "q8_0")
    embedding = QuantizedEmbedding(blocks, "q8_0", 64, torch.bfloat16)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(embedding(ids), dequantize(blocks, "q8_0", 64)[ids].bfloat16())


def _quantized_tiny_llama(fmt: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a tiny Llama whose linear layers run on `fmt` blocks, the same model with those blocks
    dequantized into dense weights: the reference)."""
    model = tiny_model("llama", torch.float32)
    reference = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            layer = QuantizedLinear.from_linear(module, fmt)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
            with torch.no_grad():
                reference.get_submodule(name).weight.copy_(dequantize(layer.blocks, fmt, layer.in_features))
    return model, reference


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_on_quantized_layers_matches_transformers_on_their_values(fmt: str) -> None:
    model, reference = _quantized_tiny_llama(fmt)
    prompts = random_prompts([5, 17, 40, 9])
    refs = [reference_generate(reference, p, 10) for p in prompts]
    requests, _ = run_engine(model, prompts, cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=64,
                                                                             return_logprobs=True), max_new=10)
    for request, (tokens, logprobs) in zip(requests, refs):
        assert request.generated == tokens
        assert request.logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases, left unfused
def test_quantization_int8_runs_a_dense_model_on_q8_0_blocks(arch: str) -> None:
    """`quantization='int8'`: every linear layer quantized at load; the engine equals transformers
    on the same weights quantized and dequantized by the reference."""
    model = tiny_model(arch, torch.float32)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(dequantize(quantize(module.weight, "q8_0"), "q8_0", module.in_features))
    prompts = random_prompts([5, 17, 40, 9], seed=2)
    refs = [reference_generate(reference, p, 10) for p in prompts]
    config = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=64, return_logprobs=True, quantization="int8")
    requests, _ = run_engine(model, prompts, config, max_new=10)
    for request, (tokens, logprobs) in zip(requests, refs):
        assert request.generated == tokens
        assert request.logprobs == pytest.approx(logprobs, abs=1e-5)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert {m.fmt for m in model.modules() if isinstance(m, QuantizedLinear)} == {"q8_0"}


def test_a_quantized_model_is_not_quantized_otherwise_silently() -> None:
    """A second engine on the same model reuses its layers when it asks the same quantization, and
    refuses another one (those layers cannot be requantized), naming the field."""
    model = tiny_model("llama", torch.float32)
    config = cbserve.ContinuousBatchingConfig(num_blocks=8, quantization="int8")
    first, _ = run_engine(model, [[5, 6, 7]], config, max_new=3)
    again, _ = run_engine(model, [[5, 6, 7]], config, max_new=3)
    assert again[0].generated == first[0].generated
    with pytest.raises(ValueError, match="quantization='auto'.*earlier engine's quantization='int8'"):
        run_engine(model, [[5, 6, 7]], cbserve.ContinuousBatchingConfig(num_blocks=8, quantization="auto"))


def test_quantization_int8_shares_a_tied_heads_blocks() -> None:
    model = tiny_model("llama", torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[3, 9, 1]])
    want = dequantize(quantize(model.lm_head.weight, "q8_0"), "q8_0", model.config.hidden_size)[ids]
    assert quantized.quantize_dense(model) == 7 * model.config.num_hidden_layers + 1
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.model.embed_tokens.blocks is model.lm_head.blocks
    assert torch.equal(model.model.embed_tokens(ids), want)


def test_quantization_auto_needs_a_gguf_source() -> None:
    model = tiny_model("llama", torch.float32)
    with pytest.raises(ValueError, match="quantization='auto' needs a model loaded from a GGUF file"):
        run_engine(model, [[5, 6, 7]], cbserve.ContinuousBatchingConfig(quantization="auto", num_blocks=8))
    with pytest.raises(ValueError, match="quantization"):
        cbserve.ContinuousBatchingConfig(quantization="int4")


@pytest.fixture(scope="module")
def default_model_dense_and_auto() -> tuple[torch.nn.Module, torch.nn.Module]:
    try:
        from cbserve.models import default_gguf_path

        default_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    dense, _ = cbserve.load_model(dtype=torch.float32)
    auto, _ = cbserve.load_model(dtype=torch.float32)
    return dense, auto


def test_default_model_runs_on_its_own_gguf_blocks(default_model_dense_and_auto) -> None:
    from cbserve.models import default_gguf_path

    dense, auto = default_model_dense_and_auto
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 28, 30, 216, 33, 30]]
    gc_max = 12
    ref, _ = run_engine(dense, prompts, cbserve.ContinuousBatchingConfig(num_blocks=16, return_logprobs=True), gc_max)
    got, _ = run_engine(auto, prompts, cbserve.ContinuousBatchingConfig(num_blocks=16, return_logprobs=True,
                                                                        quantization="auto"), gc_max)
    # Every linear layer and the embedding run on the file's blocks (q/k rows un-permuted as
    # transformers does: without it those 60 layers would stay dense)...
    layers = [m for name, m in auto.named_modules() if isinstance(m, QuantizedLinear) and ".cb_" not in name]
    assert len(layers) == 7 * auto.config.num_hidden_layers + 1
    assert {m.fmt for m in layers} == {"q4_1", "q8_0"} and isinstance(auto.model.embed_tokens, QuantizedEmbedding)
    assert auto.lm_head.blocks is auto.model.embed_tokens.blocks  # tied: one copy
    # q/k/v and gate/up fused for the lean forward, the parts viewing the fused rows (no copy)
    layer = auto.model.layers[0]
    assert layer.self_attn.k_proj.blocks.untyped_storage().data_ptr() == \
        layer.self_attn.cb_qkv_proj.blocks.untyped_storage().data_ptr()
    assert layer.mlp.cb_gate_up_proj.out_features == 2 * auto.config.intermediate_size
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*auto.buffers(), *auto.parameters()]}
    held = sum(storages.values())
    assert held <= 1.25 * default_gguf_path().stat().st_size
    # ... whose values are the dense model's: the same tokens, log-probabilities within float32 noise.
    for r, g in zip(ref, got):
        assert g.generated == r.generated
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-3)
