"""The options of a batch job: the command line, and the engines' settings it selects."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbserve.cluster.settings import ClusterArgs

USAGE = "Batch jobs: prompts from a JSONL file through engines on Ray, results to a JSONL file."


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cbserve.batch", description=USAGE)
    p.add_argument(
        "--input", type=Path, required=True, help="JSONL prompts (see cbserve/batch/schema.py)"
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
