"""Prefix caching on the default model: requests sharing a long system prompt, with and without
block sharing. Prints prompt tokens computed (vs served from cache) and the throughput ratio.

    python bench/prefix_cache.py                       # 64 requests, 400-token system prompt
    python bench/prefix_cache.py --requests 16 --threads 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(model, prompts: list[list[int]], max_new: int, sharing: bool, page_size: int) -> dict:
    from cbserve.config import ContinuousBatchingConfig
    from cbserve.workers.factory import build_engine
    from cbserve.workers.sizing import Workload

    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(page_size=page_size, allow_block_sharing=sharing)
    engine = build_engine(model, gc, cfg, Workload(max_total_tokens=sum(len(p) + max_new for p in prompts),
                                                  num_requests=len(prompts)))
    try:
        requests = [engine.make_request(p, f"req_{i}") for i, p in enumerate(prompts)]
        for r in requests:
            engine.add_request(r)
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        seconds = time.perf_counter() - start
        stats = engine.stats()
        return {
            "seconds": seconds,
            "tokens_per_s": engine.generated_tokens / seconds,
            "computed": stats["prompt_tokens_computed"],
            "hits": stats["prefix_hit_tokens"],
            "outputs": [r.generated for r in requests],
        }
    finally:
        engine.release_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from cbserve.models import load_model

    model, tokenizer = load_model()
    rng = random.Random(0)
    vocab = [t for t in range(model.config.vocab_size) if t not in set(tokenizer.all_special_ids)]
    system = [rng.choice(vocab) for _ in range(args.system_tokens)]
    prompts = [system + [rng.choice(vocab) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
    total = sum(map(len, prompts))
    on = run(model, prompts, args.max_new_tokens, True, args.page_size)
    off = run(model, prompts, args.max_new_tokens, False, args.page_size)
    print(f"{args.requests} requests, {args.system_tokens}-token shared system prompt, {total} prompt tokens, "
          f"{args.max_new_tokens} new tokens each, page_size {args.page_size}, torch threads "
          f"{torch.get_num_threads()}")
    for name, r in (("prefix caching on", on), ("prefix caching off", off)):
        print(f"{name:>20}: prompt tokens computed {r['computed']:>6}, from cache {r['hits']:>6}, "
              f"{r['seconds']:7.1f} s, {r['tokens_per_s']:6.1f} output tok/s")
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"]))
    print(f"throughput ratio on/off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x; "
          f"prompt compute ratio: {off['computed'] / max(on['computed'], 1):.2f}x; "
          f"identical greedy outputs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
