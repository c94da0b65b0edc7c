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
    ("page_size", "big"), ("allow_block_sharing", "maybe"),
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
