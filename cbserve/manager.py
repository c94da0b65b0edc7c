"""The online API: a manager owning one engine and the background thread running its loop.

Callers talk to the loop through a command inbox (add, cancel) and an output store; the loop
sleeps on a condition when idle and wakes on new work, a pause or a stop. The semantics are
transformers' (`generation/continuous_batching/continuous_api.py`): requests may be queued
before `start()`; `stop()` finishes queued and running work (or, with `hard_stop`, fails it) and
gives the model back its own attention implementation and modules, which `start()` takes again;
`pause()` parks the loop between two steps, with the model given back, keeping the cache and the
requests in flight; `destroy()` stops gracefully, then frees the cache for good.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

import torch
from transformers import GenerationConfig

from cbserve import config as engine_config
from cbserve.config import ContinuousBatchingConfig
from cbserve.errors import QueueFullError
from cbserve.output_store import OutputStore
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus, TokenClock
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.workers import validation
from cbserve.workers.factory import build_engine
from cbserve.workers.sizing import Workload

logger = logging.getLogger(__name__)

MODEL_ATTRIBUTE = "_cbserve_manager"  # where a persistent manager waits on its model for the next session
WARMUP_REQUEST_ID = "cbserve-warmup"
MAX_FAILED_STEPS = 3  # engine faults in a row after which the loop ends (every step failing: a broken engine)


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
        self._outputs = OutputStore()
        self._clock = TokenClock()
        # An RLock: cancel_request may be called with it held (async_request_iter).
        self._cond = threading.Condition(threading.RLock())
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_adds = 0
        # Accepted and without a final output yet. A request leaves this dict after its final
        # output is stored, in one critical section: "not live and nothing stored" means its
        # outputs were all handed out.
        self._live: dict[str, Request] = {}
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()  # start/stop/destroy from several threads
        self._loop_running = False
        self._started = False
        self._accepting = True  # requests may be queued before start()
        self._stopping = False
        self._hard_stop = False
        self._grace_expired = False  # a stop(timeout=...) returned with the loop still finishing
        self._destroyed = False
        self._pauses = 0
        self._paused = False
        self._pause_holders = threading.local()
        self.warmed_up = False
        self.error: BaseException | None = None
        # A step that failed through no request's fault (kernel, device, TP group): the engine is
        # suspect for good, so check_health() fails and Serve replaces a served replica.
        self.engine_fault: BaseException | None = None
        self._failed_steps = 0  # in a row; at MAX_FAILED_STEPS the loop ends instead of failing all it is sent
        self._step_began: float | None = None  # the step watchdog's clock (time.monotonic)

    @property
    def continuous_batching_config(self) -> ContinuousBatchingConfig:
        return self.config

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background loop (taking the model: cbserve's attention, packed linears)."""
        with self._lifecycle:
            if self._destroyed:
                raise RuntimeError("this manager was destroyed and cannot be restarted")
            if self.is_running() and not self._stopping:
                logger.warning("Manager thread is already running.")
                return
            if self._thread is not None:  # a stop that had not finished yet
                self._thread.join()
                self._thread = None
            self.engine.take_model()
            with self._cond:
                self._accepting, self._stopping, self._hard_stop = True, False, False
                self._loop_running = self._started = True
            self._grace_expired = False
            self.error = self.engine_fault = None
            self._failed_steps = 0
            self._thread = threading.Thread(target=self._loop, name="cbserve-batching-loop", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Refuse new work; finish everything queued and running (with `hard_stop`: fail it with a
        RuntimeError now); then the loop ends and gives the model back its own attention
        implementation and modules. `block`: wait for that, `timeout` seconds at most.
        `keep_for_next_session`: the manager stays on the model, for the next
        `init_continuous_batching` / `continuous_batching(..., persistent_manager=True)`."""
        if getattr(self._pause_holders, "count", 0):
            raise RuntimeError("Cannot stop the manager from inside a pause: the generation loop is paused and cannot "
                               "exit, so this would wait forever. Leave the `pause` context before calling `stop`.")
        with self._lifecycle:
            if self._thread is None:
                if not self._started:
                    logger.warning("Manager not started.%s", " Hence the unstarted manager will not be kept for "
                                   "next session." if keep_for_next_session else "")
                elif keep_for_next_session:
                    self._keep_on_model()
                return
            with self._cond:
                self._accepting = False
                self._stopping = True
                self._hard_stop = self._hard_stop or hard_stop
                self._cond.notify_all()
        if block:
            self.join(time.perf_counter(), timeout)
        if keep_for_next_session:
            self._keep_on_model()
        if hard_stop and self._thread is None:  # no loop runs now: fail what it left (nothing, unless it died)
            self._fail_everything(RuntimeError("the manager was hard-stopped"))

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait for the loop thread to end, `timeout` seconds at most (None: no limit)."""
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("Generation thread did not exit after join timeout (%s).", timeout)
            self._grace_expired = self._grace_expired or (timeout is not None and self._stopping)
            return
        if stop_trigger_time is not None:
            logger.info("Background generation thread stopped after %.2fs.", time.perf_counter() - stop_trigger_time)
        with self._lifecycle:
            if self._thread is thread:
                self._thread = None

    def destroy(self, timeout: float | None = None) -> None:
        """Stop gracefully if running (waiting `timeout` seconds at most, then hard-stopping; a loop
        already given a grace period by `stop(timeout=...)` is hard-stopped at once), give the model
        back, free the KV cache. Safe to call twice; the manager cannot be restarted."""
        if self._destroyed:
            return
        if getattr(self._pause_holders, "count", 0):
            raise RuntimeError("Cannot destroy the manager from inside a pause: leave the `pause` context first.")
        if self.is_running():
            self.stop(block=True, timeout=timeout, hard_stop=self._stopping and self._grace_expired)
            if self.is_running():
                self.stop(block=True, hard_stop=True)
        self.join()
        with self._lifecycle:
            if self._destroyed:
                return
            # Requests queued but never started: nothing will run them.
            self._fail_everything(RuntimeError("the manager was destroyed before these requests ran"))
            self.engine.release_model()
            with self._cond:
                self._destroyed, self._accepting = True, False
            self.engine.cache.k.clear()
            self.engine.cache.v.clear()
            if getattr(self.model, MODEL_ATTRIBUTE, None) is self:
                delattr(self.model, MODEL_ATTRIBUTE)
        self._outputs.wake()

    def _keep_on_model(self) -> None:
        logger.info("Continuous batching manager will be kept for next session.")
        setattr(self.model, MODEL_ATTRIBUTE, self)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Park the loop between two steps, the model given back to the caller (its own attention
        implementation and linear layers: to use it or update its weights in place), keeping the
        cache and every request in flight; the loop takes the model again (packing the weights
        afresh) and resumes on exit. Several threads may hold the pause at once: the loop resumes
        when the last one leaves."""
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        with self._cond:
            self._pauses += 1
            self._pause_holders.count = getattr(self._pause_holders, "count", 0) + 1
            self._cond.notify_all()
            try:
                while not self._paused and self._loop_running:
                    self._cond.wait()
            except BaseException:
                self._release_pause()
                raise
            if not self._paused:
                self._release_pause()
                raise RuntimeError("The generation loop stopped before it could pause.") from self.error
        try:
            yield
        finally:
            with self._cond:
                self._release_pause()

    def _release_pause(self) -> None:
        self._pauses -= 1
        self._pause_holders.count -= 1
        self._cond.notify_all()

    def warmup(self) -> None:
        """Compile and capture CUDA graphs ahead, when those are on: one request of
        `max_batch_tokens` prompt tokens and 2 new tokens runs through the engine (a varlen step,
        then a decode step). Nothing to do otherwise. Call it before `start()`."""
        engine = self.engine
        if engine.runner.graphs is None and not engine.runner.forward.enabled:
            self.warmed_up = True
            return
        if self.is_running() or engine.has_work:
            logger.warning("warmup() skipped: the loop is running or the engine holds requests; graphs are captured "
                           "and code compiled as requests run")
            return
        length = min(engine.max_batch_tokens, engine.capacity_tokens - 2, engine.shape.max_context - 2)
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
        top_k, top_p, seed, penalties, logit_bias, min_tokens, top_logprobs, prompt_logprobs, ...:
        `validation.OPTIONS`), with `per_request_processors=True`; `grammar=` a constraint compiled
        by `cbserve.StructuredOutputs`; `priority=` (vLLM's: lower runs first), `tenant=` and
        `parent_id=` (requests sharing one are one API call's choices) for the engine's fair share;
        `cache_salt=` (vLLM's: a string; prefix pages are shared only among requests of one salt)."""
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
            if not self._accepting:
                given = [rid for _, rid in prompts if rid is not None]
                logger.warning("add_request refused%s: the manager is %s", f" ({', '.join(given)})" if given else "",
                               "destroyed" if self._destroyed else "stopped")
                if self._failed_steps >= MAX_FAILED_STEPS:
                    raise RuntimeError(f"the batching loop stopped: its engine failed {self._failed_steps} steps in a "
                                       f"row (last: {self.engine_fault!r}); start() it again or replace it")
                raise RuntimeError("the manager is stopped: call start() before adding requests")
            grammar = sampling_args.pop("grammar", None)  # structured outputs: StructuredOutputs.compile()
            cache_salt = validation.cache_salt(sampling_args.pop("cache_salt", None))  # prefix-cache isolation
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
                    max_new_tokens, streaming, eos_token_id, sampling, grammar,
                ))
                for name, value in share.items():  # priority, tenant, parent_id (fair_share.py)
                    setattr(requests[-1], name, value)
                requests[-1].cache_salt = cache_salt
                new_ids.add(request_id)
            # All valid: queue them, prompts sharing prefixes next to each other.
            queued = sorted(requests, key=lambda r: r.prompt_ids) if group_prefixes else requests
            for request in queued:
                self._live[request.request_id] = request
                if record_timestamps:
                    self._clock.track(request.request_id)
                self._inbox.append(("add", request))
            self._inbox_adds += len(queued)
            self._cond.notify_all()
        return [r.request_id for r in requests]

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
        waiting = self._inbox_adds + len(self.engine.scheduler.waiting)
        if waiting + count > limit:
            raise QueueFullError(limit, waiting)

    def cancel_request(self, request_id: str) -> None:
        """Stop the request at the next step and free its pages; no-op if unknown or done."""
        with self._cond:
            if request_id in self._live:
                self._inbox.append(("cancel", request_id))
                self._cond.notify_all()

    def _sampling(self, kwargs: dict[str, Any]) -> SamplingParams | None:
        unknown = sorted(set(kwargs) - _sampling_arguments())
        if unknown:
            raise TypeError(f"add_request() got unexpected keyword arguments {unknown}; per-request sampling "
                            f"arguments are {sorted(_sampling_arguments())}")
        return validation.sampling(self.engine.default_sampling(), self.config.per_request_processors,
                                   self.engine.shape.vocab_size, **kwargs)

    # -- results -----------------------------------------------------------------------------

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (only `request_id`'s when given); None after `timeout`, and at once when
        none is stored and none can come: the loop is not running (never started, stopped,
        destroyed, dead), or `request_id` is not a live request."""
        return self._outputs.get(request_id, timeout, hopeless=functools.partial(self._hopeless, request_id))

    def _hopeless(self, request_id: str | None) -> bool:
        # Lock-free reads (called under the store's lock): _emit stores a final output before the
        # request leaves _live, so "not live" here means its outputs are stored or handed out.
        return not self._loop_running or (request_id is not None and request_id not in self._live)

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

    def _may_have_more(self, request_id: str) -> bool:
        with self._cond:
            live = request_id in self._live and self._loop_running
            return live or self._outputs.has_output(request_id)

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Every output of one request (each new token when streaming), ending with the final one."""
        while self._may_have_more(request_id):
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
            while self._may_have_more(request_id):
                # The store wakes this when the loop ends (`_loop_finished`); the timeout is a backstop.
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
                with self._cond:  # atomic with _emit: a final output is either dropped or never stored
                    self.cancel_request(request_id)
                    self._outputs.discard(request_id, finished=request_id not in self._live)

    def check_health(self) -> None:
        """Raise RuntimeError when this manager cannot serve: stopped, its loop died, or its
        engine broken (a tensor-parallel rank died or hung)."""
        if self._destroyed:
            raise RuntimeError("the manager was destroyed")
        if not self.is_running():
            raise RuntimeError(f"the batching loop is not running ({self.error!r})")
        if self.engine_fault is not None:
            raise RuntimeError(f"the engine failed a step: {self.engine_fault!r}")
        began, limit = self._step_began, self.config.step_timeout_s
        if began is not None and limit is not None and time.monotonic() - began > limit:
            raise RuntimeError(f"the engine's step has run for {time.monotonic() - began:.0f} s, "
                               f"beyond step_timeout_s={limit:g}")
        self.engine.check_health()

    def stats(self) -> dict[str, float]:
        stats = self.engine.stats()
        stats["live_requests"] = len(self._live)
        return stats

    # -- the loop (background thread) --------------------------------------------------------

    def _emit(self, request: Request) -> None:
        """Hand out a final output (exactly once) or a streaming partial one."""
        final = request.status.is_final
        if not final and not request.streaming:
            return
        with self._cond:
            if self._live.get(request.request_id) is not request:  # its final output went out
                return
            self._outputs.put(self._clock.stamp(request.snapshot()))
            if final:
                del self._live[request.request_id]

    def _fail_everything(self, error: BaseException) -> None:
        """Fail every live request (in the inbox or the engine) with `error`, freeing its pages.
        Called by the loop thread, or by another thread when no loop runs."""
        with self._cond:
            self._inbox, self._inbox_adds = [], 0  # every queued add is in _live; queued cancels are moot
            live = list(self._live.values())
        try:
            self.engine.fail_all(error)
        except Exception:
            logger.exception("failing the engine's requests failed; pages may leak")
        for request in live:
            if not request.status.is_final:
                request.finish(RequestStatus.FAILED, FinishReason.ERROR, error)
            self._emit(request)

    def _apply_inbox(self) -> None:
        with self._cond:
            inbox, self._inbox, self._inbox_adds = self._inbox, [], 0
        for kind, item in inbox:
            if kind == "add":
                try:
                    self.engine.add_request(item)
                except Exception as error:  # this request's admission failed: it alone fails
                    logger.exception("admitting request %s failed", item.request_id)
                    self.engine.fail_request(item, error)
                    self._emit(item)
            else:
                request = self.engine.cancel_request(item)
                if request is not None:
                    self._emit(request)

    def _loop(self) -> None:
        try:
            while self._run_once():
                pass
        except BaseException as error:  # the thread dies: nobody may wait forever
            logger.exception("batching loop died; failing every live request")
            with self._cond:
                self._accepting = False
            self.error = error
            self._fail_everything(RuntimeError(f"the batching loop died: {error!r}"))
        finally:
            self._loop_finished()

    def _loop_finished(self) -> None:
        """The loop gives the model back, then wakes whoever waits for it (pause, get_result)."""
        try:
            self.engine.give_back_model()
        except Exception:
            logger.exception("giving the model back failed")
        with self._cond:
            self._loop_running = self._paused = False
            self._cond.notify_all()
        self._outputs.wake()

    def _run_once(self) -> bool:
        """One turn of the loop: apply adds and cancels, run one step. False: the loop ends."""
        with self._cond:
            while not (self._inbox or self.engine.has_work or self._stopping or self._pauses):
                self._cond.wait()
            hard, stopping, pause = self._hard_stop, self._stopping, self._pauses > 0
        if hard:
            self._fail_everything(RuntimeError("the manager was hard-stopped"))
            return False
        if pause:
            self._park()
            return True
        try:
            self._apply_inbox()
            if not self.engine.has_work:
                with self._cond:
                    return not (stopping and not self._inbox)
            self._step_began = time.monotonic()
            updated = self.engine.step()
            self._step_began, self._failed_steps = None, 0
            self._clock.tick(updated)
            for request in updated:
                self._emit(request)
        except Exception as error:  # not one request's fault: fail what was live, report unhealthy
            self._step_began = None
            self._failed_steps += 1
            logger.exception("engine step failed (%d in a row); failing every live request", self._failed_steps)
            return self._engine_failed(error)
        return True

    def _engine_failed(self, error: Exception) -> bool:
        """A step failed outside any one request: every live request fails and check_health()
        fails from now on. The loop keeps serving, unless MAX_FAILED_STEPS failed in a row: a
        broken engine then stops, loudly, rather than failing everything it is sent."""
        self.error = self.engine_fault = error
        ending = self._failed_steps >= MAX_FAILED_STEPS
        if ending:
            logger.error("the batching loop stops: its engine failed %d steps in a row", self._failed_steps)
            with self._cond:
                self._accepting = False
        self._fail_everything(error)
        return not ending

    def _park(self) -> None:
        """Pause: give the model back, wait until every holder left, take it again."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)  # a launched pass must not read weights being updated
        self.engine.give_back_model()
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while self._pauses:
                self._cond.wait()
            self._paused = False
        self.engine.take_model()
