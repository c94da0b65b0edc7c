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
from cbserve.workers.engine import EngineCore

logger = logging.getLogger(__name__)


def validate_sampling(temperature: float | None, top_k: int | None, top_p: float | None,
                      seed: int | None) -> None:
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer, got {seed!r}")


class ContinuousBatchingManager:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.model = model
        self.engine = EngineCore(model, generation_config, continuous_batching_config)
        self.config = self.engine.config
        self._outputs = OutputStore()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._live: set[str] = set()  # accepted and not yet final
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stopping = False
        self._hard_stop = False
        self._destroyed = False
        self.error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._destroyed:
            raise RuntimeError("this manager was destroyed and cannot be restarted")
        if self.is_running():
            return
        self._accepting, self._stopping, self._hard_stop = True, False, False
        self._thread = threading.Thread(target=self._loop, name="cbserve-batching-loop", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, hard_stop: bool = False, timeout: float | None = None) -> None:
        """Refuse new work; finish everything queued and running (or, with `hard_stop`, fail
        it with a RuntimeError now); then end the loop thread."""
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
        if hard_stop:  # requests added while no thread ran
            self._fail_inbox(RuntimeError("the manager was hard-stopped"))

    def destroy(self) -> None:
        """Hard-stop if running and free the KV cache; the manager cannot be restarted."""
        if self._destroyed:
            return
        self.stop(hard_stop=True)
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
        """Validate and queue a request; returns its id. Bad input raises ValueError here."""
        sampling = self._sampling(temperature, top_k, top_p, seed)
        request_id = request_id if request_id is not None else f"req_{uuid.uuid4().hex[:12]}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        with self._cond:
            if not self._accepting:
                logger.warning("add_request(%s) refused: the manager is not running", request_id)
                raise RuntimeError("the manager is stopped: call start() before adding requests")
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use by a live request")
            request = self.engine.make_request(
                list(input_ids) if not isinstance(input_ids, list) else input_ids, request_id,
                max_new_tokens, streaming, eos_token_id, sampling,
            )
            self._live.add(request_id)
            self._inbox.append(("add", request))
            self._cond.notify_all()
        return request_id

    def add_requests(self, inputs: Sequence[Sequence[int]], **kwargs) -> list[str]:
        """Submit many prompts, those sharing prefixes next to each other (more prefix-cache
        hits); returns ids in input order."""
        kwargs.pop("request_id", None)
        order = sorted(range(len(inputs)), key=lambda i: list(inputs[i]))
        ids: list[str | None] = [None] * len(inputs)
        for i in order:
            ids[i] = self.add_request(inputs[i], **kwargs)
        return ids  # type: ignore[return-value]

    def cancel_request(self, request_id: str) -> None:
        """Stop the request at the next step and free its pages; no-op if unknown or done."""
        with self._cond:
            if request_id in self._live:
                self._inbox.append(("cancel", request_id))
                self._cond.notify_all()

    def _sampling(self, temperature, top_k, top_p, seed) -> SamplingParams | None:
        given = any(v is not None for v in (temperature, top_k, top_p, seed))
        if not given:
            return None
        if not self.config.per_request_processors:
            raise ValueError(
                "temperature/top_k/top_p/seed per request need per_request_processors=True in the "
                "ContinuousBatchingConfig"
            )
        validate_sampling(temperature, top_k, top_p, seed)
        base = self.engine.default_sampling()
        return SamplingParams(
            do_sample=True,
            temperature=base.temperature if temperature is None else float(temperature),
            top_k=base.top_k if top_k is None else top_k,
            top_p=base.top_p if top_p is None else float(top_p),
            seed=seed,
        )

    # -- results -----------------------------------------------------------------------------

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (only `request_id`'s when given); None after `timeout`."""
        return self._outputs.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or self._outputs.has_output():
            output = self._outputs.get(timeout=0.1)
            if output is not None:
                yield output

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Every output of one request (each new token when streaming), ending with the final one."""
        while request_id in self._live or self._outputs.has_output(request_id):
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
            while request_id in self._live or self._outputs.has_output(request_id):
                output = await self._outputs.get_async(request_id)
                finished = output.is_finished()
                yield output
                if finished:
                    return
        finally:
            if not finished:
                self.cancel_request(request_id)
                self._outputs.discard(request_id, finished=request_id not in self._live)

    def stats(self) -> dict[str, int]:
        stats = self.engine.stats()
        stats["live_requests"] = len(self._live)
        return stats

    # -- the loop (background thread) --------------------------------------------------------

    def _emit(self, request: Request) -> None:
        if request.status.is_final:
            with self._cond:
                self._live.discard(request.request_id)
            self._outputs.put(request.snapshot())
        elif request.streaming:
            self._outputs.put(request.snapshot())

    def _fail_inbox(self, error: BaseException) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                item.finish(RequestStatus.FAILED, FinishReason.ERROR, error)
                self._emit(item)

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
        while True:
            with self._cond:
                while not self._inbox and not self.engine.has_work and not self._stopping:
                    self._cond.wait()
                hard, stopping = self._hard_stop, self._stopping
            if hard:
                error = RuntimeError("the manager was hard-stopped")
                self._fail_inbox(error)
                for request in self.engine.fail_all(error):
                    self._emit(request)
                return
            self._apply_inbox()
            if not self.engine.has_work:
                if stopping and not self._inbox:
                    return
                continue
            try:
                updated = self.engine.step()
            except Exception as error:  # nobody waits forever: fail what was running
                logger.exception("batching step failed; failing every live request")
                self.error = error
                updated = self.engine.fail_all(error)
            for request in updated:
                self._emit(request)

