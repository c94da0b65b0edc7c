"""Entry points, with transformers' semantics (`ContinuousMixin` in
`generation/continuous_batching/continuous_api.py`): `generate_batch` (offline, blocks until
every prompt is done), `init_continuous_batching` and the `continuous_batching` context manager
(online). `cbserve.attach(model)` binds them to a model under transformers' method names."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from cbserve import config as engine_config
from cbserve.config import ContinuousBatchingConfig
from cbserve.errors import InvalidRequestError, QueueFullError
from cbserve.manager import MODEL_ATTRIBUTE, ContinuousBatchingManager
from cbserve.outputs import GenerationOutput
from cbserve.workers import offline
from cbserve.workers.sizing import Workload

logger = logging.getLogger(__name__)


def cached_manager(model: torch.nn.Module) -> ContinuousBatchingManager | None:
    """The manager a session kept on `model` (`persistent_manager=True`), if any."""
    manager = getattr(model, MODEL_ATTRIBUTE, None)
    return manager if isinstance(manager, ContinuousBatchingManager) else None


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    progress_bar: bool = True,
    record_timestamps: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    max_new_tokens: int | None = None,
    lora: str | list[str | None] | None = None,
) -> dict[str, GenerationOutput]:
    """Run every prompt; returns outputs keyed "req_0", "req_1", ... in input order. A prompt the
    engine refuses gets a FAILED output naming the error (`error`, `exception`) and the others run.
    `lora` (enable_lora): one LoRA adapter for every prompt, or one per prompt (None: the base
    model), each a PEFT adapter folder or the name of one loaded on the persistent manager.
    Without a persistent manager the engine is sized for these prompts and dropped afterwards;
    with `persistent_manager=True`, or when a manager waits on the model, the prompts go through
    that manager (kept on the model afterwards when `persistent_manager`)."""
    if not inputs:
        return {}
    loras = per_prompt_loras(lora, len(inputs))
    if not persistent_manager and cached_manager(model) is None:
        config = engine_config.resolve(continuous_batching_config, generation_config)
        return offline.generate(model, inputs, generation_config, config, progress_bar, max_new_tokens,
                                record_timestamps, loras)
    gc = generation_config or model.generation_config
    new = max_new_tokens or gc.max_new_tokens or 20
    longest = max(len(_tokens(p)) for p in inputs) + new
    hints = Workload(max_total_tokens=len(inputs) * longest, num_requests=len(inputs), max_request_tokens=longest)
    with continuous_batching(model, generation_config, continuous_batching_config, persistent_manager,
                             block=True, timeout=5, warmup=warmup, workload_hints=hints) as manager:
        return _run_through(manager, inputs, max_new_tokens, record_timestamps, progress_bar, loras)


def per_prompt_loras(lora: str | list[str | None] | None, count: int) -> list[str | None]:
    """generate_batch's `lora` as one entry per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * count
    if not isinstance(lora, (list, tuple)) or len(lora) != count:
        raise InvalidRequestError("lora", f"lora must be one adapter for all prompts or a list of one per prompt "
                                  f"({count} entries), got {lora!r:.200}")
    return list(lora)


def _tokens(prompt: Any) -> list:
    """A prompt as a list, for sorting and sizing ([] for one that is not a sequence: refused later)."""
    if isinstance(prompt, torch.Tensor):
        return prompt.tolist()
    return list(prompt) if isinstance(prompt, (list, tuple)) else []


def _run_through(manager: ContinuousBatchingManager, inputs: list[list[int]], max_new_tokens: int | None,
                 record_timestamps: bool, progress_bar: bool, loras: list[str | None]) -> dict[str, GenerationOutput]:
    """generate_batch on a running manager: each prompt submitted on its own (a refused one gets a
    FAILED output), those sharing prefixes next to each other, as the queue has room
    (`max_queue_size`); outputs in input order."""
    ids = manager.next_request_ids(len(inputs))
    pending = sorted(range(len(inputs)), key=lambda i: _tokens(inputs[i]))
    results: dict[str, GenerationOutput] = {}
    with tqdm(total=len(inputs), desc="generate_batch", unit="req", disable=not progress_bar) as bar:
        while len(results) < len(inputs):
            while pending:
                i = pending[0]
                try:
                    manager.add_request(inputs[i], request_id=ids[i], max_new_tokens=max_new_tokens,
                                        record_timestamps=record_timestamps, lora=loras[i])
                except QueueFullError:
                    break
                except InvalidRequestError as error:
                    results[ids[i]] = offline.failed_output(ids[i], inputs[i], error)
                    bar.update(1)
                pending.pop(0)
            result = manager.get_result(timeout=0.05 if pending else 1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
                bar.update(1)
            elif result is None and not manager.is_running():
                logger.error("Generation thread terminated unexpectedly.")
                break
    missing = RuntimeError("the generation loop ended before this request finished")
    outputs = {rid: results.get(rid) or offline.failed_output(rid, prompt, missing) for rid, prompt in zip(ids, inputs)}
    failed = [rid for rid, out in outputs.items() if out.error is not None]
    if failed:
        logger.error("Requests %s failed during generation.", failed)
    return outputs


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    workload_hints: Any = None,
) -> ContinuousBatchingManager:
    """A manager (not started) owning an engine for `model`; the one a previous session kept on
    the model (`persistent_manager` / `keep_for_next_session`) when there is one, as transformers
    does (its configs then stay those it was built with)."""
    manager = cached_manager(model)
    if manager is not None:
        logger.info("Cached continuous batching manager found: it will be re-used instead of creating a new one. If "
                    "you want to create a new manager, you should call `destroy_cached_continuous_batching_manager` "
                    "first.")
        return manager
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, workload_hints)


def destroy_cached_continuous_batching_manager(model: torch.nn.Module) -> None:
    """Destroy the manager kept on `model`, if any, freeing its cache."""
    manager = cached_manager(model)
    if manager is not None:
        manager.destroy()
        if getattr(model, MODEL_ATTRIBUTE, None) is manager:
            delattr(model, MODEL_ATTRIBUTE)


@contextmanager
def continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    persistent_manager: bool = False,
    block: bool = True,
    timeout: float | None = None,
    warmup: bool = True,
    workload_hints: Any = None,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager (warmed up first when `warmup`: see `ContinuousBatchingManager.warmup`);
    on exit it is stopped (finishing its work; `block` and `timeout` as for `stop`), then
    destroyed unless `persistent_manager`, in which case it stays on the model for the next
    session."""
    manager = init_continuous_batching(model, generation_config, continuous_batching_config, workload_hints)
    if warmup and not manager.warmed_up:
        start = time.perf_counter()
        manager.warmup()
        logger.info("Warming up completed in %.2fs.", time.perf_counter() - start)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()
