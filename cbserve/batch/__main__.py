"""Batch jobs: prompts from a JSONL file through engines on Ray, results to a JSONL file.

    ray job submit --working-dir . -- python -m cbserve.batch \\
        --input prompts.jsonl --output results.jsonl [--model ...] [--replicas N]

Without `--serve-app`, the job starts its own engines: `--replicas` Ray actors, each owning one
model and one continuous-batching manager. With `--serve-app NAME`, requests go to the engine
replicas of the running Serve application NAME (started from `ray_config.yaml`).

Line formats are in `schema.py`. A bad line gets an `error` record and never stops the job.
Records are appended and flushed as requests finish; rerunning with the same `--output` skips the
lines already written (see `io.py` for how a torn last line and engine failures are handled).
One job at a time writes an output (a lock beside it); a second one is refused.

Exit status: 0 when every line has its final record, 1 when some lines failed in the engine
(rerun to retry them), 2 when the job could not run (bad options, no engines, output in use).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from pydantic import ValidationError

from cbserve.batch.job import run_batch
from cbserve.batch.options import build_parser, cluster_args, options_from_args
from cbserve.batch.progress import Summary

logger = logging.getLogger("cbserve.batch")


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
    return exit_status(summary)


def exit_status(summary: Summary) -> int:
    """0 when every line has its final record; 1 when lines failed in the engine (their
    `engine_error` records run again on a rerun), so that `ray job submit` reports FAILED."""
    if summary.errors.get("engine_error"):
        logger.warning(
            "%d lines failed in the engine; rerun with the same --output to retry them",
            summary.errors["engine_error"],
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
