"""Multi-LoRA serving speed (issue 33): many adapters on one base model against the base model alone,
cbserve beside vLLM's CPU server with `--enable-lora`, in one command.

Each round starts, per engine, two servers on the default model (its dequantized folder): the base
model alone, and the same model with `--adapters` random PEFT adapters (rank `--rank`, every
attention and MLP projection) declared at start (cbserve: `make serve`'s app with
`engine.enable_lora`, `max_loras` = the adapters, `lora_modules`; vLLM: `--enable-lora
--max-loras --max-lora-rank --lora-modules`). Each server gets bench/serving.py's closed loop:
`--clients` streams of `--prompt-tokens`-token prompts and `--max-tokens` new tokens (EOS ignored,
greedy), after a short warm-up; on the adapter server every request names an adapter drawn at
random (seeded: the same draws for both engines). Engines alternate (cbserve, vLLM, cbserve, ...).

Reports output tok/s, TTFT and ITL p50 of each server, the adapters/base ratio of each engine (the
issue asks >= 0.8 for cbserve) and cbserve/vLLM on the adapter load; writes a JSON to
bench/results/.

    .venv/bin/python bench/lora.py --engines cbserve,vllm --repeat 2
    .venv/bin/python bench/lora.py --engines cbserve --clients 32 --per-client 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import load  # bench/load.py: the SSE client, the machine
import peers  # bench/peers.py: the two servers
import serving  # bench/serving.py: the closed loop and its summary

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(folder: str, count: int, rank: int, seed: int) -> dict[str, str]:
    """`count` random PEFT adapters of the model in `folder` (cached under ~/.cache/cbserve)."""
    root = Path.home() / ".cache" / "cbserve" / "bench-lora" / f"{Path(folder).name}-r{rank}-s{seed}"
    adapters = {f"adapter-{i}": str(root / f"adapter-{i}") for i in range(count)}
    missing = [name for name, path in adapters.items() if not (Path(path) / "adapter_config.json").exists()]
    if missing:
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                          target_modules=TARGETS))
        for name in missing:
            torch.manual_seed(seed * 1000 + int(name.rsplit("-", 1)[1]))
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if "lora_" in param_name:
                        param.normal_(0, 0.02)
            model.save_pretrained(adapters[name])
    return adapters


def start(stack: contextlib.ExitStack, args: argparse.Namespace, engine: str, folder: str,
          adapters: dict[str, str] | None, log: Path) -> str:
    if engine == "vllm":
        extra = []
        if adapters:
            extra = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
                     "--max-cpu-loras", str(len(adapters)),
                     "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
        env = peers.vllm_candidates(args.vllm_kv_gib, peers.find_tcmalloc(), None)[args.vllm_settings]
        return peers.start_vllm_server(stack, args, folder, args.dtype, env, log, extra)
    overrides: dict[str, Any] = {}
    if adapters:
        overrides = {"engine": {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": args.rank},
                     "lora_modules": adapters}
    return peers.start_cbserve_server(stack, args, args.dtype, log, overrides)


def measure(args: argparse.Namespace, engine: str, folder: str, tokenizer: Any, adapters: dict[str, str] | None,
            log: Path) -> dict[str, Any]:
    """One server: a warm-up request per client, then the measured closed loop."""
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        base = start(stack, args, engine, folder, adapters, log)
        ready = time.perf_counter() - started
        target = load.url_target(base, None, os.environ.get("CBSERVE_API_KEY") if engine == "cbserve" else None)
        count = max(8, args.per_client * args.clients)
        rng = random.Random(args.seed)
        names = sorted(adapters) if adapters else [target.model]
        warm_models = [names[i % len(names)] for i in range(args.clients)]
        models = [rng.choice(names) for _ in range(count)]
        warm = serving.make_prompts(tokenizer, args.clients, args.prompt_tokens, args.seed + 1)
        asyncio.run(serving.http_level(target, warm, args.clients, 8, args.request_timeout, ignore_eos=True,
                                       models=warm_models))
        prompts = serving.make_prompts(tokenizer, count, args.prompt_tokens, args.seed + 2)
        records, wall = asyncio.run(serving.http_level(target, prompts, args.clients, args.max_tokens,
                                                       args.request_timeout, ignore_eos=True, models=models))
    s = serving.summarize(records, wall)
    s.pop("per_request_tokens")
    kind = "adapters" if adapters else "base"
    print(f"  {engine} {kind}: ready in {ready:.0f} s; {s['completed']}/{s['requests']} ok, "
          f"{s['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {_ms(s['ttft_p50'])} ms, "
          f"ITL p50 {_ms(s['itl_p50'])} ms; load {load.machine()['load']}", flush=True)
    return {"engine": engine, "kind": kind, "ready_s": ready, **s}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median tok/s per (engine, kind), the adapters/base ratio per engine, cbserve/vLLM."""
    med: dict[str, dict[str, float]] = {}
    for engine in sorted({r["engine"] for r in results}):
        for kind in ("base", "adapters"):
            rates = [r["output_tokens_per_s"] for r in results if r["engine"] == engine and r["kind"] == kind]
            if rates:
                med.setdefault(engine, {})[kind] = statistics.median(rates)
    out: dict[str, Any] = {"tok_per_s": med}
    out["adapters_over_base"] = {e: m["adapters"] / m["base"] for e, m in med.items() if {"base", "adapters"} <= m.keys()}
    if {"cbserve", "vllm"} <= med.keys():
        out["cbserve_over_vllm"] = {k: med["cbserve"][k] / med["vllm"][k] for k in med["cbserve"] if k in med["vllm"]}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=lambda v: v.split(","), default=["cbserve", "vllm"])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 where the CPU has avx512_bf16, else float32")
    p.add_argument("--repeat", type=int, default=1, help="alternating rounds (the median is reported)")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (its dequantized cache folder)")
    p.add_argument("--vllm-python", type=Path, default=peers.DEFAULT_PEER_PYTHON)
    p.add_argument("--vllm-settings", default="all-cores", help="one of bench/peers.py's vLLM candidates")
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not set(args.engines) <= {"cbserve", "vllm"} or args.adapters < 1 or args.repeat < 1:
        p.error("--engines: cbserve and/or vllm; --adapters and --repeat >= 1")
    if args.dtype is None:
        args.dtype = "bfloat16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else "float32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from cbserve.models import checkpoint_folder

    folder = str(checkpoint_folder(args.model))
    engines, version = list(args.engines), None
    if "vllm" in engines:
        version, missing = peers.peer_status(args.vllm_python)
        if missing:
            print(f"SKIPPING vLLM: {missing}", flush=True)
            engines.remove("vllm")
    adapters = make_adapters(folder, args.adapters, args.rank, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    logs = Path(tempfile.mkdtemp(prefix="cbserve-lora-"))
    info = load.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['load']}; {args.dtype}; "
          f"{args.adapters} adapters of rank {args.rank}; vLLM {version}; logs in {logs}", flush=True)
    results = []
    for rnd in range(args.repeat):
        for engine in engines:
            for held in (None, adapters):
                log = logs / f"{engine}-{'adapters' if held else 'base'}-{rnd}.log"
                results.append({**measure(args, engine, folder, tokenizer, held, log), "round": rnd})
    report = {"machine": info, "vllm": version, "args": {k: str(v) for k, v in vars(args).items()}, "rounds": results,
              "summary": summary(results)}
    path = args.json or peers.RESULTS / f"lora-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
