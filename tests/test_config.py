"""Every engine config field refuses out-of-range values at construction, naming the field."""

from __future__ import annotations

import pytest
import torch

from cbserve import ContinuousBatchingConfig

BAD_VALUES = [
    ("page_size", 3), ("page_size", 0), ("num_blocks", 0), ("max_batch_tokens", 0),
    ("max_memory_percent", 0.0), ("max_memory_percent", 1.5), ("max_requests_per_batch", 0),
    ("max_blocks_per_request", -1), ("q_padding_interval_size", -1), ("kv_padding_interval_size", -1),
    ("default_compile_level", -1), ("default_compile_level", 4), ("scheduler", "lifo"),
    ("safety_margin", -0.1), ("safety_margin", 1.01), ("cpu_offload_space", -1.0),
    ("cpu_offload_space_safety_threshold", 0.0), ("cpu_offload_space_safety_threshold", 1.2),
    ("max_queue_size", -1), ("cpu_group_timeout", 0.0), ("tp_size", 0), ("block_size", 2),
    ("page_size", "big"), ("allow_block_sharing", "maybe"), ("engine_nice", -1), ("engine_nice", 20),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        ContinuousBatchingConfig(**{field: value})
    message = str(info.value)
    assert field in message and repr(value).strip("'") in message


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="pages"):
        ContinuousBatchingConfig(pages=4)


def test_defaults_match_transformers() -> None:
    cfg = ContinuousBatchingConfig()
    assert (cfg.page_size, cfg.num_blocks, cfg.max_batch_tokens, cfg.scheduler) == (256, None, None, "fifo")
    assert cfg.allow_block_sharing and cfg.auto_switch_to_flash and not cfg.return_logprobs
    assert cfg.cpu_offload_space == 0.0 and cfg.cpu_group_timeout == 300.0 and cfg.default_compile_level == 0


def test_safety_margin_default_depends_on_the_scheduler() -> None:
    assert ContinuousBatchingConfig().resolved_safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler="prefill_first").resolved_safety_margin == 0.0
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").scheduler == "prefill_first"
    assert ContinuousBatchingConfig(safety_margin=0.3).resolved_safety_margin == 0.3


def test_block_size_is_a_deprecated_alias_of_page_size() -> None:
    with pytest.warns(DeprecationWarning, match="page_size"):
        assert ContinuousBatchingConfig(block_size=32).page_size == 32
    with pytest.raises(ValueError, match="block_size and page_size"):
        ContinuousBatchingConfig(block_size=32, page_size=64)


def test_assignment_is_validated_too() -> None:
    cfg = ContinuousBatchingConfig()
    with pytest.raises(ValueError, match="page_size"):
        cfg.page_size = 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("field", ["use_cuda_graph", "use_async_batching"])
def test_cuda_only_features_fail_without_cuda(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=True needs a CUDA device"):
        ContinuousBatchingConfig(**{field: True})
    assert getattr(ContinuousBatchingConfig(**{field: False}), field) is False


def test_compile_configs_accept_transformers_compile_config_objects() -> None:
    from transformers import CompileConfig

    cfg = ContinuousBatchingConfig(varlen_compile_config=CompileConfig(dynamic=True, mode="default"),
                                   decode_compile_config={"dynamic": False})
    assert cfg.varlen_compile_config == {"fullgraph": False, "dynamic": True, "backend": "inductor",
                                         "mode": "default", "options": None}
    assert cfg.decode_compile_config == {"dynamic": False}
    with pytest.raises(ValueError, match="varlen_compile_config"):
        ContinuousBatchingConfig(varlen_compile_config=3)


def test_transformers_config_is_read_field_by_field() -> None:
    from transformers.generation import ContinuousBatchingConfig as TransformersConfig

    from cbserve.config import resolve

    cfg = resolve(TransformersConfig(page_size=32, max_memory_percent=0.5, scheduler_type="prefill_first",
                                     return_logprobs=True, max_queue_size=7, drop_unsupported_processors=False))
    assert isinstance(cfg, ContinuousBatchingConfig)
    assert (cfg.page_size, cfg.max_memory_percent, cfg.scheduler, cfg.return_logprobs, cfg.max_queue_size) == (
        32, 0.5, "prefill_first", True, 7)
    assert resolve(TransformersConfig()) == ContinuousBatchingConfig()
    with pytest.raises(ValueError, match="page_size"):
        resolve(TransformersConfig(page_size=2))  # validated here, naming the field
    assert resolve({"page_size": 64}).page_size == 64
    with pytest.raises(TypeError, match="continuous_batching_config"):
        resolve("big")


def test_a_config_nested_in_the_generation_config_is_honoured(caplog: pytest.LogCaptureFixture) -> None:
    import warnings

    from transformers import GenerationConfig

    from cbserve.config import resolve

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers deprecates the nesting
        gc = GenerationConfig(continuous_batching_config=ContinuousBatchingConfig(page_size=48))
    assert resolve(None, gc).page_size == 48
    assert "deprecated" in caplog.text
    assert resolve(ContinuousBatchingConfig(page_size=16), gc).page_size == 16  # the explicit one wins
    assert resolve(None, GenerationConfig()) == ContinuousBatchingConfig()


def test_auto_max_batch_tokens_is_capped_by_memory_and_never_below_256(monkeypatch: pytest.MonkeyPatch) -> None:
    from cbserve.workers import sizing

    cpu = torch.device("cpu")
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda device: 64 << 30)
    assert sizing.auto_max_batch_tokens(ContinuousBatchingConfig(), cpu) == 2048  # the CPU default
    # 1 GiB at the CPU's 20% share: half of it holds 1638 tokens of batch buffers.
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda device: 1 << 30)
    assert sizing.auto_max_batch_tokens(ContinuousBatchingConfig(), cpu) == 1638
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda device: 8 << 20)
    assert sizing.auto_max_batch_tokens(ContinuousBatchingConfig(), cpu) == 256
    assert sizing.auto_max_batch_tokens(ContinuousBatchingConfig(max_memory_percent=1.0), cpu) == 256
