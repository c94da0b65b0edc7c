"""Run-to-completion: every prompt submitted at once, the engine stepped until all are done.
What `generate_batch` runs; under a launcher's tensor parallelism, ranks > 0 follow instead."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.errors import InvalidRequestError
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus, TokenClock
from cbserve.scheduler.request import Request
from cbserve.workers.engine import EngineCore
from cbserve.workers.factory import build_engine
from cbserve.workers.sizing import Workload

logger = logging.getLogger(__name__)


def generate(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None,
    config: ContinuousBatchingConfig | None,
    progress_bar: bool,
    max_new_tokens: int | None = None,
    record_timestamps: bool = False,
    loras: list[str | None] | None = None,
) -> dict[str, GenerationOutput]:
    config = config or ContinuousBatchingConfig()
    launched = config.tp_size > 1 and _launched_ranks(config)
    if launched and _rank(config) != 0:
        from cbserve.workers.parallel.launch import serve_tensor_parallel_rank

        return serve_tensor_parallel_rank(model, config)  # every rank returns rank 0's outputs
    gc = generation_config or model.generation_config
    default_new = max_new_tokens or (gc.max_new_tokens if gc.max_new_tokens is not None else 20)
    lengths = [p.numel() if isinstance(p, torch.Tensor) else len(p) if isinstance(p, (list, tuple)) else 0
               for p in inputs]  # a bad prompt fails on its own, later
    workload = Workload(
        max_total_tokens=sum(n + default_new for n in lengths),
        num_requests=len(inputs),
        max_request_tokens=max(lengths, default=0) + default_new,
    )
    engine = build_engine(model, gc, config, workload)
    outputs: dict[str, GenerationOutput] | None = None
    try:
        outputs = run_to_completion(engine, inputs, progress_bar, max_new_tokens, record_timestamps, loras)
        return outputs
    finally:
        engine.release_model(outputs if launched else None)


def _launched_ranks(config: ContinuousBatchingConfig) -> bool:
    from cbserve.workers.parallel.launch import resolve_launcher

    return resolve_launcher(config) != "spawn"


def _rank(config: ContinuousBatchingConfig) -> int:
    from cbserve.workers.parallel.launch import launcher_rank

    return launcher_rank(config)


def failed_output(request_id: str, prompt: Any, error: BaseException) -> GenerationOutput:
    """The output of a request that never ran (refused, or the run ended before it)."""
    now = time.time()
    prompt_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return GenerationOutput(request_id=request_id, prompt_ids=prompt_ids, status=RequestStatus.FAILED,
                            finish_reason=FinishReason.ERROR, error=f"{type(error).__name__}: {error}",
                            exception=error, created_time=now, finished_time=now)


def run_to_completion(engine: EngineCore, inputs: list[list[int]], progress_bar: bool,
                      max_new_tokens: int | None = None, record_timestamps: bool = False,
                      loras: list[str | None] | None = None) -> dict[str, GenerationOutput]:
    """Submit every prompt and step the engine until all are done; outputs keyed "req_0", ... in
    input order. As transformers' generate_batch: a prompt the engine refuses gets a FAILED output
    naming the error and the others run; an error while stepping fails every live request (pages
    freed), is logged, and the outputs come back with those requests FAILED. KeyboardInterrupt and
    the like fail the live requests and propagate."""
    clock = TokenClock()
    slots: dict[str, Request | GenerationOutput] = {}
    for i, prompt in enumerate(inputs):
        rid = f"req_{i}"
        try:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            slots[rid] = engine.make_request(ids, rid, max_new_tokens, lora=loras[i] if loras else None)
        except (InvalidRequestError, TypeError) as error:
            slots[rid] = failed_output(rid, prompt, error)
        else:
            if record_timestamps:
                clock.track(rid)
    requests = [r for r in slots.values() if isinstance(r, Request)]
    try:
        for request in requests:
            engine.add_request(request)
        _step_until_done(engine, len(requests), clock, progress_bar)
    except Exception as error:
        logger.exception("generate_batch: the engine failed; returning the outputs, unfinished ones FAILED")
        engine.fail_all(error)
    except BaseException as error:
        engine.fail_all(error)
        raise
    outputs = {rid: clock.stamp(r.snapshot()) if isinstance(r, Request) else r for rid, r in slots.items()}
    failed = [rid for rid, out in outputs.items() if out.status == RequestStatus.FAILED]
    if failed:
        logger.error("Requests %s failed during generation.", failed)
    return outputs


def _step_until_done(engine: EngineCore, total: int, clock: TokenClock, progress_bar: bool) -> None:
    start = time.perf_counter()
    with tqdm(total=total, desc="generate_batch", unit="req", disable=not progress_bar) as bar:
        while engine.has_work:
            updated = engine.step()
            clock.tick(updated)
            done = sum(r.status.is_final for r in updated)
            if done:
                bar.update(done)
                rate = engine.generated_tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{rate:.1f} tok/s")
