"""Outputs waiting for their consumers: each output is taken exactly once, either as "the
next output of any request" or as "the next output of this request", from threads or from
asyncio tasks; or handed to a callback registered for its request on an asyncio loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

from cbserve.outputs import GenerationOutput

RECHECK_S = 0.5  # how often a waiting get() asks again whether an output may still come


class OutputStore:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_request: dict[str, deque[tuple[int, GenerationOutput]]] = {}
        self._order: deque[tuple[int, str]] = deque()  # may hold entries already taken by id
        self._seq = 0
        self._num_stored = 0
        self._async_waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._discarded: set[str] = set()
        self._handlers: dict[str, tuple[Callable[[GenerationOutput], None], asyncio.AbstractEventLoop]] = {}

    def put(self, output: GenerationOutput) -> None:
        rid = output.request_id
        with self._cond:
            if rid in self._discarded:
                if output.is_finished():
                    self._discarded.discard(rid)
                return
            if rid in self._handlers:
                self._hand_over_locked(output)
                return
            self._seq += 1
            self._by_request.setdefault(rid, deque()).append((self._seq, output))
            self._order.append((self._seq, rid))
            self._num_stored += 1
            self._cond.notify_all()
            for loop, waiter in self._async_waiters.pop(rid, []):
                try:
                    loop.call_soon_threadsafe(_wake, waiter)
                except RuntimeError:  # that event loop is closed: nobody waits there any more
                    pass

    def register_handler(self, request_id: str, callback: Callable[[GenerationOutput], None],
                         loop: asyncio.AbstractEventLoop) -> None:
        """Hand every output of `request_id` to `callback`, called on `loop`, instead of storing it
        (those already stored first, in order); the handler goes once the final output went."""
        with self._cond:
            self._handlers[request_id] = (callback, loop)
            while request_id in self._handlers and (output := self._pop_locked(request_id)) is not None:
                self._hand_over_locked(output)

    def _hand_over_locked(self, output: GenerationOutput) -> None:
        callback, loop = self._handlers[output.request_id]
        if output.is_finished():
            del self._handlers[output.request_id]
        try:
            loop.call_soon_threadsafe(callback, output)
        except RuntimeError:  # that event loop is closed: nobody listens there any more
            pass

    def wake(self) -> None:
        """Wake every waiting `get` and `get_all_async`, to check again whether an output may
        still come."""
        with self._cond:
            self._cond.notify_all()
            for waiters in self._async_waiters.values():
                for loop, waiter in waiters:
                    try:
                        loop.call_soon_threadsafe(_wake, waiter)
                    except RuntimeError:  # that event loop is closed
                        pass

    def has_output(self, request_id: str | None = None) -> bool:
        with self._cond:
            return self._num_stored > 0 if request_id is None else request_id in self._by_request

    def _pop_locked(self, request_id: str | None) -> GenerationOutput | None:
        if request_id is not None:
            queue = self._by_request.get(request_id)
            if not queue:
                return None
            _, output = queue.popleft()
            if not queue:
                del self._by_request[request_id]
            self._num_stored -= 1
            if len(self._order) > 1024 and len(self._order) > 4 * self._num_stored:
                self._compact_locked()
            return output
        while self._order:
            seq, rid = self._order.popleft()
            queue = self._by_request.get(rid)
            if queue and queue[0][0] == seq:  # else it was already taken by request id
                return self._pop_locked(rid)
        return None

    def _compact_locked(self) -> None:
        live = {seq for queue in self._by_request.values() for seq, _ in queue}
        self._order = deque(entry for entry in self._order if entry[0] in live)

    def get(self, request_id: str | None = None, timeout: float | None = None,
            hopeless: Callable[[], bool] | None = None) -> GenerationOutput | None:
        """The next output (of `request_id` when given); None after `timeout` seconds, or as soon as
        nothing is stored and `hopeless()` says nothing more will come (checked on every `wake()`
        and at least every `RECHECK_S`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                output = self._pop_locked(request_id)
                if output is not None:
                    return output
                if hopeless is not None and hopeless():
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                if hopeless is not None:
                    remaining = RECHECK_S if remaining is None else min(remaining, RECHECK_S)
                self._cond.wait(remaining)

    async def get_all_async(self, request_id: str, timeout: float | None = None,
                            limit: int | None = None) -> list[GenerationOutput]:
        """Every stored output of `request_id` (at most `limit`), oldest first, awaited until there
        is one without blocking the event loop; [] after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            waiter = (loop, loop.create_future())  # a bare future and a timer: no task per wait
            with self._cond:
                outputs = self._pop_many_locked(request_id, limit)
                if outputs:
                    return outputs
                self._async_waiters.setdefault(request_id, []).append(waiter)
            remaining = None if deadline is None else deadline - loop.time()
            timer = None if remaining is None else loop.call_later(max(0.0, remaining), _wake, waiter[1])
            try:
                await waiter[1]
            finally:  # a timeout or a cancelled consumer leaves no stale waiter behind
                if timer is not None:
                    timer.cancel()
                with self._cond:
                    waiters = self._async_waiters.get(request_id)
                    if waiters and waiter in waiters:
                        waiters.remove(waiter)
                        if not waiters:
                            del self._async_waiters[request_id]
            if deadline is not None and loop.time() >= deadline:
                with self._cond:
                    return self._pop_many_locked(request_id, limit)

    def _pop_many_locked(self, request_id: str, limit: int | None) -> list[GenerationOutput]:
        outputs: list[GenerationOutput] = []
        while (limit is None or len(outputs) < limit) and (output := self._pop_locked(request_id)) is not None:
            outputs.append(output)
        return outputs

    def discard(self, request_id: str, finished: bool) -> None:
        """Drop a request's stored outputs, and its future ones unless it already finished."""
        with self._cond:
            queue = self._by_request.pop(request_id, None)
            self._num_stored -= len(queue) if queue else 0
            self._async_waiters.pop(request_id, None)
            if not finished:
                self._discarded.add(request_id)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
