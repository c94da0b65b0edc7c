"""Offline throughput: cbserve vs the `transformers` continuous batching engine vs static `generate()`.

One process, one model, the same prompts and output lengths for every engine, EOS ignored so that
every request generates exactly its length, greedy. Prints output tokens/s per engine, the ratios,
the machine, a matmul roofline (time of `F.linear` over every weight for a 128-token batch) and how
many requests' greedy tokens differ between engines.

    python bench/throughput.py --workload all --dtype bfloat16 --json bench.json
    python bench/throughput.py --workload mixed --requests 8 --engines cbserve,hf_cb
    python bench/throughput.py --workload mixed --engines cbserve,cbserve:speed \
        --cbserve-variant speed='{"batch_invariant": false}'     # A/B of engine settings, one process
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Workload, make_workload, mismatches  # shared with bench/peers.py

ENGINES = ("cbserve", "hf_cb", "hf_static")
STATIC_BATCH = 32
ROOFLINE_TOKENS = 128


@dataclass
class Run:
    workload: str
    engine: str
    requests: int
    output_tokens: int
    seconds: float
    tokens: list[list[int]] = field(repr=False)
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# Real models' shapes for random-weight runs (GPU checks, where the default model's file is absent).
RANDOM_SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936},
}


def random_model(shape: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**RANDOM_SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    model.config._name_or_path = f"random {shape}"
    return model.to(device).eval()


# -- workloads ---------------------------------------------------------------------------------


# make_workload (mixed, decode) lives in bench/common.py.


def greedy_config(max_new_tokens: int, pad_token_id: int | None) -> GenerationConfig:
    """Greedy, EOS ignored: every request generates exactly its length."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id
    )


# -- engines -----------------------------------------------------------------------------------


CBSERVE_OVERRIDES: dict = {}  # --cbserve-config: ContinuousBatchingConfig fields for ablations
VARIANTS: dict[str, dict] = {}  # --cbserve-variant NAME=JSON: engine "cbserve:NAME" with more fields


def run_cbserve(model, work: Workload, pad_id: int | None, page_size: int | None,
                overrides: dict | None = None) -> tuple[list, str]:
    """The loop of `generate_batch`, with each request's own max_new_tokens (which `generate_batch`'s
    single generation config cannot express), and the engine's host overhead share."""
    from cbserve.config import ContinuousBatchingConfig
    from cbserve.workers.factory import build_engine
    from cbserve.workers.sizing import Workload as EngineWorkload

    overrides = {**CBSERVE_OVERRIDES, **(overrides or {})}
    cb_config = ContinuousBatchingConfig(**({} if page_size is None else {"page_size": page_size}), **overrides)
    engine = build_engine(
        model,
        greedy_config(max(work.lengths), pad_id),
        cb_config,
        EngineWorkload(max_total_tokens=sum(len(p) + n for p, n in zip(work.prompts, work.lengths, strict=True)),
                       num_requests=len(work.prompts)),
    )
    try:
        requests = [
            engine.make_request(list(p), f"req_{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(zip(work.prompts, work.lengths, strict=True))
        ]
        for request in requests:
            engine.add_request(request)
        while engine.has_work:
            engine.step()
        t = engine.timings
        host = (t["schedule"] + t["prepare"]) / max(sum(t.values()), 1e-9)
        packed = f", {len(engine.packed_linears)} packed linears" if engine.packed_linears else ""
        note = (f"EngineCore ({engine.attention_backend} attention{packed}); host overhead "
                f"(schedule+prepare) {100 * host:.1f}% of step time")
        if overrides:
            note += f"; config {json.dumps(overrides)}"
        return [r.snapshot().generated_tokens for r in requests], note
    finally:
        engine.release_model()


def run_hf_cb(model, work: Workload, pad_id: int | None, page_size: int | None) -> tuple[list, str]:
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cb_config = ContinuousBatchingConfig(**({} if page_size is None else {"page_size": page_size}))
    hints = WorkloadHints(
        max_prompt_length=max(map(len, work.prompts)),
        max_generated_length=max(work.lengths),
        num_requests=len(work.prompts),
    )
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=greedy_config(max(work.lengths), pad_id),
        continuous_batching_config=cb_config,
        warmup=False,
        workload_hints=hints,
    ) as manager:
        for i, (prompt, n) in enumerate(zip(work.prompts, work.lengths, strict=True)):
            manager.add_request(prompt, request_id=f"req_{i}", max_new_tokens=n)
        while len(results) < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the transformers continuous batching thread stopped early")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
    return [results[f"req_{i}"].generated_tokens for i in range(len(work.prompts))], "generation_manager"


def run_hf_static(model, work: Workload, pad_id: int | None, page_size: int | None) -> tuple[list, str]:
    """Batches of 32 in submission order, left padded, each batch run to its longest output."""
    pad = 0 if pad_id is None else pad_id
    out: list[list[int]] = []
    for start in range(0, len(work.prompts), STATIC_BATCH):
        prompts = work.prompts[start : start + STATIC_BATCH]
        lengths = work.lengths[start : start + STATIC_BATCH]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        gen = model.generate(ids, attention_mask=mask, generation_config=greedy_config(max(lengths), pad_id))
        out.extend(gen[row, width : width + n].tolist() for row, n in enumerate(lengths))
    return out, f"generate(), batches of {STATIC_BATCH}"


RUNNERS: dict[str, Callable] = {"cbserve": run_cbserve, "hf_cb": run_hf_cb, "hf_static": run_hf_static}


def timed_run(engine: str, model, work: Workload, pad_id: int | None, page_size: int | None) -> Run:
    gc.collect()
    start = time.perf_counter()
    with torch.inference_mode():
        if engine.startswith("cbserve:"):
            tokens, note = run_cbserve(model, work, pad_id, page_size, VARIANTS[engine.split(":", 1)[1]])
        else:
            tokens, note = RUNNERS[engine](model, work, pad_id, page_size)
    seconds = time.perf_counter() - start
    produced = [len(t) for t in tokens]
    if produced != work.lengths:
        short = sum(p != n for p, n in zip(produced, work.lengths, strict=True))
        note += f"; WARNING {short} requests did not produce exactly their length"
    useful = sum(min(p, n) for p, n in zip(produced, work.lengths, strict=True))
    return Run(work.name, engine, len(work.prompts), useful, seconds, tokens, note)


# -- checks and roofline -----------------------------------------------------------------------


def alone_reference(model, work: Workload, count: int, pad_id: int | None) -> list[list[int]]:
    """`model.generate()` on each of the first `count` prompts alone: the SPEC's reference."""
    out = []
    with torch.inference_mode():
        for prompt, n in list(zip(work.prompts, work.lengths, strict=True))[:count]:
            ids = torch.tensor([prompt], device=model.device)
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(n, pad_id)
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out


def _best_time(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    for _ in range(2):  # warm-up
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def roofline(model, tokens: int = ROOFLINE_TOKENS, repeats: int = 5) -> dict[str, float]:
    """Best time of `F.linear` over every weight matrix (all layers' projections and lm_head), and on a
    CPU the same with packed weights and the kernel cbserve's engine uses there (`prepack_weights`:
    the C++ panel kernel, else oneDNN)."""
    from cbserve.kernels import packed_linear

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    sync = torch.cuda.synchronize if weights[0].is_cuda else (lambda: None)
    with torch.inference_mode():
        best = _best_time(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], sync, repeats)
        packed_best, packed_kind = None, None
        if not packed_linear.unavailable_reason(weights[0].device, weights[0].dtype):
            packed = [packed_linear.PackedLinear(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]
            packed_best = _best_time(lambda: [p(inputs[p.in_features]) for p in packed], sync, repeats)
            packed_kind = packed[0].extra_repr().split("packed for ")[-1]
            del packed
    flops = sum(2 * tokens * w.numel() for w in weights)
    return {
        "matrices": len(weights),
        "seconds": best,
        "gflops": flops / best / 1e9,
        "tokens_per_s_ceiling": tokens / best,
        "packed_seconds": packed_best,
        "packed_kernel": packed_kind,
    }


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")


def machine() -> dict[str, object]:
    from cbserve.kernels import cpu_isa

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "isa_flags": [f for f in ISA_FLAGS if f in cpu_isa.cpu_flags()],
        "kernel_path": cpu_isa.selected(),
    }


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=["mixed", "decode", "all"], default="all")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    parser.add_argument("--requests", type=int, default=None, help="shrink each workload to N requests")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--random-shape", choices=sorted(RANDOM_SHAPES), default=None,
                        help="a random-weight model of a real model's shape instead of --model (no files needed)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="model dtype for every engine; auto: bfloat16 where the CPU has native bfloat16 dot "
                        "products, else float32 (bfloat16 on CUDA)")
    parser.add_argument("--page-size", type=int, default=None, help="KV page size for both CB engines")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="time each engine N times, keep the best")
    parser.add_argument(
        "--check-alone",
        type=int,
        default=0,
        metavar="K",
        help="also compare cbserve with model.generate() on each of the first K prompts alone",
    )
    parser.add_argument("--cbserve-config", type=json.loads, default={}, metavar="JSON",
                        help='extra ContinuousBatchingConfig fields for cbserve, e.g. \'{"prepack_weights": false}\'')
    parser.add_argument("--cbserve-variant", action="append", default=[], metavar="NAME=JSON",
                        help='an extra engine "cbserve:NAME" with these ContinuousBatchingConfig fields, e.g. '
                        'speed=\'{"batch_invariant": false}\' (add cbserve:NAME to --engines)')
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for variant in args.cbserve_variant:
        name, _, fields = variant.partition("=")
        try:
            VARIANTS[name] = json.loads(fields)
        except json.JSONDecodeError as error:
            parser.error(f"--cbserve-variant {variant!r}: {error}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES) - {f"cbserve:{name}" for name in VARIANTS}
    if unknown or not engines:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {ENGINES}")
    args.engines = engines
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be >= 1")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cbserve.models import load_model

    CBSERVE_OVERRIDES.update(args.cbserve_config)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from cbserve.kernels.cpu_isa import resolve_dtype

    dtype = torch.bfloat16 if args.dtype == "auto" and args.device == "cuda" else resolve_dtype(args.dtype)
    if args.random_shape:
        model, pad_id, special = random_model(args.random_shape, args.device, dtype), 0, {0}
    else:
        model, tokenizer = load_model(args.model, dtype=dtype)
        model = model.to(args.device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        special = set(tokenizer.all_special_ids)
    model.generation_config.eos_token_id = None  # generate() would otherwise fill EOS back in
    allowed = [t for t in range(model.config.vocab_size) if t not in special]
    names = ["mixed", "decode"] if args.workload == "all" else [args.workload]
    workloads = [make_workload(n, allowed, args.requests, args.seed) for n in names]
    info = {"machine": machine(), "model": model.config._name_or_path, "dtype": str(model.dtype)}
    print(
        "machine: {cpu}, {cores} cores ({usable_cores} usable), torch {torch}, {torch_threads} threads, "
        "load average {load_average_1min:.1f} before the run".format(**info["machine"])
    )
    print(f"CPU flags: {' '.join(info['machine']['isa_flags']) or 'none of ' + ' '.join(ISA_FLAGS)}; "
          f"cbserve kernel path {info['machine']['kernel_path']}; model dtype {info['dtype']}")

    warm = Workload("warmup", [allowed[:16], allowed[16:48], allowed[48:56], allowed[56:80]], [4, 8, 2, 6])
    for engine in args.engines:
        print(f"warming up {engine} ...", flush=True)
        timed_run(engine, model, warm, pad_id, args.page_size)

    runs: list[Run] = []
    for work in workloads:
        best: dict[str, Run] = {}
        for rep in range(args.repeat):  # round-robin, so that a burst of load does not hit one engine only
            for engine in args.engines:
                print(
                    f"running {work.name} ({len(work.prompts)} requests, {sum(work.lengths)} output tokens) "
                    f"on {engine}, try {rep + 1}/{args.repeat} ...",
                    flush=True,
                )
                run = timed_run(engine, model, work, pad_id, args.page_size)
                print(f"  {run.tokens_per_s:.1f} tok/s in {run.seconds:.1f} s", flush=True)
                if engine not in best or run.seconds < best[engine].seconds:
                    best[engine] = run
        runs.extend(best[engine] for engine in args.engines)

    checks = check_tokens(model, workloads, runs, args.check_alone, pad_id)
    roof = None if args.no_roofline else roofline(model)
    report(runs, checks, roof)
    if args.json:
        payload = {
            **info,
            "runs": [{**asdict(r), "tokens": None, "tokens_per_s": r.tokens_per_s} for r in runs],
            "token_checks": checks,
            "roofline": roof,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


def check_tokens(model, workloads: list[Workload], runs: list[Run], alone: int, pad_id) -> list[dict]:
    """Greedy tokens of every pair of engines that ran, and cbserve vs single-prompt generate()."""
    checks = []
    for work in workloads:
        by_engine = {r.engine: r.tokens for r in runs if r.workload == work.name}
        pairs = [("cbserve", "hf_static"), ("cbserve", "hf_cb"), ("hf_cb", "hf_static")]
        pairs += [("cbserve", e) for e in by_engine if e.startswith("cbserve:")]
        for a, b in pairs:
            if a in by_engine and b in by_engine:
                diff = mismatches(by_engine[a], by_engine[b])
                checks.append(
                    {
                        "workload": work.name,
                        "a": a,
                        "b": b,
                        "requests": len(work.prompts),
                        "mismatched": len(diff),
                        "first_positions": diff[:8],
                    }
                )
        if alone and "cbserve" in by_engine:
            ref = alone_reference(model, work, alone, pad_id)
            diff = mismatches(by_engine["cbserve"][: len(ref)], ref)
            checks.append(
                {
                    "workload": work.name,
                    "a": "cbserve",
                    "b": "generate() alone",
                    "requests": len(ref),
                    "mismatched": len(diff),
                    "first_positions": diff[:8],
                }
            )
    return checks


def report(runs: list[Run], checks: list[dict], roof: dict[str, float] | None) -> None:
    print()
    print(
        f"{'workload':<8} {'engine':<14} {'requests':>8} {'out tokens':>10} {'seconds':>8} {'tok/s':>9}  how"
    )
    for r in runs:
        print(
            f"{r.workload:<8} {r.engine:<14} {r.requests:>8} {r.output_tokens:>10} {r.seconds:>8.2f} "
            f"{r.tokens_per_s:>9.1f}  {r.note}"
        )
    rate = {(r.workload, r.engine): r.tokens_per_s for r in runs}
    for workload in dict.fromkeys(r.workload for r in runs):
        mine = rate.get((workload, "cbserve"))
        others = ["hf_cb", "hf_static"] + [e for w, e in rate if w == workload and e.startswith("cbserve:")]
        for other in others:
            if mine and (workload, other) in rate:
                print(f"{workload}: cbserve/{other} = {mine / rate[(workload, other)]:.2f}x")
    for c in checks:
        where = f" (request, first differing position): {c['first_positions']}" if c["mismatched"] else ""
        print(
            f"{c['workload']}: greedy tokens {c['a']} vs {c['b']}: "
            f"{c['mismatched']}/{c['requests']} requests differ{where}"
        )
    if roof:
        print(
            f"roofline: F.linear over {roof['matrices']} weight matrices for {ROOFLINE_TOKENS} tokens takes "
            f"{roof['seconds'] * 1e3:.1f} ms ({roof['gflops']:.1f} GFLOP/s): "
            f"ceiling {roof['tokens_per_s_ceiling']:.0f} tok/s"
        )
        packed = roof.get("packed_seconds")
        if packed:
            print(f"  the same with packed weights ({roof['packed_kernel']}, cbserve's CPU GEMMs): {packed * 1e3:.1f} ms, "
                  f"ceiling {ROOFLINE_TOKENS / packed:.0f} tok/s")
        if ("decode", "cbserve") in rate:
            share = rate[("decode", "cbserve")] / roof["tokens_per_s_ceiling"]
            print(f"cbserve decode throughput = {share:.1%} of the matmul ceiling")
            if packed:
                print(f"  and {rate[('decode', 'cbserve')] * packed / ROOFLINE_TOKENS:.1%} of the packed-weights ceiling")


if __name__ == "__main__":
    sys.exit(main())
