"""What stream migration costs a client (issue 32): the app `make serve` starts, with two worker
replicas, serves the same streams twice: undisturbed, then with one worker replica killed
(`ray.kill` of its actor) while they run.

Per phase: output tok/s (tokens over the phase's wall time), every stream's longest gap between
chunks; for the killed phase, the streams that were on the killed replica (the replica header) and
their stall (their longest gap: the loss, the continuation's prefill of prompt + output so far,
its first token), p50 and p99, and whether every stream's text equals its undisturbed text.

    python bench/migration.py                      # 16 streams, 128 tokens each, greedy, float32
    python bench/migration.py --streams 32 --kill-after 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import common  # bench/common.py: load averages
import load  # bench/load.py: the SSE parser, percentiles
import serving  # bench/serving.py: starting and stopping `make serve`'s app

REPLICA_HEADER = "x-cbserve-replica"
WORKER = "LLMWorker"


async def one_stream(session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    out: dict[str, Any] = {"text": "", "times": [], "error": None, "replica": None, "finish": None}
    start = time.perf_counter()
    async with session.post(base + "/v1/completions", json=body) as resp:
        out["replica"] = resp.headers.get(REPLICA_HEADER)
        parser = load.SSEParser()
        async for chunk in resp.content.iter_any():
            for data in parser.feed(chunk):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                choice = event["choices"][0]
                if choice.get("text"):
                    out["text"] += choice["text"]
                    out["times"].append(time.perf_counter())
                out["finish"] = choice.get("finish_reason") or out["finish"]
    out["start"], out["end"] = start, time.perf_counter()
    gaps = [b - a for a, b in zip([start, *out["times"]], out["times"])]
    out["longest_gap_s"] = max(gaps[1:], default=0.0)  # after the first token
    return out


def kill_one_worker(app: str) -> str:
    import ray
    from ray.util.state import list_actors

    ray.init(address="auto", namespace="serve", log_to_driver=False)
    names = [a.name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
             if a.name and a.name.startswith(f"SERVE_REPLICA::{app}#{WORKER}#")]
    victim = min(names)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    return victim.rsplit("#", 1)[1]


async def phase(base: str, prompts: list[str], max_tokens: int, kill_after: float | None, app: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one_stream(session, base, p, max_tokens)) for p in prompts]
        victim = None
        if kill_after is not None:
            await asyncio.sleep(kill_after)
            victim = await asyncio.to_thread(kill_one_worker, app)
        outs = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    tokens = sum(len(o["times"]) for o in outs)
    moved = [o for o in outs if victim is not None and o["replica"] == victim]
    stalls = [o["longest_gap_s"] for o in moved]
    return {"outs": outs, "wall_s": wall, "out_tok_s": tokens / wall, "victim": victim, "migrated": len(moved),
            "errors": sum(o["error"] is not None for o in outs),
            "stall_p50_s": load.percentile(stalls, 50), "stall_p99_s": load.percentile(stalls, 99),
            "gap_p50_s": load.percentile([o["longest_gap_s"] for o in outs], 50), "load": common.loadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=serving.DEFAULT_CONFIG)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kill-after", type=float, default=4.0, help="seconds into the second phase")
    p.add_argument("--dtype", default="float32", help="float32: the C++ kernels give a stream the same tokens "
                   "whatever shares its batches; bfloat16 on AMX does not (oneDNN from 4 rows), so texts may differ "
                   "without a migration")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    config = yaml.safe_load(args.config.read_text())
    app = config["applications"][0]
    app["args"]["dtype"] = args.dtype
    worker = app["args"].setdefault("worker", {})
    worker.update({"autoscaling": None, "num_replicas": 2, "num_cpus": 1, "health_check_period_s": 2.0})
    prompts = [f"Stream {i}: tell me a long story about the sea and the {i} ships that sailed it."
               for i in range(args.streams)]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        base, _ = serving.start_server(stack, config, Path(tmp) / "server.log", timeout=900)
        asyncio.run(phase(base, prompts[:2], 8, None, app["name"]))  # warm-up
        calm = asyncio.run(phase(base, prompts, args.max_tokens, None, app["name"]))
        hit = asyncio.run(phase(base, prompts, args.max_tokens, args.kill_after, app["name"]))
    same = sum(a["text"] == b["text"] and b["error"] is None for a, b in zip(calm["outs"], hit["outs"]))
    moved_same = sum(a["text"] == b["text"] and b["error"] is None for a, b in zip(calm["outs"], hit["outs"])
                     if b["replica"] == hit["victim"])
    print(f"undisturbed: {calm['out_tok_s']:.1f} out tok/s, longest gap p50 {calm['gap_p50_s']:.3f} s "
          f"(load {calm['load']})")
    print(f"one worker killed after {args.kill_after:g} s: {hit['out_tok_s']:.1f} out tok/s "
          f"({hit['out_tok_s'] / calm['out_tok_s']:.2f}x); {hit['migrated']} of {args.streams} streams were on the "
          f"killed replica; their stall p50 {hit['stall_p50_s']} s, p99 {hit['stall_p99_s']} s; errors "
          f"{hit['errors']}; {same} of {args.streams} texts equal the undisturbed ones, {moved_same} of the "
          f"{hit['migrated']} migrated (load {hit['load']})")
    if args.json is not None:
        for r in (calm, hit):
            for o in r["outs"]:
                o.pop("times")
        args.json.write_text(json.dumps({"undisturbed": calm, "killed": hit, "same_text": same}, indent=1))
    return 0 if same == args.streams else 1


if __name__ == "__main__":
    sys.exit(main())
