"""The cost of per-request sampling controls (issue 17's speed check), through the manager.

Two batches over the same prompts, the same number of requests and output tokens each:

- plain: greedy, nothing per request (the engine's fast path);
- controlled: every request has presence, frequency and repetition penalties, a logit_bias, a
  grammar (a JSON list of strings that never closes, so no request ends early: the token bitmask
  is filled and applied at every step) and top-20 logprobs.

EOS is off in both (the plain batch passes no EOS id; the controlled one biases it by -100), so
every request generates exactly `--new-tokens`. Prints each batch's output tokens/s (best of
`--repeat`) and the controlled batch's share of the plain one; the target is >= 85%. Also the
time spent in the sampler (logits processors, grammar masks, sampling, top logprobs, and
advancing each request's penalties and grammar by its token) per batch, which a loaded machine
inflates less than it does the throughput: with it, the share is also estimated as
plain seconds / (plain seconds + the controlled batch's extra sampler seconds).

    python bench/sampling_overhead.py                      # default model, 16 requests x 64 tokens
    python bench/sampling_overhead.py --requests 32 --new-tokens 128 --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cbserve
from cbserve.workers import sampler as sampler_module
from cbserve.workers.structured import StructuredOutputs

SAMPLER_SECONDS = [0.0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SAMPLER_SECONDS[0] += time.perf_counter() - start
    return wrapper


sampler_module.Sampler.__call__ = _timed(sampler_module.Sampler.__call__)
sampler_module.Sampler.observe = _timed(sampler_module.Sampler.observe)

GRAMMAR = 'root ::= "[" item ("," item)*\nitem ::= "\\"" [a-z ]* "\\""'
WORDS = ["the", "a", "of", "to", "in", "is", "sea", "wave", "capital", "france", "paris", "model", "engine",
         "batch", "token", "cache", "page"]


def prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(length))).input_ids
        out.append(ids[:length])
    return out


def run_batch(manager, batch: list[list[int]], new_tokens: int, options: dict) -> tuple[int, float]:
    """(output tokens, seconds) of one batch submitted at once."""
    SAMPLER_SECONDS[0] = 0.0
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=new_tokens, **options) for p in batch]
    tokens = 0
    for rid in ids:
        out = None
        for out in manager.request_id_iter(rid):
            pass
        assert out.error is None, out.error
        tokens += len(out.generated_tokens)
    return tokens, time.perf_counter() - start


def controlled_options(tokenizer, model) -> dict:
    eos = tokenizer.eos_token_id
    grammar = StructuredOutputs(tokenizer, model.config.vocab_size, [eos]).compile("grammar", GRAMMAR)
    return {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
            "logit_bias": {eos: -100.0}, "top_logprobs": 20, "grammar": grammar, "eos_token_id": []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = cbserve.load_model(args.model, dtype=args.dtype)
    cfg = cbserve.ContinuousBatchingConfig(per_request_processors=True, return_logprobs=False)
    manager = cbserve.init_continuous_batching(
        model, generation_config=GenerationConfig(max_new_tokens=args.new_tokens), continuous_batching_config=cfg)
    manager.start()
    batch = prompts(tokenizer, args.requests, args.prompt_tokens)
    kinds = {"plain": {"eos_token_id": []}, "controlled": controlled_options(tokenizer, model)}
    best: dict[str, float] = {}
    sampler_s: dict[str, list[float]] = {name: [] for name in kinds}
    wall_s: dict[str, list[float]] = {name: [] for name in kinds}
    try:
        run_batch(manager, batch[:2], 4, kinds["controlled"])  # warm up both paths
        run_batch(manager, batch[:2], 4, kinds["plain"])
        for r in range(args.repeat):
            for name, options in kinds.items():
                tokens, seconds = run_batch(manager, batch, args.new_tokens, options)
                assert tokens == args.requests * args.new_tokens, tokens
                best[name] = max(best.get(name, 0.0), tokens / seconds)
                sampler_s[name].append(SAMPLER_SECONDS[0])
                wall_s[name].append(seconds)
                print(f"run {r} {name:10s} {tokens} tokens in {seconds:6.2f} s: {tokens / seconds:7.1f} tok/s, "
                      f"sampler {SAMPLER_SECONDS[0]:5.2f} s", flush=True)
    finally:
        manager.stop(timeout=30)
        manager.destroy()
    share = best["controlled"] / best["plain"]
    print(f"plain {best['plain']:.1f} tok/s, controlled {best['controlled']:.1f} tok/s: "
          f"{100 * share:.1f}% of plain (target >= 85%)")
    plain_s, extra = min(wall_s["plain"]), min(sampler_s["controlled"]) - min(sampler_s["plain"])
    estimate = plain_s / (plain_s + extra)
    print(f"sampler time per batch: plain {min(sampler_s['plain']):.3f} s, controlled "
          f"{min(sampler_s['controlled']):.3f} s; plain batch {plain_s:.2f} s: estimated share {100 * estimate:.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({**vars(args), "best_tok_s": best, "share": share,
                                               "sampler_s": sampler_s, "wall_s": wall_s,
                                               "estimated_share": estimate}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
