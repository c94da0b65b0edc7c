"""The online API: a manager owning one engine, driven by an `EngineLoop` (engine_loop.py: the
background thread, its inbox, parking and lifecycle state).

The manager is the facade with transformers' semantics
(`generation/continuous_batching/continuous_api.py`): it validates requests and hands them to the
loop, and hands out their outputs (sync, async, by callback); requests may be queued before
`start()`; `stop()` finishes queued and running work (or, with `hard_stop`, fails it) and gives
the model back its own attention implementation and modules, which `start()` takes again;
`pause()` parks the loop between two steps, with the model given back, keeping the cache and the
requests in flight; `destroy()` stops gracefully, then frees the cache for good.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, aclosing
from typing import Any

import torch
from transformers import GenerationConfig

from cbserve import config as engine_config
from cbserve.config import ContinuousBatchingConfig
from cbserve.engine_loop import (
    MAX_FAILED_STEPS,  # noqa: F401 (re-exported: its old home)
    EngineLoop,
    LoopState,
)
from cbserve.errors import QueueFullError
from cbserve.outputs import GenerationOutput
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.workers import validation
from cbserve.workers.factory import build_engine
from cbserve.workers.sizing import Workload

logger = logging.getLogger(__name__)

MODEL_ATTRIBUTE = "_cbserve_manager"  # where a persistent manager waits on its model for the next session
WARMUP_REQUEST_ID = "cbserve-warmup"


def workload_from_hints(hints: Any) -> Workload | None:
    """cbserve's `Workload` for transformers' `WorkloadHints` (max_prompt_length,
    max_generated_length, num_requests); a `Workload` or None as is."""
    if hints is None or isinstance(hints, Workload):
        return hints
    longest = (getattr(hints, "max_prompt_length", 0) or 0) + (getattr(hints, "max_generated_length", 0) or 0)
    num_requests = getattr(hints, "num_requests", 0) or 0
    return Workload(max_total_tokens=num_requests * longest or None, num_requests=num_requests or None,
                    max_request_tokens=longest or None)


@functools.cache
def _sampling_arguments() -> frozenset[str]:
    """The per-request arguments `add_request` takes as keywords (`validation.sampling`'s and
    `validation.scheduling`'s)."""
    return (frozenset(validation.SAMPLING_FIELDS) | frozenset(validation.OPTIONS)
            | frozenset(validation.SCHEDULING_FIELDS))


class ContinuousBatchingManager:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
        workload_hints: Any = None,
    ) -> None:
        """An engine for `model`, with transformers' arguments: `continuous_batching_config` may be
        cbserve's or transformers' config (or None: the one nested in `generation_config`, else the
        defaults); `workload_hints` a transformers `WorkloadHints` or a cbserve `Workload`."""
        self.model = model
        config = engine_config.resolve(continuous_batching_config, generation_config)
        self.engine = build_engine(model, generation_config, config, workload_from_hints(workload_hints))
        self.config = self.engine.config
        self.generation_config = self.engine.generation_config
        self._loop = EngineLoop(self.engine, self.config.step_timeout_s, self.config.engine_nice)
        # The loop's lock, live requests and outputs: a submission checks and queues atomically.
        self._cond, self._live, self._outputs = self._loop.cond, self._loop.live, self._loop.outputs
        self._next_id = 0
        self.warmed_up = False

    @property
    def continuous_batching_config(self) -> ContinuousBatchingConfig:
        return self.config

    @property
    def error(self) -> BaseException | None:
        """Why the loop last failed a step or died (None since `start()` otherwise)."""
        return self._loop.error

    @property
    def engine_fault(self) -> BaseException | None:
        """The last step that failed through no request's fault: check_health() fails for good."""
        return self._loop.engine_fault

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background loop (taking the model: cbserve's attention, packed linears)."""
        self._loop.start()

    def is_running(self) -> bool:
        return self._loop.is_running()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Refuse new work; finish everything queued and running (with `hard_stop`: fail it with a
        RuntimeError now); then the loop ends and gives the model back its own attention
        implementation and modules. `block`: wait for that, `timeout` seconds at most.
        `keep_for_next_session`: the manager stays on the model, for the next
        `init_continuous_batching` / `continuous_batching(..., persistent_manager=True)`."""
        if self._loop.holds_pause():
            raise RuntimeError("Cannot stop the manager from inside a pause: the generation loop is paused and cannot "
                               "exit, so this would wait forever. Leave the `pause` context before calling `stop`.")
        if not self._loop.stop(hard_stop):  # no loop thread
            if self._loop.state is LoopState.IDLE:
                logger.warning("Manager not started.%s", " Hence the unstarted manager will not be kept for "
                               "next session." if keep_for_next_session else "")
            elif keep_for_next_session and self._loop.state is LoopState.STOPPED:
                self._keep_on_model()
            return
        if block:
            self.join(time.perf_counter(), timeout)
        if keep_for_next_session:
            self._keep_on_model()
        if hard_stop and not self.is_running():  # no loop runs now: fail what it left (nothing, unless it died)
            self._loop.fail_everything(RuntimeError("the manager was hard-stopped"))

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait for the loop thread to end, `timeout` seconds at most (None: no limit)."""
        if self._loop.join(timeout) and stop_trigger_time is not None:
            logger.info("Background generation thread stopped after %.2fs.", time.perf_counter() - stop_trigger_time)

    def destroy(self, timeout: float | None = None) -> None:
        """Stop gracefully if running (waiting `timeout` seconds at most, then hard-stopping; a loop
        already given a grace period by `stop(timeout=...)` is hard-stopped at once), give the model
        back, free the KV cache. Safe to call twice; the manager cannot be restarted."""
        if self._loop.state is LoopState.DESTROYED:
            return
        if self._loop.holds_pause():
            raise RuntimeError("Cannot destroy the manager from inside a pause: leave the `pause` context first.")
        if self.is_running():
            self.stop(block=True, timeout=timeout, hard_stop=self._loop.state is LoopState.OVERDUE)
            if self.is_running():
                self.stop(block=True, hard_stop=True)
        self.join()
        if self._loop.destroy() and getattr(self.model, MODEL_ATTRIBUTE, None) is self:
            delattr(self.model, MODEL_ATTRIBUTE)

    def _keep_on_model(self) -> None:
        logger.info("Continuous batching manager will be kept for next session.")
        setattr(self.model, MODEL_ATTRIBUTE, self)

    def pause(self) -> AbstractContextManager[None]:
        """Park the loop between two steps, the model given back to the caller (its own attention
        implementation and linear layers: to use it or update its weights in place), keeping the
        cache and every request in flight; the loop takes the model again (packing the weights
        afresh) and resumes on exit. Several threads may hold the pause at once: the loop resumes
        when the last one leaves."""
        return self._loop.pause()

    def warmup(self) -> None:
        """Compile and capture CUDA graphs ahead, when those are on: one request of
        `max_batch_tokens` prompt tokens and 2 new tokens runs through the engine (a varlen step,
        then a decode step). Nothing to do otherwise. Call it before `start()`."""
        engine = self.engine
        if not engine.needs_warmup:
            self.warmed_up = True
            return
        if self.is_running() or engine.has_work:
            logger.warning("warmup() skipped: the loop is running or the engine holds requests; graphs are captured "
                           "and code compiled as requests run")
            return
        length = min(engine.max_batch_tokens, engine.capacity_tokens - 2, engine.max_context - 2)
        held = engine.holds_model
        engine.take_model()
        try:
            if length >= 1:
                engine.add_request(engine.make_request([1] * length, WARMUP_REQUEST_ID, 2))
                while engine.has_work:
                    engine.step()
            self.warmed_up = True
        finally:
            if not held:
                engine.give_back_model()

    # -- submitting --------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: Sequence[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str:
        """Validate and queue a request (before `start()` too); returns its id ("req_0", "req_1", ...
        when not given). Bad input raises ValueError (`InvalidRequestError`) here and queues
        nothing; a full queue (`max_queue_size`) raises `QueueFullError`; a stopped or destroyed
        manager raises RuntimeError. `logit_processor_kwargs`: per-request sampling (temperature,
        top_k, top_p, seed, penalties, logit_bias, min_tokens, logprobs, top_logprobs, prompt_logprobs, ...:
        `validation.OPTIONS`), with `per_request_processors=True`; `grammar=` a constraint compiled
        by `cbserve.StructuredOutputs`; `priority=` (vLLM's: lower runs first), `tenant=` and
        `parent_id=` (requests sharing one are one API call's choices) for the engine's fair share;
        `cache_salt=` (vLLM's: a string; prefix pages are shared only among requests of one salt);
        `speculative=False` keeps the request out of the engine's speculative decoding;
        `resume_tokens=` the output so far of a request begun on another engine (stream migration:
        they count as generated, come back in its result but are not streamed again); `lora=` a LoRA
        adapter (`load_lora`'s name, or a PEFT adapter folder) the request runs with (enable_lora);
        `pooling="mean"` or `"last"` makes it an embedding request: its prompt is computed, nothing
        generated, and its final output carries `embedding` (`workers/pooling.py`)."""
        return self._submit([(input_ids, request_id)], max_new_tokens, streaming, record_timestamps, eos_token_id,
                            logit_processor_kwargs)[0]

    def add_requests(self, inputs: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                     streaming: bool = False, record_timestamps: bool = False, **kwargs: Any) -> list[str]:
        """Submit many prompts, those sharing prefixes next to each other (more prefix-cache
        hits); returns ids in input order. One bad prompt refuses them all."""
        kwargs.pop("request_id", None)
        eos_token_id = kwargs.pop("eos_token_id", None)
        return self._submit([(p, None) for p in inputs], max_new_tokens, streaming, record_timestamps, eos_token_id,
                            kwargs, group_prefixes=True)

    def _submit(self, prompts: list[tuple[Any, str | None]], max_new_tokens: int | None, streaming: bool,
                record_timestamps: bool, eos_token_id: int | list[int] | None, sampling_args: dict,
                group_prefixes: bool = False) -> list[str]:
        with self._cond:
            if not self._loop.state.accepting:
                given = [rid for _, rid in prompts if rid is not None]
                logger.warning("add_request refused%s: the manager is %s", f" ({', '.join(given)})" if given else "",
                               "destroyed" if self._loop.state is LoopState.DESTROYED else "stopped")
                raise self._loop.refusal()
            grammar = sampling_args.pop("grammar", None)  # structured outputs: StructuredOutputs.compile()
            pooling = sampling_args.pop("pooling", None)  # an embedding request (workers/pooling.py)
            cache_salt = validation.cache_salt(sampling_args.pop("cache_salt", None))  # prefix-cache isolation
            speculative = validation.speculative(sampling_args.pop("speculative", True))
            resume_tokens = sampling_args.pop("resume_tokens", None)  # stream migration: Request.resume
            lora = sampling_args.pop("lora", None)  # a LoRA adapter's name or folder
            share = validation.scheduling(self.config.priority_scheduling, **{
                k: sampling_args.pop(k) for k in validation.SCHEDULING_FIELDS if k in sampling_args})
            sampling = self._sampling(sampling_args)
            self._check_queue_room(len(prompts))
            requests: list[Request] = []
            new_ids: set[str] = set()
            for input_ids, request_id in prompts:
                request_id = self._new_request_id(new_ids) if request_id is None else request_id
                validation.request_id(request_id, self._live.keys() | new_ids)
                if isinstance(input_ids, torch.Tensor):
                    input_ids = input_ids.tolist()
                requests.append(self.engine.make_request(
                    list(input_ids) if isinstance(input_ids, Sequence) else input_ids, request_id,
                    max_new_tokens, streaming, eos_token_id, sampling, grammar, resume_tokens, lora, pooling,
                ))
                for name, value in share.items():  # priority, tenant, parent_id (fair_share.py)
                    setattr(requests[-1], name, value)
                requests[-1].cache_salt = cache_salt
                requests[-1].speculative = speculative
                new_ids.add(request_id)
            # All valid: queue them, prompts sharing prefixes next to each other.
            self._loop.queue(sorted(requests, key=lambda r: r.prompt_ids) if group_prefixes else requests,
                             record_timestamps)
        return [r.request_id for r in requests]

    # -- LoRA adapters -----------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Read the PEFT adapter folder `path` (enable_lora) into host memory; requests then name it
        with `lora=name`. It becomes resident (one of `max_loras`) when a step needs it."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; refused (`InvalidRequestError`) while an unfinished request uses it."""
        with self._cond:  # no request for it can be submitted meanwhile
            self.engine.unload_lora(name, list(self._live.values()))

    def list_loras(self) -> dict[str, str]:
        """Loaded adapters: name -> folder."""
        return self.engine.list_loras()

    def next_request_ids(self, count: int) -> list[str]:
        """Reserve `count` ids of the kind `add_request` gives ("req_<n>"), for requests added later."""
        with self._cond:
            return [self._new_request_id(set()) for _ in range(count)]  # the counter never repeats

    def _new_request_id(self, taken: set[str]) -> str:
        """The next "req_<n>" (transformers' ids) that no live request holds."""
        while True:
            request_id = f"req_{self._next_id}"
            self._next_id += 1
            if request_id not in self._live and request_id not in taken:
                return request_id

    def _check_queue_room(self, count: int) -> None:
        limit = self.config.max_queue_size
        if not limit:
            return
        waiting = self._loop.num_waiting
        if waiting + count > limit:
            raise QueueFullError(limit, waiting)

    def cancel_request(self, request_id: str) -> None:
        """Stop the request at the next step and free its pages; no-op if unknown or done."""
        self._loop.cancel(request_id)

    def _sampling(self, kwargs: dict[str, Any]) -> SamplingParams | None:
        unknown = sorted(set(kwargs) - _sampling_arguments())
        if unknown:
            raise TypeError(f"add_request() got unexpected keyword arguments {unknown}; per-request sampling "
                            f"arguments are {sorted(_sampling_arguments())}")
        return validation.sampling(self.engine.default_sampling(), self.config.per_request_processors,
                                   self.engine.vocab_size, **kwargs)

    # -- results -----------------------------------------------------------------------------

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (only `request_id`'s when given); None after `timeout`, and at once when
        none is stored and none can come: the loop is not running (never started, stopped,
        destroyed, dead), or `request_id` is not a live request."""
        return self._outputs.get(request_id, timeout, hopeless=functools.partial(self._loop.hopeless, request_id))

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], Any]) -> None:
        """From a coroutine: every output of `request_id` (each token when streaming, else the final
        one) goes to `callback`, called on this event loop, instead of `get_result`; the handler
        goes with the final output."""
        self._outputs.register_handler(request_id, callback, asyncio.get_running_loop())

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or self._outputs.has_output():
            output = self._outputs.get(timeout=0.1)
            if output is not None:
                yield output

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Every output of one request (each new token when streaming), ending with the final one."""
        while self._loop.may_have_more(request_id):
            output = self._outputs.get(request_id, timeout=0.1)
            if output is None:
                continue
            yield output
            if output.is_finished():
                return

    async def async_request_iter(self, request_id: str) -> AsyncIterator[GenerationOutput]:
        """`request_id_iter` for asyncio. If the consumer goes away first (cancelled task,
        closed generator), the request is cancelled and its pages freed."""
        async with aclosing(self.async_request_batches(request_id)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def async_request_batches(self, request_id: str) -> AsyncIterator[list[GenerationOutput]]:
        """`async_request_iter` by the batch: every output of `request_id` that is ready when the
        consumer asks (one per engine step it missed), at once, the final one last. Cancels the
        request if the consumer goes away first."""
        finished = exhausted = False
        try:
            while self._loop.may_have_more(request_id):
                # The store wakes this when the loop ends; the timeout is a backstop.
                batch = await self._outputs.get_all_async(request_id, timeout=1.0)
                if not batch:
                    continue
                finished = batch[-1].is_finished()
                yield batch
                if finished:
                    return
            exhausted = True  # the loop is not running: nothing more can come now
        finally:
            if not finished and not exhausted:
                self._loop.abandon(request_id)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + output one request may have: the model's context or the KV cache's
        pages, the smaller (what the OpenAI server reports as `max_model_len`)."""
        return min(self.engine.max_context, self.engine.capacity_tokens)

    def check_health(self) -> None:
        """Raise RuntimeError when this manager cannot serve: stopped, its loop died, or its
        engine broken (a tensor-parallel rank died or hung)."""
        self._loop.check_health()

    def stats(self) -> dict[str, float]:
        stats = self.engine.stats()
        stats["live_requests"] = len(self._live)
        return stats
