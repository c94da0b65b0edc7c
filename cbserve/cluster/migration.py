"""Stream migration (issue 32): a choice whose engine replica dies, fails or drains mid-stream is
continued on another replica, in the same client stream.

The ingress keeps, per open choice, what its client has received: the output token ids and the
characters of text. With the choice's own `WorkerRequest` that is all a continuation needs: the
next replica prefills prompt + those tokens (its prefix cache, or the node's KV pool, has the
pages when they are there) and rebuilds what depends on them, the grammar's state, the penalties'
counts, a seed's draws, the detokenizer and stop strings (`Request.resume`,
`replica/generation._Decoder`); its text starts where the client's stops. The client sees one
choice: no gap or repeat in its tokens, the replica's usage counting the resumed tokens once.

What migrates: an exception from the replica's stream (its actor died, its node is gone), a stream
that stops without an end, a 503 `error` event (the engine failed, the replica is stopping) and an
`abort` end (the replica ended its streams because it is being shut down). A refusal (400) or a
finished choice never does. After `max_attempts` continuations, or when no replica accepts one,
the client gets the explicit error it would have got without migration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from cbserve.serving.api_errors import error_event
from cbserve.serving.protocol import Resume, WorkerEvent, WorkerRequest

logger = logging.getLogger(__name__)

# Opens a choice on some replica: its first event and the rest of its events (a Serve generator).
OpenCall = Callable[[WorkerRequest], Awaitable[tuple[WorkerEvent, Any]]]
RETRY_PAUSE_S = 0.25  # between continuation attempts that found no replica taking them


def lost_reason(ev: WorkerEvent) -> str | None:
    """Why an event means the replica lost the choice (None: it is the choice's own event)."""
    if ev.kind == "error" and ev.status == 503 and ev.code != "overloaded":
        return "replica_error"
    if ev.kind == "end" and ev.finish_reason == "abort":
        return "drain"
    return None


class MigratingChoice:
    """One open choice's events, continued on another replica when its replica loses it."""

    def __init__(self, wreq: WorkerRequest, start: WorkerEvent, gen: Any, open_call: OpenCall, max_attempts: int,
                 on_migration: Callable[[str, float], None] | None = None):
        self._wreq = wreq
        self._gen = gen
        self._open = open_call
        self._max_attempts = max_attempts
        self._on_migration = on_migration
        self.replicas = [start.replica or ""]  # every replica that served the choice, in turn
        self.attempts = 0
        self._sent_ids: list[int] = []
        self._sent_chars = 0

    def cancel(self) -> None:
        """The client went away: cancel the choice where it runs now."""
        cancel_quietly(self._gen)

    async def events(self) -> AsyncIterator[WorkerEvent]:
        while True:
            reason, lost = None, None
            try:
                async for ev in self._gen:
                    reason = lost_reason(ev)
                    if reason is not None:
                        lost = ev
                        break
                    if ev.kind == "delta":
                        self._sent_ids += ev.token_ids
                        self._sent_chars += len(ev.text)
                    yield ev
                    if ev.kind in ("end", "error"):
                        return
                else:
                    reason = "cut_short"
            except Exception as exc:  # noqa: BLE001 - Ray's ActorDiedError, ActorUnavailableError, ...
                logger.warning("choice %s: its replica %s failed (%r)", self._wreq.request_id, self.replicas[-1], exc)
                reason = "replica_failed"
            failure = await self._continue(reason, lost)
            if failure is not None:
                yield failure
                return

    def continuation(self) -> WorkerRequest:
        """The choice as a request for another replica: the same request, resumed after what its
        client has; the prompt is not echoed again; the replicas it left are tried last."""
        sampling = self._wreq.sampling.model_copy(update={"prompt_logprobs": None})
        return self._wreq.model_copy(update={
            "request_id": f"{self._wreq.request_id}-m{self.attempts}",
            "resume": Resume(token_ids=list(self._sent_ids), text_chars=self._sent_chars),
            "echo": False,
            "sampling": sampling,
            "avoid_replicas": list(dict.fromkeys(self.replicas)),
        })

    async def _continue(self, reason: str, lost: WorkerEvent | None) -> WorkerEvent | None:
        """Open the continuation on another replica (`self._gen` then reads it); the event for
        the client when that is not possible: the one that lost the choice (its message names the
        cause), else an error."""
        lost_at = time.monotonic()
        logger.info("choice %s lost on replica %s (%s) after %d tokens", self._wreq.request_id, self.replicas[-1],
                    reason, len(self._sent_ids))
        while self.attempts < self._max_attempts:
            self.attempts += 1
            try:
                start, gen = await self._open(self.continuation())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - no replica took it: try again, then give up
                logger.warning("choice %s: continuation %d not accepted (%r)", self._wreq.request_id, self.attempts, exc)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if start.kind == "error":
                if start.status == 503:  # that replica is stopping or full: another may take it
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                return start  # refused (e.g. the context is full): the client is told why
            self._gen = gen
            self.replicas.append(start.replica or "")
            stall = time.monotonic() - lost_at
            logger.info("choice %s continued on replica %s after %.3f s", self._wreq.request_id, self.replicas[-1],
                        stall)
            if self._on_migration is not None:
                self._on_migration(reason, stall)
            return None
        if lost is not None:
            return lost
        return error_event(503, f"the worker serving this request failed before it finished and "
                                f"{self._max_attempts} attempts to continue it on another worker did not succeed; "
                                "retry it")


def cancel_quietly(gen: Any) -> None:
    """Cancel a handle call that may have failed: Serve's `cancel()` re-raises the call's own
    error (e.g. BackPressureError) when the call never reached a replica."""
    try:
        gen.cancel()
    except Exception as exc:  # noqa: BLE001 - nothing to cancel then
        logger.debug("cancelling a failed worker call: %r", exc)
