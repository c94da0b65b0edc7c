"""The CPU's instruction sets, the kernel path chosen from them ($CBSERVE_CPU_ISA forces one), and
``dtype="auto"`` (bfloat16 where the CPU has native bfloat16 dot products, float32 elsewhere) in
`load_model` and the CLI, both branches forced by faking the CPU's flags."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from cbserve.kernels import cpu_isa

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN5 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16"}


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch):
    """fake_cpu(flags): the process sees a CPU with these /proc/cpuinfo flags (x86-64)."""

    def fake(flags: frozenset[str]) -> None:
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu_isa, "_is_x86", lambda: True)
        monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
        cpu_isa._selected.cache_clear()

    yield fake
    cpu_isa._selected.cache_clear()


def test_paths_follow_the_flags(fake_cpu) -> None:
    fake_cpu(ZEN5)
    assert cpu_isa.supported() == ("avx512_bf16", "avx512", "avx2", "generic")
    assert cpu_isa.selected() == "avx512_bf16"
    fake_cpu(AVX2_ONLY)
    assert cpu_isa.supported() == ("avx2", "generic")
    assert cpu_isa.selected() == "avx2"
    assert "avx512f" in cpu_isa.why_not("avx512") and cpu_isa.why_not("avx2") == ""
    fake_cpu(SAPPHIRE_RAPIDS)  # AMX but no AVX-512 BF16 flag: the float32 AVX-512 kernels
    assert cpu_isa.selected() == "avx512"
    fake_cpu(frozenset())  # no flags readable: torch's probes decide
    assert "generic" in cpu_isa.supported()


def test_the_environment_forces_a_path(fake_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(ZEN5)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert cpu_isa.selected() == "avx2"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "generic")
    assert cpu_isa.selected() == "generic"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="one of"):
        cpu_isa.selected()
    fake_cpu(AVX2_ONLY)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match="cannot run here: this CPU lacks .*avx512_bf16"):
        cpu_isa.selected()


@pytest.mark.parametrize("flags,expected", [(ZEN5, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16),
                                            (AVX2_ONLY, torch.float32)], ids=["avx512_bf16", "amx", "avx2"])
def test_auto_dtype(fake_cpu, flags, expected, caplog: pytest.LogCaptureFixture) -> None:
    fake_cpu(flags)
    assert cpu_isa.auto_dtype() == expected
    assert cpu_isa.auto_dtype("cuda") == torch.float32  # accelerators keep float32
    with caplog.at_level(logging.INFO, logger="cbserve.kernels.cpu_isa"):
        assert cpu_isa.resolve_dtype("auto") == expected
    assert f"dtype auto: {str(expected).removeprefix('torch.')}" in caplog.text
    assert cpu_isa.resolve_dtype("float32") == torch.float32  # overridable
    assert cpu_isa.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        cpu_isa.resolve_dtype("int8")


def test_the_real_cpu_is_described() -> None:
    """Whatever this machine is, detection agrees with torch's own probes."""
    assert cpu_isa.supported()[-1] == "generic"
    if cpu_isa.cpu_flags():
        assert cpu_isa.cpu_supports("avx2") == torch.cpu._is_avx2_supported()
        assert cpu_isa.cpu_supports("avx512_bf16") == torch.cpu._is_avx512_bf16_supported()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.cluster import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.mark.parametrize("flags,expected", [(ZEN5, torch.bfloat16), (AVX2_ONLY, torch.float32)],
                         ids=["native-bf16", "avx2"])
def test_load_model_default_is_auto(fake_cpu, model_dir: Path, flags, expected) -> None:
    from cbserve.models import load_model

    fake_cpu(flags)
    model, _ = load_model(str(model_dir))
    assert model.dtype == expected
    model, _ = load_model(str(model_dir), dtype="float32")
    assert model.dtype == torch.float32
    model, _ = load_model(str(model_dir), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("flags,expected", [(ZEN5, torch.bfloat16), (AVX2_ONLY, torch.float32)],
                         ids=["native-bf16", "avx2"])
def test_cli_dtype(fake_cpu, model_dir: Path, monkeypatch: pytest.MonkeyPatch, flags, expected,
                   capsys: pytest.CaptureFixture) -> None:
    import cbserve.models
    from cbserve.__main__ import build_parser, main

    real_path = cpu_isa.selected()
    fake_cpu(flags)
    # The faked flags choose the dtype; the kernels must still take a path this CPU has (on an
    # AVX2-only machine the faked bf16 path would be refused by the kernel's own check).
    monkeypatch.setattr(cpu_isa, "selected", lambda: real_path)
    assert build_parser().parse_args(["generate", "--prompt", "x"]).dtype == "auto"
    seen = []
    load = cbserve.models.load_model

    def recording_load(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        seen.append(model.dtype)
        return model, tokenizer

    monkeypatch.setattr(cbserve.models, "load_model", recording_load)
    for argv, dtype in ([], expected), (["--dtype", "float32"], torch.float32):
        assert main(["generate", "--prompt", "hello", "--max-new-tokens", "2", "--no-progress",
                     "--model", str(model_dir), *argv]) == 0
        assert seen[-1] == dtype
        assert "output tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "int8"])
