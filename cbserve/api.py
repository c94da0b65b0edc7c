"""Entry points: `generate_batch` (offline, blocks until every prompt is done) and the
manager's constructors (online)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.manager import ContinuousBatchingManager
from cbserve.outputs import GenerationOutput
from cbserve.workers.engine import EngineCore


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = True,
) -> dict[str, GenerationOutput]:
    """Run every prompt through the engine; returns outputs keyed "req_0", "req_1", ... in
    input order. Invalid prompts raise `ValueError` before anything runs."""
    if continuous_batching_config is not None and continuous_batching_config.tp_size > 1:
        # Tensor parallelism hook: rank 0 drives the other ranks (cbserve/workers/tp_engine.py).
        from cbserve.workers.tp_engine import generate_batch_tp

        return generate_batch_tp(model, inputs, generation_config, continuous_batching_config, progress_bar)
    gc = generation_config or model.generation_config
    default_new = gc.max_new_tokens if gc.max_new_tokens is not None else 20
    engine = EngineCore(
        model, gc, continuous_batching_config,
        max_total_tokens_hint=sum(len(p) + default_new for p in inputs),
        num_requests_hint=len(inputs),
        max_request_tokens_hint=max((len(p) for p in inputs), default=0) + default_new,
    )
    try:
        return run_to_completion(engine, inputs, progress_bar)
    finally:
        engine.release_model()


def run_to_completion(engine: EngineCore, inputs: list[list[int]], progress_bar: bool) -> dict[str, GenerationOutput]:
    """Submit every prompt and step the engine until all are done; on an error every live
    request is failed (its pages freed) before the error propagates."""
    try:
        requests = [engine.make_request(list(p), f"req_{i}") for i, p in enumerate(inputs)]
        for request in requests:
            engine.add_request(request)
        start = time.perf_counter()
        with tqdm(total=len(requests), desc="generate_batch", unit="req", disable=not progress_bar) as bar:
            while engine.has_work:
                done = sum(r.status.is_final for r in engine.step())
                if done:
                    bar.update(done)
                    rate = engine.generated_tokens / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{rate:.1f} tok/s")
        return {r.request_id: r.snapshot() for r in requests}
    except BaseException as error:
        engine.fail_all(error)
        raise


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> ContinuousBatchingManager:
    """Build a manager (not started) owning an engine for `model`."""
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config)


@contextmanager
def continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager; on exit it is stopped (finishing its work), then destroyed unless
    `persistent_manager`, in which case it stays on the model for the next context."""
    manager = getattr(model, "_cbserve_manager", None) if persistent_manager else None
    if manager is None:
        manager = init_continuous_batching(model, generation_config, continuous_batching_config)
        if persistent_manager:
            model._cbserve_manager = manager
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()
        if not persistent_manager:
            manager.destroy()
