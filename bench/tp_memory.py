"""Peak memory (RSS) of every process of a tensor-parallel engine, loading included.

Each tensor-parallel size runs in a fresh Python process (so that one run's memory does not
count in the next): it loads the model (`--loader shard`: every rank reads only its own shard
from the checkpoint, `cbserve.models.load_model_shard`; `--loader full`: rank 0 loads the whole model
with `cbserve.load_model` and the engine shards it), runs a few greedy requests, and reports the
peak resident set of rank 0 (`ru_maxrss`) and of every other rank (`VmHWM` of /proc/<pid>/status,
read before the ranks exit). The ratio compares the largest process of each size to tp_size 1.
`--quantization auto|int8`: every rank runs its shard on quantized blocks; the weights rank 0
then holds are reported too (the peak includes the dense shard it quantized from).

    python bench/tp_memory.py --tp-sizes 1,3 --dtype float32
    python bench/tp_memory.py --tp-sizes 1,3 --dtype bfloat16 --quantization auto
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def vm_hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import GenerationConfig

    import cbserve
    from cbserve.models import load_model_shard
    from cbserve.workers.factory import build_engine
    from cbserve.workers.sizing import Workload

    torch.set_num_threads(1)
    start = time.perf_counter()
    if args.tp_size > 1 and args.loader == "shard":
        model, _ = load_model_shard(args.model, 0, args.tp_size, dtype=args.dtype, tokenizer=False)
    else:
        model, _ = cbserve.load_model(args.model, dtype=args.dtype)
    loaded = time.perf_counter() - start
    prompts = [torch.randint(3, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.requests)]
    gc = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
    cfg = cbserve.ContinuousBatchingConfig(tp_size=args.tp_size, quantization=args.quantization)
    hint = Workload(max_total_tokens=args.requests * (args.prompt_tokens + args.new_tokens),
                    num_requests=args.requests)
    engine = build_engine(model, gc, cfg, hint)
    del model
    try:
        requests = [engine.make_request(p, f"req_{i}") for i, p in enumerate(prompts)]
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
        pids = engine.parallel.rank_pids if engine.parallel is not None else []
        others = [vm_hwm_mib(pid) for pid in pids]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*engine.model.parameters(), *engine.model.buffers())}
        weights = sum(storages.values()) / 2**20  # parameters and quantized blocks, each storage once
    finally:
        engine.release_model()
    rank0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tp_size": args.tp_size, "ranks_mib": [rank0, *others], "load_s": loaded,
                      "rank0_weights_mib": weights, "tokens": [r.generated for r in requests]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-sizes", default="1,3")
    parser.add_argument("--loader", choices=["shard", "full"], default="shard")
    parser.add_argument("--quantization", choices=["none", "auto", "int8"], default="none")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--tp-size", type=int, default=None, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.tp_size is not None:
        child(args)
        return
    results = {}
    for tp in (int(s) for s in args.tp_sizes.split(",")):
        cmd = [sys.executable, __file__, "--tp-size", str(tp), "--dtype", args.dtype, "--loader", args.loader, "--quantization", args.quantization,
               "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ})
        results[tp] = json.loads(out.stdout.strip().splitlines()[-1])
    base = max(results[min(results)]["ranks_mib"])
    first = results[min(results)]["tokens"]
    print(f"model {args.model or 'default'}, dtype {args.dtype}, loader {args.loader}, "
          f"quantization {args.quantization}, "
          f"{args.requests} requests x ({args.prompt_tokens} + {args.new_tokens}) tokens")
    for tp, r in results.items():
        ranks = ", ".join(f"{m:.0f}" for m in r["ranks_mib"])
        same = "same tokens" if r["tokens"] == first else "DIFFERENT tokens"
        print(f"tp_size={tp}: peak RSS per rank [{ranks}] MiB; largest {max(r['ranks_mib']):.0f} MiB = "
              f"{max(r['ranks_mib']) / base:.2f} of tp_size={min(results)}; rank 0 weights "
              f"{r['rank0_weights_mib']:.0f} MiB; load {r['load_s']:.1f} s; {same}")


if __name__ == "__main__":
    main()
