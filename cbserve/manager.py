"""The online API: a manager owning one engine and the background thread running its loop.

Callers talk to the loop through a command queue (add, cancel) and an output store; the loop
sleeps on a condition when idle and wakes on new work.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import torch
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.output_store import OutputStore
from cbserve.outputs import FinishReason, GenerationOutput, RequestStatus
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.workers import validation
from cbserve.workers.factory import build_engine

logger = logging.getLogger(__name__)


class ContinuousBatchingManager:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.model = model
        self.engine = build_engine(model, generation_config, continuous_batching_config)
        self.config = self.engine.config
        self._outputs = OutputStore()
        # An RLock: cancel_request may be called with it held (async_request_iter).
        self._cond = threading.Condition(threading.RLock())
        self._inbox: list[tuple[str, object]] = []
        # Accepted and without a final output yet. A request leaves this dict in the same
        # critical section that stores its final output, so "not live and nothing stored"
        # means its outputs were all handed out.
        self._live: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()  # start/stop/destroy from several threads
        self._accepting = False
        self._stopping = False
        self._hard_stop = False
        self._destroyed = False
        self.error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._lifecycle:
            if self._destroyed:
                raise RuntimeError("this manager was destroyed and cannot be restarted")
            with self._cond:
                if self.is_running() and not self._stopping:
                    return
            if self._thread is not None:  # a stop(timeout=...) that had not finished yet
                self._thread.join()
                self._thread = None
            with self._cond:
                self._accepting, self._stopping, self._hard_stop = True, False, False
            self.error = None
            self._thread = threading.Thread(target=self._loop, name="cbserve-batching-loop", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, hard_stop: bool = False, timeout: float | None = None) -> None:
        """Refuse new work; finish everything queued and running (or, with `hard_stop`, fail
        it with a RuntimeError now); then end the loop thread."""
        with self._lifecycle:
            with self._cond:
                self._accepting = False
                self._stopping = True
                self._hard_stop = self._hard_stop or hard_stop
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    logger.warning("batching loop still running after stop(timeout=%s)", timeout)
                    return
                self._thread = None
            if hard_stop:  # no loop runs now: fail whatever it left (nothing, unless it died)
                self._fail_everything(RuntimeError("the manager was hard-stopped"))

    def destroy(self) -> None:
        """Hard-stop if running and free the KV cache; the manager cannot be restarted."""
        if self._destroyed:
            return
        self.stop(hard_stop=True)
        with self._lifecycle:
            if self._destroyed:
                return
            self.engine.release_model()
            self._destroyed = True
            self.engine.cache.k.clear()
            self.engine.cache.v.clear()
            if getattr(self.model, "_cbserve_manager", None) is self:
                del self.model._cbserve_manager

    # -- submitting --------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: Sequence[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError here and
        queues nothing; a stopped manager raises RuntimeError."""
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        return self._submit([(input_ids, request_id)], max_new_tokens, streaming, eos_token_id, sampling)[0]

    def add_requests(self, inputs: Sequence[Sequence[int]], **kwargs) -> list[str]:
        """Submit many prompts, those sharing prefixes next to each other (more prefix-cache
        hits); returns ids in input order. One bad prompt refuses them all."""
        kwargs.pop("request_id", None)
        sampling = {k: kwargs.pop(k, None) for k in ("temperature", "top_k", "top_p", "seed")}
        return self._submit([(p, None) for p in inputs], kwargs.pop("max_new_tokens", None),
                            kwargs.pop("streaming", False), kwargs.pop("eos_token_id", None), sampling,
                            group_prefixes=True, **kwargs)

    def _submit(self, prompts: list[tuple[Sequence[int], str | None]], max_new_tokens: int | None,
                streaming: bool, eos_token_id: int | list[int] | None, sampling_args: dict,
                group_prefixes: bool = False, **unexpected) -> list[str]:
        if unexpected:
            raise TypeError(f"unexpected arguments: {sorted(unexpected)}")
        with self._cond:
            if not self._accepting:
                given = [rid for _, rid in prompts if rid is not None]
                logger.warning("add_request refused%s: the manager is %s", f" ({', '.join(given)})" if given else "",
                               "destroyed" if self._destroyed else "stopped")
                raise RuntimeError("the manager is stopped: call start() before adding requests")
            sampling = self._sampling(**sampling_args)
            requests: list[Request] = []
            new_ids: set[str] = set()
            for input_ids, request_id in prompts:
                if request_id is None:
                    request_id = f"req_{uuid.uuid4().hex[:12]}"
                validation.request_id(request_id, self._live.keys() | new_ids)
                if isinstance(input_ids, torch.Tensor):
                    input_ids = input_ids.tolist()
                requests.append(self.engine.make_request(
                    list(input_ids) if isinstance(input_ids, Sequence) else input_ids, request_id,
                    max_new_tokens, streaming, eos_token_id, sampling,
                ))
                new_ids.add(request_id)
            # All valid: queue them, prompts sharing prefixes next to each other.
            queued = sorted(requests, key=lambda r: r.prompt_ids) if group_prefixes else requests
            for request in queued:
                self._live[request.request_id] = request
                self._inbox.append(("add", request))
            self._cond.notify_all()
        return [r.request_id for r in requests]

    def cancel_request(self, request_id: str) -> None:
        """Stop the request at the next step and free its pages; no-op if unknown or done."""
        with self._cond:
            if request_id in self._live:
                self._inbox.append(("cancel", request_id))
                self._cond.notify_all()

    def _sampling(self, temperature, top_k, top_p, seed) -> SamplingParams | None:
        return validation.sampling(self.engine.default_sampling(), self.config.per_request_processors,
                                   temperature, top_k, top_p, seed)

    # -- results -----------------------------------------------------------------------------

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (only `request_id`'s when given); None after `timeout`."""
        return self._outputs.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or self._outputs.has_output():
            output = self._outputs.get(timeout=0.1)
            if output is not None:
                yield output

    def _may_have_more(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._live or self._outputs.has_output(request_id)

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
        finished = False
        try:
            while self._may_have_more(request_id):
                output = await self._outputs.get_async(request_id, timeout=0.1)
                if output is None:
                    continue
                finished = output.is_finished()
                yield output
                if finished:
                    return
        finally:
            if not finished:
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
        self.engine.check_health()

    def stats(self) -> dict[str, int]:
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
            if final:
                del self._live[request.request_id]
            self._outputs.put(request.snapshot())

    def _fail_everything(self, error: BaseException) -> None:
        """Fail every live request (in the inbox or the engine) with `error`, freeing its pages.
        Called by the loop thread, or by another thread when no loop runs."""
        with self._cond:
            self._inbox = []  # every queued add is in _live; queued cancels are moot
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
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                self.engine.add_request(item)
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

    def _run_once(self) -> bool:
        """One turn of the loop: apply adds and cancels, run one step. False: the loop ends."""
        with self._cond:
            while not self._inbox and not self.engine.has_work and not self._stopping:
                self._cond.wait()
            hard, stopping = self._hard_stop, self._stopping
        if hard:
            self._fail_everything(RuntimeError("the manager was hard-stopped"))
            return False
        try:
            self._apply_inbox()
            if not self.engine.has_work:
                with self._cond:
                    return not (stopping and not self._inbox)
            for request in self.engine.step():
                self._emit(request)
        except Exception as error:  # fail what was live; the loop keeps serving
            logger.exception("batching loop failed; failing every live request")
            self.error = error
            self._fail_everything(error)
        return True
