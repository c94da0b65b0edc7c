"""The fused elementwise ops of the lean Llama forward (`csrc/layer_ops_cpu.cpp`) against
transformers' own modules, on every path this CPU runs (generic; avx2 and avx512 where it has them)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from cbserve.kernels import cpu_isa, cpu_kernels

PATHS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_isa.cpu_supports(isa), reason=f"no {isa} here"))
         for isa in ("generic", "avx2", "avx512")]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernels() -> None:
    if cpu_kernels.unavailable_reason():
        pytest.skip(cpu_kernels.unavailable_reason())


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: a few ulps (sums of squares and exp computed in another order); bfloat16: the same
    # roundings as transformers', at most one bfloat16 ulp where a float32 ulp tips the rounding.
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2**-7, 1e-3)
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_llama_rmsnorm(isa: str, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576)
    norm = norm.to(dtype)
    residual, x = torch.randn(1, rows, 576).to(dtype), torch.randn(1, rows, 576).to(dtype)
    summed = residual + x
    mine = residual.clone()
    out = cpu_kernels.add_rms_norm_(x, mine, norm.weight, 1e-5, isa)
    assert torch.equal(mine, summed)  # the residual stream, in place, rounded like transformers' add
    close(out, norm(summed), dtype)
    close(cpu_kernels.add_rms_norm_(None, residual.clone(), norm.weight, 1e-5, isa), norm(residual), dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_apply_rotary_pos_emb(isa: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t, heads, kv_heads, d = 11, 9, 3, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = (torch.arange(t) + 5).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def heads_of(x: torch.Tensor, first: int, n: int) -> torch.Tensor:
        return x[:, first * d : (first + n) * d].reshape(1, t, n, d).transpose(1, 2)

    q_ref, k_ref = apply_rotary_pos_emb(heads_of(qkv, 0, heads), heads_of(qkv, heads, kv_heads), cos[None], sin[None])
    mine = qkv.clone()
    cpu_kernels.rope_(mine, cos, sin, heads + kv_heads, d, isa)
    close(heads_of(mine, 0, heads), q_ref, dtype)
    close(heads_of(mine, heads, kv_heads), k_ref, dtype)
    assert torch.equal(mine[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])  # V untouched
    # A strided view (one projection of a fused output) is rotated in place too.
    fused = qkv.clone()
    cpu_kernels.rope_(fused[:, heads * d : (heads + kv_heads) * d], cos, sin, kv_heads, d, isa)
    close(heads_of(fused, heads, kv_heads), k_ref, dtype)
    assert torch.equal(fused[:, : heads * d], qkv[:, : heads * d])


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_matches_silu_times_up(isa: str, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(1, rows, 2 * 1536) * 6).to(dtype)  # wide enough to reach exp's clamped range
    gate_up[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])
    gate, up = gate_up.chunk(2, dim=-1)
    close(cpu_kernels.silu_mul(gate_up, isa), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.skipif(not cpu_isa.cpu_supports("avx512"), reason="no avx512 here: only one vector silu path to compare")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_avx512_intrinsics_give_the_vector_paths_bits(dtype: torch.dtype) -> None:
    # The avx512 row is written in intrinsics, the avx2 one in GCC vector types: the same arithmetic,
    # so the same bits (bfloat16: also the generic row's), tails of the row included.
    torch.manual_seed(1)
    gate_up = (torch.randn(9, 2 * 1541) * 6).to(dtype)
    gate_up[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -88.5, float("nan")])
    mine = cpu_kernels.silu_mul(gate_up, "avx512")
    assert torch.equal(mine.nan_to_num(7.0), cpu_kernels.silu_mul(gate_up, "avx2").nan_to_num(7.0))
    assert torch.isnan(mine[0, 4])
    if dtype == torch.bfloat16:
        assert torch.equal(mine.nan_to_num(7.0), cpu_kernels.silu_mul(gate_up, "generic").nan_to_num(7.0))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("vocab", [5, 49_152, 151_937])
def test_greedy_is_torchs_argmax_with_its_logprob(isa: str, vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab) * 8
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins
    logits[2] = -1e30  # every value equal
    logits[3, vocab // 2] = float("nan")  # NaN is the maximum, as for torch's argmax
    tokens, logprobs = cpu_kernels.greedy(logits, isa)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    alone, none = cpu_kernels.greedy(logits, isa, logprobs=False)  # the tokens without the exponentials
    assert torch.equal(alone, tokens) and none is None
    expected = logits.double().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.isnan(logprobs[3]) and torch.isnan(expected[3])
    keep = [0, 1, 2, 4, 5]
    torch.testing.assert_close(logprobs[keep].double(), expected[keep], rtol=0, atol=1e-6)


def test_the_ops_refuse_what_they_do_not_handle() -> None:
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="isa must be"):
        cpu_kernels.silu_mul(torch.randn(2, 8), isa="sse9")
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.add_rms_norm_(None, torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.greedy(torch.randn(2, 8, dtype=torch.bfloat16))
