"""Routing benchmark: prefix-cache hit rate and throughput of three request routers on the same
shared-prefix workload, with 2 ingress replicas and 2-4 worker replicas on a local Ray.

Routers (the worker deployment's Serve `RequestRouter`, one app per router, deployed in turn):
- `cbserve`: ours, consistent hashing with bounded loads of the prompt's first chunk, two random
  choices for prompts without one (`cbserve/cluster/router.py`, `balance.py`);
- `ray_llm`: Ray Serve LLM's `PrefixCacheAffinityRouter` (a prefix tree in one detached actor that
  every ingress replica asks, as shipped: default arguments);
- `default`: Serve's power-of-two-choices router (no prefix awareness).

Workload (seeded, identical for each router): `--systems` long system prompts shared by
`--users` users; each request is a chat of one system prompt (drawn with a skew: the first is
the hottest) and a short user question, `--max-tokens` greedy tokens, `--concurrency` clients
at once, `--requests` requests after a short warm-up. Each worker's KV cache holds
`--num-blocks` pages of `--page-size` tokens: room for about half the system prompts next to the
running requests, so where a prompt goes decides whether its prefix is still cached.

Reported per router: prefix-cache hit rate (prompt tokens served from cache / prompt tokens, from
/metrics: `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, summed over the
worker replicas), requests/s, output tokens/s, latency p50/p95, requests per worker replica, and
for each system prompt the number of replicas that served it.

    python bench/routing.py                         # default model, 2 workers, ~5 min on 2 cores
    python bench/routing.py --workers 4 --routers cbserve,default --json bench/results/routing.json
    python bench/routing.py --smoke                 # tiny random model, a few requests
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cbserve.cluster.ray_compat import RAY_LLM_PREFIX_ROUTER_CLASS

TOPICS = ["billing", "shipping", "returns", "warranty", "accounts", "privacy", "orders", "coupons"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF id or folder (default: the default model)")
    p.add_argument("--routers", default="cbserve,ray_llm,default")
    p.add_argument("--workers", type=int, default=2, help="worker replicas (2-4)")
    p.add_argument("--ingress", type=int, default=2, help="ingress replicas")
    p.add_argument("--systems", type=int, default=6, help="distinct system prompts")
    p.add_argument("--system-chars", type=int, default=900, help="characters per system prompt")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=64, help="KV pages per worker replica")
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per worker replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny random model, few requests (checks the script)")
    return p.parse_args(argv)


def system_prompts(n: int, chars: int) -> list[str]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        head = f"You are support agent number {i} for the {topic} desk of a large online shop. "
        body = f"Rule {{k}} of the {topic} desk: answer politely, cite the policy section {{k}}, never guess. "
        text, k = head, 0
        while len(text) < chars:
            text += body.format(k=k)
            k += 1
        out.append(text[:chars])
    return out


def workload(args: argparse.Namespace) -> list[tuple[int, list[dict[str, str]]]]:
    """(system prompt index, chat messages) per request; system prompts drawn with a Zipf-like skew."""
    rng = random.Random(args.seed)
    systems = system_prompts(args.systems, args.system_chars)
    weights = [1.0 / (i + 1) for i in range(args.systems)]
    out = []
    for k in range(args.requests + 4):
        s = rng.choices(range(args.systems), weights=weights)[0]
        user = rng.randrange(args.users)
        question = f"User {user} asks question {k}: what does rule {rng.randrange(20)} say about my case?"
        out.append((s, [{"role": "system", "content": systems[s]}, {"role": "user", "content": question}]))
    return out


def app_args(args: argparse.Namespace, router: str, model: str | None) -> dict[str, Any]:
    routing: dict[str, Any] = {"stats_period_s": 0.5}
    if router == "default":
        routing["enabled"] = False
    elif router == "ray_llm":
        routing["request_router_class"] = RAY_LLM_PREFIX_ROUTER_CLASS
    return {
        "model": model, "served_model_name": "m", "dtype": "float32", "ingress_replicas": args.ingress,
        "engine": {"page_size": args.page_size, "num_blocks": args.num_blocks, "max_batch_tokens": 512},
        "generation": {"max_tokens": args.max_tokens}, "routing": routing,
        "worker": {"num_replicas": args.workers, "num_cpus": args.num_cpus, "max_ongoing_requests": 64},
    }


def post_chat(port: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int]:
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        tokens = json.loads(raw)["usage"]["completion_tokens"]
        return time.perf_counter() - t0, resp.getheader("x-cbserve-replica") or "?", tokens
    finally:
        conn.close()


def cache_counters(port: int) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over every worker replica (from /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    sums: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                sums[s.name] += s.value
    return sums["vllm:prefix_cache_hits_total"], sums["vllm:prefix_cache_queries_total"]


def run_load(port: int, jobs: list[tuple[int, list[dict[str, str]]]], args: argparse.Namespace) -> dict[str, Any]:
    for _, messages in jobs[:4]:  # warm-up: every replica has run a step before the clock starts
        post_chat(port, messages, args.max_tokens)
    hits0, queries0 = cache_counters(port)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda job: (job[0], *post_chat(port, job[1], args.max_tokens)), jobs[4:]))
    wall = time.perf_counter() - t0
    time.sleep(1.5)  # every replica has reported its latest engine stats
    hits1, queries1 = cache_counters(port)
    latencies = sorted(r[1] for r in results)
    per_system: dict[int, set[str]] = defaultdict(set)
    for s, _, replica, _ in results:
        per_system[s].add(replica)
    return {
        "hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
        "prompt_tokens": queries1 - queries0, "cached_tokens": hits1 - hits0,
        "requests_per_s": len(results) / wall, "output_tokens_per_s": sum(r[3] for r in results) / wall,
        "latency_p50_s": latencies[len(latencies) // 2], "latency_p95_s": latencies[int(len(latencies) * 0.95)],
        "wall_s": wall, "per_replica": sorted(Counter(r[2] for r in results).values(), reverse=True),
        "replicas_per_system": [len(per_system[s]) for s in sorted(per_system)],
    }


def bench_router(router: str, args: argparse.Namespace, model: str | None, jobs: list[Any]) -> dict[str, Any]:
    from ray import serve

    from cbserve.cluster.app import build_app

    t0 = time.perf_counter()
    serve.run(build_app(app_args(args, router, model)), name="routing", route_prefix="/")
    print(f"[{router}] deployed in {time.perf_counter() - t0:.0f}s", flush=True)
    try:
        return run_load(args.port, jobs, args)
    finally:
        serve.delete("routing")


def report(results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'router':10} {'hit rate':>8} {'req/s':>7} {'tok/s':>7} {'p50 s':>6} {'p95 s':>6}  "
          "per replica   replicas per system prompt")
    for router, r in results.items():
        print(f"{router:10} {r['hit_rate']:8.1%} {r['requests_per_s']:7.2f} {r['output_tokens_per_s']:7.1f} "
              f"{r['latency_p50_s']:6.2f} {r['latency_p95_s']:6.2f}  {r['per_replica']!s:13} {r['replicas_per_system']}")


def smoke_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.cluster import build_tiny_model

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "cbserve-bench-tiny-model"
    if not (folder / "config.json").exists():
        build_tiny_model(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import ray
    from ray import serve

    args = parse_args(argv)
    if args.smoke:
        args.requests, args.system_chars, args.concurrency, args.max_tokens = 12, 200, 4, 2
    model = smoke_model() if args.smoke else args.model
    jobs = workload(args)
    ray.init(address="local", num_cpus=max(4, int(args.workers * args.num_cpus) + 2), include_dashboard=False,
             log_to_driver=False)
    results: dict[str, dict[str, Any]] = {}
    try:
        args.port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for router in args.routers.split(","):
            results[router] = bench_router(router, args, model, jobs)
            report({router: results[router]})
    finally:
        serve.shutdown()
        ray.shutdown()
    report(results)
    settings = {k: v for k, v in vars(args).items() if k not in ("json",)}
    out = {"settings": settings, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
