"""Batch jobs: prompts from a JSONL file through engines on Ray, results to a JSONL file.

    ray job submit --working-dir . -- python -m cbserve.cluster.batch \\
        --input prompts.jsonl --output results.jsonl [--model ...] [--replicas N]

Without `--serve-app`, the job starts its own engines: `--replicas` Ray actors, each owning one
model and one continuous-batching manager. With `--serve-app NAME`, requests go to the worker
deployment of the running Serve application NAME (started from `ray_config.yaml`).

Line formats are in `batch_schema.py`. A bad line gets an `error` record and never stops the job.
Records are appended and flushed as requests finish; rerunning with the same `--output` skips the
lines already written (see `batch_io.py` for how a torn last line and engine failures are handled).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cbserve.cluster.batch_backends import Backend, EnginePool, RetryableError, ServeBackend
from cbserve.cluster.batch_io import ResultWriter, prepare_output
from cbserve.cluster.batch_progress import Progress, Summary
from cbserve.cluster.batch_requests import RequestDefaults, is_retryable, to_result, to_worker_request
from cbserve.cluster.batch_schema import (
    BatchLine,
    ResultLine,
    describe_validation_error,
    id_key,
    line_key,
    parse_line,
)
from cbserve.cluster.settings import ClusterArgs

logger = logging.getLogger(__name__)


@dataclass
class BatchOptions:
    input: Path
    output: Path
    model: str | None = None
    dtype: str | None = None
    tp_size: int | None = None
    replicas: int = 1
    num_cpus: float = 1.0  # per tensor-parallel rank
    num_gpus: float | None = None  # per rank; None: 1 if the cluster has a GPU for every rank, else 0
    engine: dict[str, Any] = field(default_factory=dict)
    config: Path | None = None
    config_app: str | None = None
    serve_app: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    concurrency: int | None = None
    retries: int = 2
    retry_delay_s: float = 1.0
    log_every: int = 100
    progress: bool = True


def _read_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from enumerate(f, 1)


def cluster_args(opts: BatchOptions) -> ClusterArgs:
    """The engines' settings: a Serve config's application args (`--config`), then the flags."""
    base: dict[str, Any] = {}
    if opts.config is not None:
        import yaml

        apps = (yaml.safe_load(opts.config.read_text()) or {}).get("applications") or []
        chosen = [a for a in apps if opts.config_app in (None, a.get("name"))]
        if not chosen:
            raise ValueError(f"--config: {opts.config} has no application named {opts.config_app!r}")
        base = dict(chosen[0].get("args") or {})
    for key in ("model", "dtype", "tp_size"):
        if getattr(opts, key) is not None:
            base[key] = getattr(opts, key)
    base["engine"] = {**(base.get("engine") or {}), **opts.engine}
    worker = dict(base.get("worker") or {})
    worker.update(num_replicas=opts.replicas, autoscaling=None, num_cpus=opts.num_cpus)
    if opts.num_gpus is not None:
        worker["num_gpus"] = opts.num_gpus
    base["worker"] = worker
    base["api_key"] = None
    return ClusterArgs(**base)


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
    pool = EnginePool(args.model_dump(mode="json"), opts.replicas, args.tp_size, w.num_cpus, w.num_gpus)
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
        opts = self.opts
        state = prepare_output(opts.output)
        if state.done:
            logger.info("resuming: %d lines of %s are already done", len(state.done), opts.output)
        total = sum(1 for _, text in _read_lines(opts.input) if text.strip())
        progress = Progress(total, opts.log_every, opts.progress)
        seen: dict[str, int] = {}  # id key -> first line using it
        tasks: set[asyncio.Task[None]] = set()
        limit = asyncio.Semaphore(max(1, opts.concurrency or self.backend.default_concurrency))
        with ResultWriter(opts.output) as writer:
            try:
                for lineno, text in _read_lines(opts.input):
                    if not text.strip():
                        progress.summary.blank += 1
                        continue
                    parsed = parse_line(text, lineno)
                    key, parsed = self._claim(parsed, lineno, seen)
                    if key in state.done:
                        progress.skipped()
                        continue
                    if isinstance(parsed, ResultLine):
                        writer.write(parsed)
                        progress.written(False, parsed.error_type)
                        continue
                    await limit.acquire()
                    if self._started is not None and self._started.done() and self._started.exception():
                        limit.release()
                        break  # the engines could not start: stop reading, re-raise below
                    task = asyncio.create_task(self._run_line(parsed, lineno, writer, progress, limit))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*tasks)
                if self._started is not None:
                    await self._started  # raises if the engines could not start
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                summary = progress.close()
                summary.engines = list(self.backend.engines)
        logger.info("%s", progress.line())
        return summary

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
            await self._ensure_started()
            record = await self._attempts(line, lineno, progress)
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
            except ValidationError as exc:
                return ResultLine(
                    id=line.id,
                    line=lineno,
                    error=describe_validation_error(exc),
                    error_type="invalid_request",
                    metadata=line.metadata,
                )
            try:
                out = await self.backend.run(req)
            except RetryableError as exc:
                error = str(exc)
                logger.warning("line %d (attempt %d): %s", lineno, attempt + 1, error)
                continue
            if not is_retryable(out):
                return to_result(line, lineno, out)
            error = out.error or "engine error"
            logger.warning("line %d (attempt %d): %s", lineno, attempt + 1, error)
        return ResultLine(
            id=line.id, line=lineno, error=error, error_type="engine_error", metadata=line.metadata
        )


async def run_batch(opts: BatchOptions) -> Summary:
    """Run a batch job on the connected Ray cluster (see `main` for connecting)."""
    if not opts.input.is_file():
        raise FileNotFoundError(f"--input: {opts.input} is not a file")
    backend, defaults = make_backend(opts)
    try:
        return await BatchJob(opts, backend, defaults).run()
    finally:
        await backend.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cbserve.cluster.batch", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", type=Path, required=True, help="JSONL prompts (see cbserve/cluster/batch_schema.py)"
    )
    p.add_argument("--output", type=Path, required=True, help="JSONL results, appended; rerun to resume")
    p.add_argument(
        "--serve-app", help="send requests to this running Serve application instead of own engines"
    )
    p.add_argument("--model", help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tp-size", type=int, help="tensor-parallel ranks per engine, on one node (default 1)")
    p.add_argument("--replicas", type=int, default=1, help="engine actors (default 1)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per tensor-parallel rank (default 1)")
    p.add_argument(
        "--num-gpus", type=float, help="GPUs per tensor-parallel rank (default: 1 if the cluster has GPUs)"
    )
    p.add_argument("--engine", type=json.loads, default={}, help="ContinuousBatchingConfig fields as JSON")
    p.add_argument(
        "--config", type=Path, help="take the engines' settings from this Serve config (ray_config.yaml)"
    )
    p.add_argument("--config-app", help="application of --config to use (default: the first)")
    p.add_argument("--max-tokens", type=int, help="max_tokens of lines that leave it out")
    p.add_argument("--temperature", type=float, help="temperature of lines that leave it out (default 1.0)")
    p.add_argument(
        "--concurrency", type=int, help="requests in flight (default 64 per engine; 64 with --serve-app)"
    )
    p.add_argument("--retries", type=int, default=2, help="retries of a request that failed in the engine")
    p.add_argument("--log-every", type=int, default=100, help="log progress every N finished lines")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    return p


def options_from_args(ns: argparse.Namespace) -> BatchOptions:
    for name in ("replicas", "max_tokens", "tp_size", "concurrency", "log_every"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if ns.retries < 0:
        raise ValueError(f"--retries must be at least 0, got {ns.retries}")
    if not isinstance(ns.engine, dict):
        raise ValueError("--engine must be a JSON object")  # noqa: TRY004 - reported as a usage error
    return BatchOptions(
        input=ns.input,
        output=ns.output,
        model=ns.model,
        dtype=ns.dtype,
        tp_size=ns.tp_size,
        replicas=ns.replicas,
        num_cpus=ns.num_cpus,
        num_gpus=ns.num_gpus,
        engine=ns.engine,
        config=ns.config,
        config_app=ns.config_app,
        serve_app=ns.serve_app,
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        concurrency=ns.concurrency,
        retries=ns.retries,
        log_every=ns.log_every,
        progress=not ns.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = options_from_args(ns)
        if opts.output.resolve() == opts.input.resolve():
            raise ValueError("--output must not be the --input file")
        if opts.serve_app is None:
            cluster_args(opts)  # bad engine settings fail here, before Ray starts
    except (ValueError, ValidationError) as exc:
        parser.error(str(exc))
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=ns.address)
    try:
        summary = asyncio.run(run_batch(opts))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("batch job failed: %s", exc)
        return 2
    finally:
        if started:
            ray.shutdown()
    logger.info("summary: %s", json.dumps(summary.as_dict()))
    if summary.errors.get("engine_error"):
        logger.warning(
            "%d lines failed in the engine; rerun with the same --output to retry them",
            summary.errors["engine_error"],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
