"""Engine (hardware-side) configuration, validated once at construction."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

MIN_AUTO_BATCH_TOKENS = 256
# Query tokens per forward pass when `max_batch_tokens` is not given. A CPU runs prefill in
# smaller chunks: decode rows then ride along with prefill chunks instead of waiting for one huge
# step (mixed benchmark: ~87 tok/s at 2048 vs ~75 at 8192, mean of 3 runs on 2 cores).
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 2048, "cuda": 8192}
DEFAULT_MAX_REQUESTS = 1024
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}
# One parent request's query tokens per step (`parent_step_tokens`), by device: none by default.
# Measured on 2 CPU cores (bench/fairness.py --manager, 512 choices of 8 tokens): 64 cut a
# fan-out's throughput from 136 to 57 tok/s alone, for a short request's TTFT 28x -> 5.7x idle.
DEFAULT_PARENT_STEP_TOKENS: dict[str, int] = {}
# The same while the engine is shared (`shared_parent_step_tokens`): on a CPU, where a step's time
# grows with its rows, a fan-out beside others takes short steps (bench/fairness.py).
DEFAULT_SHARED_PARENT_STEP_TOKENS: dict[str, int] = {"cpu": 16}


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's field names): each step, a decoding request's next tokens are
    proposed and verified by the model in the same forward pass (`scheduler/ngram.py`,
    `workers/draft_model.py`, `workers/speculative.py`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] = Field(
        "ngram", description="ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the "
        "request's last n tokens (in its prompt or output); no extra model. draft_model: a smaller model of the same "
        "tokenizer (`model`) proposes (its greedy tokens, or draws from its distribution for a sampled request)"
    )
    model: str | None = Field(
        None, min_length=1, description="draft_model: the draft's folder or GGUF file (what cbserve.load_model reads), "
        "loaded in the target's dtype"
    )
    quantization: Literal["none", "auto", "int8"] = Field(
        "none", description="draft_model: the draft's weights, as the engine's `quantization` (auto: a GGUF draft "
        "file's own blocks; int8: Q8_0 blocks quantized at load; CPUs only): a quantized copy of the target is a "
        "cheap draft that agrees with it on most tokens"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="most tokens proposed per request per step")
    num_speculative_tokens_schedule: Literal["constant", "heuristic"] = Field(
        "constant", description="transformers' num_assistant_tokens_schedule: constant: up to num_speculative_tokens "
        "every step; heuristic: a request's next proposal may be 2 tokens longer after its last was accepted whole (up "
        "to num_speculative_tokens), 1 shorter (at least 1) after one was cut short (fewer draft-model passes and "
        "verified rows when proposals fail; with n-gram proposals it measured 0.9x on one stream, see the README)"
    )
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="longest n-gram matched (tried first)")
    prompt_lookup_min: int = Field(2, ge=1, le=64, description="shortest n-gram matched")
    disable_by_batch_size: int | None = Field(
        8, ge=1, description="no proposals in a step with this many decoding requests or more: the step is then "
        "bound by compute, not by reading the weights, and verifying proposals would cost throughput; None: always"
    )

    @model_validator(mode="after")
    def _draft_needs_a_model(self) -> SpeculativeConfig:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative.model is needed by method 'draft_model' and only by it "
                             f"(method={self.method!r}, model={self.model!r})")
        if self.quantization != "none" and self.method != "draft_model":
            raise ValueError(f"speculative.quantization={self.quantization!r} quantizes a draft model: method "
                             f"{self.method!r} has none")
        return self

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self


class ContinuousBatchingConfig(BaseModel):
    """Every field of SPEC section 3, with `transformers`' names and defaults.

    Invalid values raise a `ValueError` (pydantic's `ValidationError`) naming the field, the
    value and the allowed range.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)

    page_size: int = Field(256, ge=4, description="tokens per KV page per layer")
    num_blocks: int | None = Field(None, ge=1, description="KV pages; None fills the memory budget")
    max_batch_tokens: int | None = Field(
        None, ge=1, description="query tokens in one forward pass; None: 2048 on a CPU, 8192 on a GPU"
    )
    max_memory_percent: float | None = Field(None, gt=0.0, le=1.0)
    max_requests_per_batch: int | None = Field(None, ge=1)
    max_blocks_per_request: int | None = Field(None, ge=0)
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = Field(0, ge=0)
    kv_padding_interval_size: int = Field(0, ge=0)
    varlen_compile_config: dict[str, Any] | None = Field(
        None, description="torch.compile keyword arguments for prefill / mixed steps: a dict or a transformers "
        "CompileConfig (read as its to_dict())"
    )
    decode_compile_config: dict[str, Any] | None = Field(
        None, description="torch.compile keyword arguments for decode-only steps: a dict or a CompileConfig"
    )
    default_compile_level: int = Field(0, ge=0, le=3)
    scheduler: Literal["fifo", "prefill_first"] = "fifo"
    parent_share: float = Field(
        0.5, gt=0.0, le=1.0, description="most of max_requests_per_batch that one parent request's choices (an API "
        "call's n x prompts, requests sharing a parent_id) may hold in the running set, so that others are "
        "always admitted (scheduler/fair_share.py); 1.0: no cap"
    )
    parent_step_tokens: int | None = Field(
        None, ge=0, description="most query tokens one parent request's choices take in one step (beyond its first "
        "one's, so a lone request's prefill chunk is not cut); on a CPU a step's "
        "time grows with its tokens and a newcomer waits for the step in flight, so this bounds its wait behind a "
        "fan-out, at a cost in its throughput (bench/fairness.py). None or 0: no cap"
    )
    shared_parent_step_tokens: int | None = Field(
        None, ge=0, description="parent_step_tokens while the engine is shared: another tenant or parent request "
        "is live, or was within shared_window_s. A fan-out alone keeps its whole throughput; beside others its "
        "steps stay short, so their requests wait for short steps. None: 16 on a CPU, no cap on a GPU; 0: no cap"
    )
    shared_window_s: float = Field(
        5.0, ge=0.0, description="how long after another tenant or parent request was last live the engine still "
        "counts as shared (a client's next request comes after a pause: its first token should not wait for a "
        "whole fan-out step either)"
    )
    held_step_tokens: int | None = Field(
        4, ge=1, description="while a newcomer (a tenant or parent request with no first token yet) could be "
        "admitted and is owed no less (fair_share.py), the other tenants, and the other parents of its tenant, take "
        "at most this many query tokens per step, so that the newcomer's first step is short; None: never held"
    )
    priority_scheduling: bool = Field(
        False, description="honour requests' priority (vLLM's: lower runs first, before any fair share); False: a "
        "priority other than 0 is refused, as vLLM does without --scheduling-policy priority (clients could "
        "otherwise jump every queue)"
    )
    safety_margin: float | None = Field(None, ge=0.0, le=1.0)
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    attention_backend: Literal["auto", "cpu", "sdpa", "triton", "flash", "reference"] = Field(
        "auto", description="auto: flash, else triton on CUDA; the C++ decode kernel (cpu), else sdpa, on a CPU "
        "(see kernels/attention_backends.py)"
    )
    prepack_weights: bool | None = Field(
        None, description="linear weights packed once for oneDNN on a CPU (a second copy while the engine "
        "runs; faster GEMMs); None: on for float32 CPU models without torch.compile"
    )
    quantization: Literal["none", "auto", "int8"] = Field(
        "none", description="auto: a model loaded from a GGUF file (cbserve.load_model) runs its Q8_0 / Q4_0 / "
        "Q4_1 linear layers and embedding on the file's own blocks (kernels/quantized.py; replaced in the model, "
        "in place), other tensors stay dense; int8: any model's linear layers quantized at load to int8 weights "
        "with a float16 scale per block of 32 (GGUF's Q8_0 layout; weight-only, activations stay in the model's "
        "dtype), in place; none: dense weights as loaded. Under tensor parallelism each rank quantizes its own "
        "shard: its part of the whole model's blocks, split along whole blocks"
    )
    speculative: SpeculativeConfig | None = Field(
        None, description="speculative decoding (a SpeculativeConfig or a dict of its fields); None: off. A request "
        "opts out with speculative=False; one owing prompt logprobs speculates once they are computed; logits processors "
        "and grammars process each proposed row as if the proposals before it were generated"
    )
    cpu_offload_space: float | None = Field(0.0, ge=0.0)
    cpu_offload_space_safety_threshold: float = Field(0.8, gt=0.0, le=1.0)
    max_queue_size: int = Field(
        0, ge=0, description="requests waiting to be admitted (queued in the manager or the scheduler) beyond which "
        "add_request refuses with QueueFullError; 0: unbounded"
    )
    per_request_processors: bool = False
    # Structured outputs (workers/structured.py): bounds on compiling a request's grammar.
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0.0, description="the longest a request's constraint (JSON schema, regex, grammar) may compile, and "
        "the longest it may wait for a free compile thread: beyond the first it is refused naming its field (the "
        "compile is left to finish, off the others' threads), beyond the second it is an overload"
    )
    grammar_compile_threads: int = Field(
        2, ge=1, description="constraints compiled at once (identical ones share one compile); a compile past its "
        "timeout frees its thread, up to as many such again"
    )
    grammar_cache_limit_bytes: int = Field(
        256 << 20, ge=0, description="memory of compiled grammars kept for reuse (xgrammar's cache_limit_bytes, least "
        "recently used evicted); 0: none kept"
    )
    grammar_max_nesting: int = Field(
        64, ge=1, description="deepest nesting of a constraint's source: JSON schema objects and arrays, regex "
        "groups, EBNF parentheses; deeper ones are refused before compiling (a JSON schema nested 200 deep takes "
        "seconds to convert)"
    )
    cpu_group_timeout: float | None = Field(300.0, gt=0.0)
    step_timeout_s: float | None = Field(
        600.0, gt=0.0, description="the step watchdog: a step running longer makes check_health() fail (a stuck "
        "kernel or device; a served replica is then replaced); None: no watchdog. Above a first step's compile time"
    )
    engine_nice: int = Field(
        0, ge=0, le=19, description="Linux nice value of the engine thread and its OpenMP workers (they inherit it). "
        "Above 0 a request's serving threads (HTTP parsing, tokenization, streaming, Serve's proxy) take a shared "
        "CPU from the engine as soon as they wake instead of queueing behind its OpenMP team; the engine still gets "
        "every cycle they leave idle, but less than other processes' CPU-bound threads. 0: unchanged"
    )
    tp_size: int = Field(1, ge=1)
    tp_launcher: Literal["spawn", "torchrun", "external"] | None = Field(
        None, description="how the tensor-parallel ranks start: spawn (local processes started by the engine), "
        "torchrun, external (a torch.distributed group joined before); None: torchrun under torchrun, else spawn"
    )
    batch_invariant: bool | None = Field(
        None, description="a request's tokens and logprobs bitwise identical whatever else shares its batches. "
        "True: guaranteed (the C++ CPU linear and attention kernels, whose per-row reduction order is fixed, for "
        "every layer and row; needs attention_backend auto or cpu, packed weights, no torch.compile); None: those "
        "kernels for linears and decode rows, prefill chunks through the tiled C++ kernel (bfloat16 on AVX-512 BF16, "
        "float32 on AVX-512) or SDPA (bfloat16 on AMX), not enforced; False: kernels chosen for speed alone (SDPA for prefill chunks "
        "where the tiled kernel does not run)"
    )
    node_kv_pool: str | None = Field(
        None, min_length=1, description="name of this node's shared KV pool (workers/kv/node_pool.py, created by "
        "its owner) to pull missed prefix pages from and publish computed ones to; needs cpu_offload_space != 0 "
        "(pulled pages are staged in the engine's host pool), prefix caching and tp_size=1"
    )
    # Multi-LoRA serving (workers/lora_slots.py), vLLM's names.
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (PEFT format) on the attention and MLP projections: requests name "
        "one with lora=..., the base model without"
    )
    max_loras: int = Field(
        1, ge=1, le=64, description="adapters resident at once (least recently used evicted to host memory); the "
        "running requests use at most this many adapters"
    )
    max_lora_rank: int = Field(16, ge=1, le=512, description="the largest adapter rank r accepted")
    # Deprecated aliases.
    block_size: int | None = Field(None, ge=4, exclude=True)
    scheduler_type: Literal["fifo", "prefill_first"] | None = Field(None, exclude=True)

    @field_validator("varlen_compile_config", "decode_compile_config", mode="before")
    @classmethod
    def _compile_config_dict(cls, value: Any) -> Any:
        """transformers passes `CompileConfig` objects: their fields are torch.compile's arguments."""
        if value is not None and not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
            return value.to_dict()
        return value

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("block_size") is not None:
            warnings.warn("block_size is deprecated: use page_size", DeprecationWarning, stacklevel=4)
            if data.get("page_size") not in (None, data["block_size"]):
                raise ValueError("block_size and page_size both given with different values; give page_size")
            data["page_size"] = data["block_size"]
        if data.get("scheduler_type") is not None:
            data.setdefault("scheduler", data["scheduler_type"])
        return data

    @model_validator(mode="after")
    def _node_kv_pool_needs(self) -> ContinuousBatchingConfig:
        if self.node_kv_pool is None:
            return self
        if self.cpu_offload_space == 0:
            raise ValueError("node_kv_pool needs cpu_offload_space > 0 or None: pages pulled from the node pool are "
                             "staged in the engine's host pool")
        if self.tp_size > 1:
            raise ValueError(f"node_kv_pool works with tp_size=1 only, got tp_size={self.tp_size}")
        return self

    @model_validator(mode="after")
    def _device_only_features(self) -> ContinuousBatchingConfig:
        if self.use_async_batching and self.tp_size > 1:
            raise ValueError("use_async_batching=True works with tp_size=1 only (the ranks get host inputs)")
        if not torch.cuda.is_available():
            graphs = self.use_cuda_graph
            wants_graphs = any(graphs) if isinstance(graphs, tuple) else bool(graphs)
            if wants_graphs:
                raise ValueError("use_cuda_graph=True needs a CUDA device, and none is available")
            if self.use_async_batching:
                raise ValueError("use_async_batching=True needs a CUDA device, and none is available")
        return self

    @model_validator(mode="after")
    def _shared_window_needs_a_cap(self) -> ContinuousBatchingConfig:
        if "shared_window_s" in self.model_fields_set and self.shared_parent_step_tokens == 0:
            raise ValueError(f"shared_window_s={self.shared_window_s} has no effect with shared_parent_step_tokens=0 "
                             "(no cap while the engine is shared): set one or the other")
        return self

    @model_validator(mode="after")
    def _speculative_needs(self) -> ContinuousBatchingConfig:
        if self.speculative is None:
            return self
        if self.use_async_batching:
            raise ValueError("speculative decoding cannot be combined with use_async_batching (a step's tokens must "
                             "be verified on the host before the next step is planned)")
        if self.batch_invariant:
            raise ValueError("speculative decoding cannot be combined with batch_invariant=True: a verified token's "
                             "logits come from a multi-row pass whose reduction order differs from a decode row's")
        return self

    @model_validator(mode="after")
    def _batch_invariant_needs(self) -> ContinuousBatchingConfig:
        if not self.batch_invariant:
            return self
        if self.attention_backend not in ("auto", "cpu"):
            raise ValueError(f"batch_invariant=True needs attention_backend 'auto' or 'cpu' (the C++ CPU kernel), "
                             f"got {self.attention_backend!r}")
        if self.prepack_weights is False:
            raise ValueError("batch_invariant=True needs prepack_weights (the packed C++ linear kernel), got False")
        if self.default_compile_level > 0 or self.varlen_compile_config or self.decode_compile_config:
            raise ValueError("batch_invariant=True cannot be combined with torch.compile (default_compile_level > 0 "
                             "or a compile config): compiled graphs do not run the packed C++ kernels")
        graphs = self.use_cuda_graph
        if self.use_async_batching or (any(graphs) if isinstance(graphs, tuple) else graphs):
            raise ValueError("batch_invariant=True runs on the CPU backend: use_cuda_graph and use_async_batching "
                             "must be off")
        return self

    @model_validator(mode="after")
    def _lora_needs(self) -> ContinuousBatchingConfig:
        """The LoRA delta runs in the eager forward passes of one process: refuse what would skip it."""
        if not self.enable_lora:
            return self
        graphs = self.use_cuda_graph
        refused = {
            "torch.compile (default_compile_level > 0 or a compile config)":
                bool(self.default_compile_level or self.varlen_compile_config or self.decode_compile_config),
            "use_cuda_graph": any(graphs) if isinstance(graphs, tuple) else bool(graphs),
            "use_async_batching": bool(self.use_async_batching),
            "batch_invariant=True": bool(self.batch_invariant),
            "node_kv_pool": self.node_kv_pool is not None,  # its page keys know no adapter
        }
        for what, on in refused.items():
            if on:
                raise ValueError(f"enable_lora=True cannot be combined with {what} (not supported with LoRA "
                                 "adapters yet)")
        return self

    def resolved_parent_step_tokens(self, device_type: str) -> int | None:
        return _step_cap(self.parent_step_tokens, DEFAULT_PARENT_STEP_TOKENS, device_type)

    def resolved_shared_parent_step_tokens(self, device_type: str) -> int | None:
        return _step_cap(self.shared_parent_step_tokens, DEFAULT_SHARED_PARENT_STEP_TOKENS, device_type)

    @property
    def resolved_safety_margin(self) -> float:
        if self.safety_margin is not None:
            return self.safety_margin
        return DEFAULT_SAFETY_MARGIN[self.scheduler]


def _step_cap(value: int | None, defaults: dict[str, int], device_type: str) -> int | None:
    """A per-step token cap: None takes the device's default, 0 is no cap."""
    return defaults.get(device_type) if value is None else value or None


def with_fields(config: ContinuousBatchingConfig, **fields: Any) -> ContinuousBatchingConfig:
    """A new config: `config`'s fields with `fields` set, validated together (the cross-field rules,
    such as node_kv_pool's need of cpu_offload_space, see the new values at once)."""
    return ContinuousBatchingConfig.model_validate({**config.model_dump(exclude_unset=True), **fields})


# transformers' ContinuousBatchingConfig fields with no counterpart here, and why they change nothing.
TRANSFORMERS_ONLY_FIELDS = {
    "drop_unsupported_processors": "cbserve honours every GenerationConfig field transformers' engine does and "
                                   "refuses the others when the engine is built: no processor is dropped",
    "disable_nccl_graph_mixing": "cbserve's tensor parallelism replays no graph-captured NCCL calls",
    "use_default_compile_configs": "deprecated in transformers: read as default_compile_level",
    "max_cached_graphs": "deprecated in transformers",
    "block_size": "deprecated in transformers: read as page_size",
}


def from_transformers(config: Any) -> ContinuousBatchingConfig:
    """cbserve's config for a `transformers.ContinuousBatchingConfig`: every field set away from
    transformers' default is carried over (validated here), those without a counterpart are logged."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value == default or value is None:
            continue
        if f.name in TRANSFORMERS_ONLY_FIELDS:
            logger.info("ContinuousBatchingConfig.%s=%r not used: %s", f.name, value, TRANSFORMERS_ONLY_FIELDS[f.name])
        elif f.name == "scheduler_type":
            values["scheduler"] = value
        elif f.name in ContinuousBatchingConfig.model_fields:
            values[f.name] = value
        else:
            logger.warning("ContinuousBatchingConfig.%s=%r is unknown to cbserve and ignored", f.name, value)
    return ContinuousBatchingConfig(**values)


def resolve(config: Any = None, generation_config: Any = None) -> ContinuousBatchingConfig:
    """The engine config for what a caller passed: cbserve's config, a dict of its fields, or
    transformers' config; when None, the one nested in `generation_config` (deprecated in
    transformers, honoured as it does), else the defaults."""
    if config is None:
        config = getattr(generation_config, "continuous_batching_config", None)
        if config is not None:
            logger.warning("Passing ContinuousBatchingConfig through GenerationConfig is deprecated. Please pass it "
                           "separately using the continuous_batching_config kwarg.")
    if config is None:
        return ContinuousBatchingConfig()
    if isinstance(config, ContinuousBatchingConfig):
        return config
    if isinstance(config, dict):
        return ContinuousBatchingConfig(**config)
    if dataclasses.is_dataclass(config) and type(config).__name__ == "ContinuousBatchingConfig":
        return from_transformers(config)
    raise TypeError(f"continuous_batching_config must be a cbserve or transformers ContinuousBatchingConfig or a dict, "
                    f"got {type(config).__name__}")
