"""Offline throughput of the default model (or --model) with several tensor-parallel sizes.

Same random prompts, greedy, EOS ignored so every request generates exactly --new-tokens; the
engines run in turn (--repeat rounds, best kept) so that load from other processes hits each
size alike. Only the generation loop is timed: rank start-up and model sharding are reported
apart. Checks that every size gives the tokens of the first one.

    python bench/tp_throughput.py --tp-sizes 1,3 --requests 8 --new-tokens 32 --repeat 2
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


def run(model, prompts: list[list[int]], new_tokens: int, tp_size: int) -> tuple[float, float, list[list[int]]]:
    """(start-up seconds, generation seconds, tokens per request)."""
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(tp_size=tp_size)
    hint = sum(len(p) + new_tokens for p in prompts)
    start = time.perf_counter()
    engine = build_engine(model, gc, cfg, Workload(max_total_tokens=hint, num_requests=len(prompts)))
    try:
        requests = [engine.make_request(p, f"req_{i}") for i, p in enumerate(prompts)]
        ready = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
        done = time.perf_counter()
    finally:
        engine.release_model()
    return ready - start, done - ready, [r.generated for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tp-sizes", default="1,3")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of rank 0 (default: torch's); other ranks get threads // tp_size")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.tp_sizes.split(",")]
    model, _ = load_model(args.model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}; "
          f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} new) tokens")
    best: dict[int, tuple[float, float]] = {}
    reference = None
    for round_ in range(args.repeat):
        for tp in sizes:
            startup, seconds, tokens = run(model, prompts, args.new_tokens, tp)
            reference = reference or tokens
            same = sum(a == b for a, b in zip(tokens, reference))
            rate = args.requests * args.new_tokens / seconds
            print(f"round {round_}: tp_size={tp}: {rate:6.1f} output tok/s ({seconds:.1f} s; start-up {startup:.1f} s); "
                  f"{same}/{len(tokens)} requests with the tokens of tp_size={sizes[0]}", flush=True)
            if tp not in best or rate > best[tp][0]:
                best[tp] = (rate, startup)
    for tp, (rate, startup) in best.items():
        print(f"best tp_size={tp}: {rate:.1f} output tok/s")


if __name__ == "__main__":
    main()
