"""Per-step control overhead of tensor parallelism: what rank 0 spends handing each step to the
other ranks, on top of preparing the step's inputs for itself.

Rank 0's runner under tensor parallelism is a `BroadcastingRunner` whose `prepare` calls the
plain runner's `prepare` and then sends the step to the other ranks; this script times both
(wrapping them) over a decode-heavy workload and prints the mean difference per step, and the
mean step time, for each tp size. Greedy tokens are checked equal across sizes.

    python bench/tp_control.py --tp-sizes 1,3 --requests 8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cbserve import ContinuousBatchingConfig, load_model
from cbserve.workers.factory import build_engine
from cbserve.workers.sizing import Workload


def timed(fn, box: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            box.append(time.perf_counter() - start)

    return wrapper


def run(model, prompts: list[list[int]], new_tokens: int, tp_size: int, backend: str) -> dict:
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(tp_size=tp_size, attention_backend=backend)
    hint = Workload(max_total_tokens=sum(len(p) + new_tokens for p in prompts), num_requests=len(prompts))
    engine = build_engine(model, gc, cfg, hint)
    outer, inner, steps = [], [], []
    try:
        runner = engine.runner
        if tp_size > 1:
            runner.inner.prepare = timed(runner.inner.prepare, inner)
            runner.prepare = timed(runner.prepare, outer)
        requests = [engine.make_request(p, f"req_{i}") for i, p in enumerate(prompts)]
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    finally:
        engine.release_model()
    control = [o - i for o, i in zip(outer, inner)]
    return {"control_us": 1e6 * sum(control) / max(len(control), 1), "steps": len(steps),
            "step_ms": 1e3 * sum(steps) / len(steps), "tokens": [r.generated for r in requests]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-sizes", default="1,3")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backend", default="auto", help="attention_backend of the engine")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.requests} requests x "
          f"({args.prompt_tokens} + {args.new_tokens}) tokens, {args.dtype}, backend {args.backend}")
    reference = None
    best: dict[int, dict] = {}
    for _ in range(args.repeat):
        for tp in (int(s) for s in args.tp_sizes.split(",")):
            r = run(model, prompts, args.new_tokens, tp, args.backend)
            reference = reference or r["tokens"]
            r["same"] = r["tokens"] == reference
            if tp not in best or r["step_ms"] < best[tp]["step_ms"]:
                best[tp] = r
    for tp, r in best.items():
        control = f"control {r['control_us']:.0f} us/step, " if tp > 1 else ""
        print(f"tp_size={tp}: {control}step {r['step_ms']:.1f} ms ({r['steps']} steps, best of {args.repeat}); "
              f"{'same tokens' if r['same'] else 'DIFFERENT tokens'}")


if __name__ == "__main__":
    main()
