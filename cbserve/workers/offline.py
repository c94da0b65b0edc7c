"""Run-to-completion: every prompt submitted at once, the engine stepped until all are done.
What `generate_batch` runs; under a launcher's tensor parallelism, ranks > 0 follow instead."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.outputs import GenerationOutput
from cbserve.workers.engine import EngineCore
from cbserve.workers.factory import build_engine
from cbserve.workers.sizing import Workload


def generate(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None,
    config: ContinuousBatchingConfig | None,
    progress_bar: bool,
) -> dict[str, GenerationOutput]:
    config = config or ContinuousBatchingConfig()
    launched = config.tp_size > 1 and _launched_ranks(config)
    if launched and _rank(config) != 0:
        from cbserve.workers.parallel.launch import serve_tensor_parallel_rank

        return serve_tensor_parallel_rank(model, config)  # every rank returns rank 0's outputs
    gc = generation_config or model.generation_config
    default_new = gc.max_new_tokens if gc.max_new_tokens is not None else 20
    workload = Workload(
        max_total_tokens=sum(len(p) + default_new for p in inputs),
        num_requests=len(inputs),
        max_request_tokens=max((len(p) for p in inputs), default=0) + default_new,
    )
    engine = build_engine(model, gc, config, workload)
    outputs: dict[str, GenerationOutput] | None = None
    try:
        outputs = run_to_completion(engine, inputs, progress_bar)
        return outputs
    finally:
        engine.release_model(outputs if launched else None)


def _launched_ranks(config: ContinuousBatchingConfig) -> bool:
    from cbserve.workers.parallel.launch import resolve_launcher

    return resolve_launcher(config) != "spawn"


def _rank(config: ContinuousBatchingConfig) -> int:
    from cbserve.workers.parallel.launch import launcher_rank

    return launcher_rank(config)


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
