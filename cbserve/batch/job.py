"""A batch job: reads the input, skips what an earlier run wrote, runs the rest with bounded
concurrency on its backend (`backends.py`), writes one record per line (`io.py`)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from cbserve.batch.backends import Backend, EnginePool, RetryableError, ServeBackend
from cbserve.batch.io import OutputLock, ResultWriter, prepare_output
from cbserve.batch.options import BatchOptions, cluster_args
from cbserve.batch.progress import Progress, Summary
from cbserve.batch.requests import (
    RequestDefaults,
    error_text,
    is_retryable,
    refused,
    to_result,
    to_worker_request,
)
from cbserve.batch.schema import BatchLine, ResultLine, id_key, line_key, parse_line
from cbserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

__all__ = ["BatchJob", "BatchOptions", "make_backend", "run_batch"]


def _read_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from enumerate(f, 1)


def make_backend(opts: BatchOptions) -> tuple[Backend, RequestDefaults]:
    if opts.serve_app is not None:
        defaults = RequestDefaults(max_tokens=opts.max_tokens, temperature=opts.temperature)
        return ServeBackend(opts.serve_app, concurrency=opts.concurrency or 64), defaults
    import ray

    args = cluster_args(opts)
    if opts.num_gpus is None:  # one GPU per rank when the cluster has them, else CPU engines
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= args.tp_size else 0.0
        args = args.model_copy(update={"worker": args.worker.model_copy(update={"num_gpus": gpus})})
    w = args.worker
    pool = EnginePool(args, opts.replicas, args.tp_size, w.num_cpus, w.num_gpus)
    if opts.concurrency:
        pool.default_concurrency = opts.concurrency
    defaults = RequestDefaults(
        max_tokens=opts.max_tokens,
        temperature=opts.temperature,
        generation=args.generation,
        routing=args.routing,
    )
    return pool, defaults


class BatchJob:
    """Reads the input, skips what is done, runs the rest with bounded concurrency, writes records."""

    def __init__(self, opts: BatchOptions, backend: Backend, defaults: RequestDefaults):
        self.opts = opts
        self.backend = backend
        self.defaults = defaults
        self._run_id = f"batch-{uuid.uuid4().hex[:8]}"
        self._started: asyncio.Task[None] | None = None

    async def _ensure_started(self) -> None:
        if self._started is None:  # started on the first line that needs an engine
            self._started = asyncio.ensure_future(self.backend.start())
        await self._started

    async def run(self) -> Summary:
        with OutputLock(self.opts.output):  # before anything reads or repairs the output
            return await self._run_locked()

    async def _run_locked(self) -> Summary:
        opts = self.opts
        state = prepare_output(opts.output)
        if state.done:
            logger.info("resuming: %d lines of %s are already done", len(state.done), opts.output)
        total = sum(1 for _, text in _read_lines(opts.input) if text.strip())
        progress = Progress(total, opts.log_every, opts.progress)
        with ResultWriter(opts.output) as writer:
            try:
                await self._feed(state.done, writer, progress)
            finally:
                summary = progress.close()
                summary.engines = list(self.backend.engines)
        logger.info("%s", progress.line())
        return summary

    async def _feed(self, done: set[str], writer: ResultWriter, progress: Progress) -> None:
        """Writes each line's record, running the lines that need an engine as bounded tasks.

        A task raises only when the job cannot go on (the engines did not start, the output cannot
        be written): reading stops and that error is raised here, never lost in a task."""
        seen: dict[str, int] = {}  # id key -> first line using it
        tasks: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []
        limit = asyncio.Semaphore(max(1, self.opts.concurrency or self.backend.default_concurrency))
        try:
            for lineno, text in _read_lines(self.opts.input):
                if not text.strip():
                    progress.summary.blank += 1
                    continue
                key, parsed = self._claim(parse_line(text, lineno), lineno, seen)
                if key in done:
                    progress.skipped()
                    continue
                if isinstance(parsed, ResultLine):
                    writer.write(parsed)
                    progress.written(False, parsed.error_type)
                    continue
                await limit.acquire()
                if failures:
                    limit.release()
                    break
                task = asyncio.create_task(self._run_line(parsed, lineno, writer, progress, limit))
                tasks.add(task)
                task.add_done_callback(functools.partial(_settle, tasks, failures))
            await asyncio.gather(*tasks)
            if failures:
                raise failures[0]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _claim(
        parsed: BatchLine | ResultLine, lineno: int, seen: dict[str, int]
    ) -> tuple[str, BatchLine | ResultLine]:
        """The line's done-key; a line repeating an earlier line's id becomes a `duplicate_id` error."""
        if parsed.id is None:
            return line_key(lineno), parsed
        key = id_key(parsed.id)
        first = seen.setdefault(key, lineno)
        if first == lineno:
            return key, parsed
        dup = ResultLine(
            id=parsed.id,
            line=lineno,
            error_type="duplicate_id",
            error=f"id: {json.dumps(parsed.id, ensure_ascii=False)} is already used by line {first}",
        )
        return line_key(lineno), dup

    async def _run_line(
        self, line: BatchLine, lineno: int, writer: ResultWriter, progress: Progress, limit: asyncio.Semaphore
    ) -> None:
        try:
            await self._ensure_started()  # raises out of the job: without engines no line can run
            try:
                record = await self._attempts(line, lineno, progress)
            except Exception as exc:  # a fault no path foresaw: still this line's record, retried on resume
                logger.exception("line %d: unexpected failure", lineno)
                record = ResultLine(id=line.id, line=lineno, error=f"{type(exc).__name__}: {exc}",
                                    error_type="engine_error", metadata=line.metadata)
            writer.write(record)
            usage = record.usage
            progress.written(
                record.error is None,
                record.error_type,
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
            )
        finally:
            limit.release()

    async def _attempts(self, line: BatchLine, lineno: int, progress: Progress) -> ResultLine:
        error = "no attempt made"
        for attempt in range(self.opts.retries + 1):
            if attempt:
                progress.summary.retries += 1
                await asyncio.sleep(self.opts.retry_delay_s * attempt)
            try:
                req = to_worker_request(
                    line, f"{self._run_id}-{lineno}-{attempt}", self.defaults, self.backend.has_chat_template
                )
                result = await self.backend.run(req)
            except (ValidationError, InvalidRequestError) as exc:  # the line's fault: final, not retried
                return refused(line, lineno, exc)
            except RetryableError as exc:
                error = str(exc)
                logger.warning("line %d (attempt %d): %s", lineno, attempt + 1, error)
                continue
            if not is_retryable(result):
                return to_result(line, lineno, result)
            error = error_text(result.error, line)  # type: ignore[arg-type]
            logger.warning("line %d (attempt %d): %s", lineno, attempt + 1, error)
        return ResultLine(
            id=line.id, line=lineno, error=error, error_type="engine_error", metadata=line.metadata
        )


def _settle(tasks: set[asyncio.Task[None]], failures: list[BaseException], task: asyncio.Task[None]) -> None:
    """A line's task ended: forget it, keeping what it raised for `_feed` to raise."""
    tasks.discard(task)
    if not task.cancelled() and task.exception() is not None:
        failures.append(task.exception())  # type: ignore[arg-type]


async def run_batch(opts: BatchOptions) -> Summary:
    """Run a batch job on the connected Ray cluster (see `main` for connecting)."""
    if not opts.input.is_file():
        raise FileNotFoundError(f"--input: {opts.input} is not a file")
    backend, defaults = make_backend(opts)
    try:
        return await BatchJob(opts, backend, defaults).run()
    finally:
        await backend.close()
