"""The engine loop: the background thread that steps one engine, and its lifecycle.

Callers hand it work through an inbox (add, cancel) guarded by one condition; between two steps the
thread applies the inbox, steps the engine and stores the outputs (`OutputStore`); it sleeps on the
condition when idle, parks between two steps while a pause is held, and ends on a stop. Where it
stands in its life is one `LoopState`, moved only along `TRANSITIONS` (any other move raises
`IllegalTransition`). It asks the engine only what `EngineCore` offers for it (`has_work`, `step`,
`num_waiting`, `take_model`, `free_cache`, ...), never its parts. `ContinuousBatchingManager`
(manager.py) is the transformers-compatible facade over it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from cbserve.kernels import openmp
from cbserve.output_store import OutputStore
from cbserve.outputs import FinishReason, RequestStatus, TokenClock
from cbserve.scheduler.request import Request

if TYPE_CHECKING:
    from cbserve.workers.engine import EngineCore

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # engine faults in a row after which the loop ends (every step failing: a broken engine)


class LoopState(enum.Enum):
    IDLE = "idle"  # built, never started: requests may be queued for the first start()
    RUNNING = "running"  # the thread steps the engine; requests are accepted
    DRAINING = "draining"  # stop(): new work refused, what is queued and running finishes
    OVERDUE = "overdue"  # still draining after the grace a stop(timeout=...) gave: destroy() hard-stops at once
    ABORTING = "aborting"  # new work refused, what is left fails, then the thread ends (hard stop, death, MAX_FAILED_STEPS)
    STOPPED = "stopped"  # the thread ended: start() begins a new session
    DESTROYED = "destroyed"  # the model given back and the cache freed, for good

    @property
    def accepting(self) -> bool:
        return self in (LoopState.IDLE, LoopState.RUNNING)

    @property
    def looping(self) -> bool:
        """The loop thread runs (from start() until it has given the model back)."""
        return self in (LoopState.RUNNING, LoopState.DRAINING, LoopState.OVERDUE, LoopState.ABORTING)


# The legal moves. The thread ends only from a state that refuses work (RUNNING never goes to
# STOPPED), so no request can be accepted that no loop will run.
TRANSITIONS: dict[LoopState, frozenset[LoopState]] = {
    LoopState.IDLE: frozenset({LoopState.RUNNING, LoopState.DESTROYED}),
    LoopState.RUNNING: frozenset({LoopState.DRAINING, LoopState.ABORTING}),
    LoopState.DRAINING: frozenset({LoopState.OVERDUE, LoopState.ABORTING, LoopState.STOPPED}),
    LoopState.OVERDUE: frozenset({LoopState.ABORTING, LoopState.STOPPED}),
    LoopState.ABORTING: frozenset({LoopState.STOPPED}),
    LoopState.STOPPED: frozenset({LoopState.RUNNING, LoopState.DESTROYED}),
    LoopState.DESTROYED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A lifecycle move `TRANSITIONS` does not list: a bug in the caller, or a race it lost."""


def check_transition(old: LoopState, new: LoopState) -> None:
    """Staying in a state is always legal; any other move must be in `TRANSITIONS`."""
    if new is not old and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"the engine loop cannot go from {old.value} to {new.value}")


def lower_priority(nice: int) -> None:
    """Give the calling thread (Linux only: nice is per thread, and threads it creates inherit it) the
    nice value `nice` (0: left alone). A refusal is logged, never raised: only latency depends on it."""
    if nice <= 0:
        return
    if not sys.platform.startswith("linux"):  # elsewhere the id of a thread may name another process
        logger.warning("engine_nice=%d not applied: a nice value per thread is Linux's", nice)
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:  # not allowed (a container may forbid it)
        logger.warning("engine_nice=%d not applied to the engine thread: %r", nice, exc)


class EngineLoop:
    def __init__(self, engine: EngineCore, step_timeout_s: float | None = None, nice: int = 0) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s  # the step watchdog's limit (check_health)
        self.nice = nice  # the engine thread's (and so its OpenMP team's) nice value
        self.outputs = OutputStore()
        self.clock = TokenClock()
        # Guards the inbox, the live set and the state. An RLock: cancel() may be called with it held.
        self.cond = threading.Condition(threading.RLock())
        # Accepted and without a final output yet. A request leaves this dict after its final
        # output is stored, in one critical section: "not live and nothing stored" means its
        # outputs were all handed out.
        self.live: dict[str, Request] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_adds = 0
        self._state = LoopState.IDLE
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()  # start/stop/destroy from several threads
        self._pause_requests = 0  # pause() holders, all threads together: the loop parks while there is one
        self._parked = False  # the thread waits between two steps, the model given back
        self._pause_holders = threading.local()
        self.error: BaseException | None = None
        # A step that failed through no request's fault (kernel, device, TP group): the engine is
        # suspect for good, so check_health() fails and Serve replaces a served replica.
        self.engine_fault: BaseException | None = None
        self.failed_steps = 0  # in a row; at MAX_FAILED_STEPS the loop ends instead of failing all it is sent
        self._step_began: float | None = None  # the step watchdog's clock (time.monotonic)

    @property
    def state(self) -> LoopState:
        return self._state

    def _enter(self, state: LoopState) -> None:
        """Move to `state` (with `cond` held)."""
        check_transition(self._state, state)
        self._state = state

    # -- lifecycle (callers' threads) ---------------------------------------------------------

    def start(self) -> None:
        """Take the model (cbserve's attention, packed linears) and start the thread."""
        with self._lifecycle:
            if self._state is LoopState.DESTROYED:
                raise RuntimeError("this manager was destroyed and cannot be restarted")
            if self.is_running() and self._state is LoopState.RUNNING:
                logger.warning("Manager thread is already running.")
                return
            if self._thread is not None:  # a stop that had not finished yet
                self._thread.join()
                self._thread = None
            self.engine.take_model()
            with self.cond:
                self._enter(LoopState.RUNNING)
            self.error = self.engine_fault = None
            self.failed_steps = 0
            openmp.release_thread_team()  # the engine thread's OpenMP team is then the only one
            self._thread = threading.Thread(target=self._loop, name="cbserve-batching-loop", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, hard: bool = False) -> bool:
        """Refuse new work; the thread ends once what is queued and running finished (`hard`: at
        once, failing it). False when there is no thread to stop."""
        with self._lifecycle:
            if self._thread is None:
                return False
            with self.cond:
                if hard and self._state.looping:
                    self._enter(LoopState.ABORTING)
                elif self._state is LoopState.RUNNING:
                    self._enter(LoopState.DRAINING)
                self.cond.notify_all()
            return True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end, `timeout` seconds at most (None: no limit). True when a
        thread ended; a drain still running past `timeout` is marked OVERDUE."""
        thread = self._thread
        if thread is None:
            return False
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("Generation thread did not exit after join timeout (%s).", timeout)
            with self.cond:
                if timeout is not None and self._state is LoopState.DRAINING:
                    self._enter(LoopState.OVERDUE)
            return False
        with self._lifecycle:
            if self._thread is thread:
                self._thread = None
        return True

    def destroy(self) -> bool:
        """Fail what is still queued, give the model back for good, free the KV cache (the thread
        must have ended). False when already destroyed."""
        with self._lifecycle:
            if self._state is LoopState.DESTROYED:
                return False
            check_transition(self._state, LoopState.DESTROYED)  # before anything is freed under a running thread
            self.fail_everything(RuntimeError("the manager was destroyed before these requests ran"))
            self.engine.release_model()
            with self.cond:
                self._enter(LoopState.DESTROYED)
            self.engine.free_cache()
        self.outputs.wake()
        return True

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Park the thread between two steps, the model given back, until the last holder leaves."""
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        with self.cond:
            self._pause_requests += 1
            self._pause_holders.count = getattr(self._pause_holders, "count", 0) + 1
            self.cond.notify_all()
            try:
                while not self._parked and self._state.looping:
                    self.cond.wait()
            except BaseException:
                self._release_pause()
                raise
            if not self._parked:
                self._release_pause()
                raise RuntimeError("The generation loop stopped before it could pause.") from self.error
        try:
            yield
        finally:
            with self.cond:
                self._release_pause()

    def _release_pause(self) -> None:
        self._pause_requests -= 1
        self._pause_holders.count -= 1
        self.cond.notify_all()

    def holds_pause(self) -> bool:
        """Whether this thread holds a pause (a stop or destroy from it would wait forever)."""
        return bool(getattr(self._pause_holders, "count", 0))

    # -- work (callers' threads) --------------------------------------------------------------

    def refusal(self) -> RuntimeError:
        """The error for a request refused because the state does not accept work."""
        if self.failed_steps >= MAX_FAILED_STEPS:
            return RuntimeError(f"the batching loop stopped: its engine failed {self.failed_steps} steps in a row "
                                f"(last: {self.engine_fault!r}); start() it again or replace it")
        return RuntimeError("the manager is stopped: call start() before adding requests")

    def queue(self, requests: list[Request], record_timestamps: bool = False) -> None:
        """Hand accepted requests to the thread, in this order (the caller checked `state.accepting`
        with `cond` held)."""
        with self.cond:
            for request in requests:
                self.live[request.request_id] = request
                if record_timestamps:
                    self.clock.track(request.request_id)
                self._inbox.append(("add", request))
            self._inbox_adds += len(requests)
            self.cond.notify_all()

    @property
    def num_waiting(self) -> int:
        """Requests queued and not running yet: in the inbox or waiting in the engine."""
        return self._inbox_adds + self.engine.num_waiting

    def cancel(self, request_id: str) -> None:
        """Stop the request at the next step and free its pages; no-op if unknown or done."""
        with self.cond:
            if request_id in self.live:
                self._inbox.append(("cancel", request_id))
                self.cond.notify_all()

    def abandon(self, request_id: str) -> None:
        """Its consumer went away: cancel it and drop its outputs, atomically with `_emit` (a final
        output is either dropped or never stored)."""
        with self.cond:
            self.cancel(request_id)
            self.outputs.discard(request_id, finished=request_id not in self.live)

    def hopeless(self, request_id: str | None) -> bool:
        """No output can come (for `request_id`, or at all): no thread runs, or it is not live."""
        # Lock-free reads (called under the store's lock): _emit stores a final output before the
        # request leaves `live`, so "not live" here means its outputs are stored or handed out.
        return not self._state.looping or (request_id is not None and request_id not in self.live)

    def may_have_more(self, request_id: str) -> bool:
        with self.cond:
            live = request_id in self.live and self._state.looping
            return live or self.outputs.has_output(request_id)

    def check_health(self) -> None:
        """Raise RuntimeError when it cannot serve: destroyed, stopped, its thread died, its engine
        failed a step or is broken (a tensor-parallel rank died or hung), or a step is stuck."""
        if self._state is LoopState.DESTROYED:
            raise RuntimeError("the manager was destroyed")
        if not self.is_running():
            raise RuntimeError(f"the batching loop is not running ({self.error!r})")
        if self.engine_fault is not None:
            raise RuntimeError(f"the engine failed a step: {self.engine_fault!r}")
        began, limit = self._step_began, self.step_timeout_s
        if began is not None and limit is not None and time.monotonic() - began > limit:
            raise RuntimeError(f"the engine's step has run for {time.monotonic() - began:.0f} s, "
                               f"beyond step_timeout_s={limit:g}")
        self.engine.check_health()

    # -- the thread ----------------------------------------------------------------------------

    def _emit(self, request: Request) -> None:
        """Hand out a final output (exactly once) or a streaming partial one."""
        final = request.status.is_final
        if not final and not request.streaming:
            return
        with self.cond:
            if self.live.get(request.request_id) is not request:  # its final output went out
                return
            self.outputs.put(self.clock.stamp(request.snapshot()))
            if final:
                del self.live[request.request_id]

    def fail_everything(self, error: BaseException) -> None:
        """Fail every live request (in the inbox or the engine) with `error`, freeing its pages.
        Called by the thread, or by another one when no thread runs."""
        with self.cond:
            self._inbox, self._inbox_adds = [], 0  # every queued add is in `live`; queued cancels are moot
            live = list(self.live.values())
        try:
            self.engine.fail_all(error)
        except Exception:
            logger.exception("failing the engine's requests failed; pages may leak")
        for request in live:
            if not request.status.is_final:
                request.finish(RequestStatus.FAILED, FinishReason.ERROR, error)
            self._emit(request)

    def _apply_inbox(self) -> None:
        with self.cond:
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
        lower_priority(self.nice)  # before the first parallel region: the OpenMP workers inherit it
        try:
            while self._run_once():
                pass
        except BaseException as error:  # the thread dies: nobody may wait forever
            logger.exception("batching loop died; failing every live request")
            with self.cond:
                self._enter(LoopState.ABORTING)
            self.error = error
            self.fail_everything(RuntimeError(f"the batching loop died: {error!r}"))
        finally:
            self._loop_finished()

    def _loop_finished(self) -> None:
        """The thread gives the model back, then wakes whoever waits for it (pause, get_result)."""
        try:
            self.engine.give_back_model()
        except Exception:
            logger.exception("giving the model back failed")
        with self.cond:
            self._enter(LoopState.STOPPED)
            self._parked = False
            self.cond.notify_all()
        self.outputs.wake()

    def _run_once(self) -> bool:
        """One turn: apply adds and cancels, run one step. False: the thread ends."""
        with self.cond:
            while not (self._inbox or self.engine.has_work or self._state is not LoopState.RUNNING
                       or self._pause_requests):
                self.cond.wait()
            state, pause = self._state, self._pause_requests > 0
        if state is LoopState.ABORTING:  # a hard stop (the other ways in end the thread themselves)
            self.fail_everything(RuntimeError("the manager was hard-stopped"))
            return False
        if pause:
            self._park()
            return True
        try:
            self._apply_inbox()
            if not self.engine.has_work:
                with self.cond:
                    return not (state is not LoopState.RUNNING and not self._inbox)
            self._step_began = time.monotonic()
            updated = self.engine.step()
            self._step_began, self.failed_steps = None, 0
            self.clock.tick(updated)
            for request in updated:
                self._emit(request)
        except Exception as error:  # not one request's fault: fail what was live, report unhealthy
            self._step_began = None
            self.failed_steps += 1
            logger.exception("engine step failed (%d in a row); failing every live request", self.failed_steps)
            return self._engine_failed(error)
        return True

    def _engine_failed(self, error: Exception) -> bool:
        """A step failed outside any one request: every live request fails and check_health()
        fails from now on. The loop keeps serving, unless MAX_FAILED_STEPS failed in a row: a
        broken engine then stops, loudly, rather than failing everything it is sent."""
        self.error = self.engine_fault = error
        ending = self.failed_steps >= MAX_FAILED_STEPS
        if ending:
            logger.error("the batching loop stops: its engine failed %d steps in a row", self.failed_steps)
            with self.cond:
                self._enter(LoopState.ABORTING)
        self.fail_everything(error)
        return not ending

    def _park(self) -> None:
        """Pause: give the model back, wait until every holder left, take it again."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)  # a launched pass must not read weights being updated
        self.engine.give_back_model()
        with self.cond:
            self._parked = True
            self.cond.notify_all()
            while self._pause_requests:
                self.cond.wait()
            self._parked = False
        self.engine.take_model()
