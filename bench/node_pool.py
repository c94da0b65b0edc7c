"""Two engines of one node sharing a per-node KV pool (`cbserve/workers/kv/node_pool.py`).

This process owns the pool (as a node-level actor would); engine A runs in one process with a
1,000-token system prompt plus its question, then engine B in another process with the same
system prompt and another question: B pulls the system prompt's pages from the pool instead of
computing them. Engine C (B's prompt, no pool) is the baseline. Printed: prompt tokens each
engine computed, pages pulled, time to the first token and the tokens (B's must equal C's).

    python bench/node_pool.py --system-tokens 1000 --page-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import GenerationConfig

    import cbserve
    from cbserve.workers.factory import build_engine
    from cbserve.workers.sizing import Workload

    torch.set_num_threads(args.threads)
    model, _ = cbserve.load_model(args.model, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 20000, (args.system_tokens,), generator=g).tolist()
    question = torch.randint(3, 20000, (24,), generator=torch.Generator().manual_seed(args.question)).tolist()
    cfg = cbserve.ContinuousBatchingConfig(page_size=args.page_size, cpu_offload_space=args.host_gib,
                                           node_kv_pool=args.pool if args.pool != "-" else None)
    gc = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
    engine = build_engine(model, gc, cfg, Workload(max_total_tokens=4 * (args.system_tokens + 64), num_requests=1))
    try:
        warm = engine.make_request([7, 8, 9], "warm-up")  # first-pass costs (lazy kernel set-up) out of the timing
        engine.add_request(warm)
        while engine.has_work:
            engine.step()
        engine.scheduler.num_prompt_tokens = 0  # the request alone: not the warm-up
        request = engine.make_request(system + question, "req")
        start = time.perf_counter()
        engine.add_request(request)
        first = None
        while engine.has_work:
            engine.step()
            if first is None and request.generated:
                first = time.perf_counter() - start
        total = time.perf_counter() - start
    finally:
        engine.release_model()
    hp = engine.scheduler.host_pages
    print(json.dumps({"computed": engine.stats()["prompt_tokens_computed"], "prompt": len(request.prompt_ids),
                      "pulled_tokens": hp.num_node_hit_tokens if hp else 0, "ttft_s": first, "total_s": total,
                      "published_pages": engine.node_pool.num_published if engine.node_pool else 0,
                      "tokens": request.generated}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--host-gib", type=float, default=0.25, help="each engine's cpu_offload_space")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="B and C run in turn this many times; best kept")
    parser.add_argument("--pool", default=None, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--question", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pool is not None:
        child(args)
        return
    from cbserve.workers.kv.node_pool import NodeKVPool

    name = f"bench-{os.getpid()}"
    owner = NodeKVPool.create(name, args.pool_mib << 20)
    common = [sys.executable, __file__, "--dtype", args.dtype, "--system-tokens", str(args.system_tokens),
              "--page-size", str(args.page_size), "--new-tokens", str(args.new_tokens), "--host-gib",
              str(args.host_gib), "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
    runs = {}
    try:
        plan = [("A (first engine)", name, 1)] + [("B (second engine)", name, 2),
                                                  ("C (B's prompt, no pool)", "-", 2)] * args.repeat
        for label, pool, question in plan:
            out = subprocess.run(common + ["--pool", pool, "--question", str(question)], check=True,
                                 capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if label not in runs or r["ttft_s"] < runs[label]["ttft_s"]:
                runs[label] = r
    finally:
        owner.close()
    print(f"model {args.model or 'default'}, {args.dtype}, page_size {args.page_size}, system prompt "
          f"{args.system_tokens} tokens + 24-token question, {args.new_tokens} new tokens, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    for label, r in runs.items():
        print(f"{label:26s} prompt {r['prompt']} tokens: computed {r['computed']}, pulled from the node pool "
              f"{r['pulled_tokens']}, published {r['published_pages']} pages; first token after {r['ttft_s']:.2f} s, "
              f"done after {r['total_s']:.2f} s")
    same = runs["B (second engine)"]["tokens"] == runs["C (B's prompt, no pool)"]["tokens"]
    print(f"B's tokens {'equal' if same else 'DIFFER from'} C's")


if __name__ == "__main__":
    main()
