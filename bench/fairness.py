"""Fairness under a fan-out: the time to first token of one short request while another client
sends 512-choice requests (64 prompts x n=8 on /v1/completions) back to back, against the same
short request on the idle server (issue 26; target: within 2x).

The fan-out client and the probe client are two tenants (two API keys of the app) unless
`--one-tenant`; either way each API call is its own parent request in the engine's fair share
(`cbserve/scheduler/fair_share.py`). The probe streams (`stream: true`) and its TTFT is the
arrival of its first content chunk; probes run one after another, `--gap-s` apart, and a probe
counts as "busy" only if a fan-out request was in flight for its whole duration.

    python bench/fairness.py                                  # make serve's app (ray_config.yaml), local Ray
    python bench/fairness.py --engine '{"parent_step_tokens": 0}' # no per-step cap on one call's choices
    python bench/fairness.py --url http://127.0.0.1:8000 --api-key KEY   # a running `make serve`
    python bench/fairness.py --manager                        # the engine alone (default config), in this process

Each run times `--alone` fan-out requests with nothing else running first (the fan-out's own
throughput), then the probes on the idle server, then the probes while fan-outs run back to back.

Measured (default model, float32, 2 CPU cores shared with other jobs, 64 x 8 choices of 8 tokens,
6 probes of 4 tokens). TTFT median idle -> busy, and the fan-out's tok/s alone:
- manager (`--manager`, default config; bench/results/fairness-manager-*.json), one after the other:
  before (`--engine '{"parent_step_tokens": 0, "held_step_tokens": null}'`): 96 -> 2696 ms (28x),
  136 tok/s; with `parent_step_tokens` 64 and `held_step_tokens` 4: 98 -> 553 ms (5.7x), 57 tok/s;
- served (make serve's app, worker.max_ongoing_requests 1024; bench/results/fairness-served-*.txt):
  before: 109 -> 5503 ms (50x), 123 tok/s; with `parent_step_tokens` 64: 314 -> 565 ms (1.8x),
  63 tok/s, in a run that shared the cores with other jobs (its idle TTFT is 3x the other's).
The per-step cap cost more than half the fan-out's throughput, so it is off by default
(`held_step_tokens` 4 alone is the default: it costs nothing while the fan-out is alone).
On a CPU a step's time grows with its tokens and cannot be interrupted, so a newcomer waits for
the step in flight (half of one on average) and then for its own: `held_step_tokens` keeps its
own step short at no cost to throughput, `parent_step_tokens` bounds the step in flight, which
costs a fan-out the fixed cost of each extra step.
Session 17 (a 2-core AMX Xeon, `--manager --probes 12`): `shared_parent_step_tokens` (16 on a CPU
by default) caps a call's steps only while another tenant or parent is live or was within
`shared_window_s`: 1.32-1.84x with the fan-out at 528-547 tok/s alone and 364-405 beside the
probes, against 1.83-5.78x with it off (`--engine '{"shared_parent_step_tokens": 0}'`).
Serve's `worker.max_ongoing_requests` must be at least one call's choices (ray_config.yaml: 1024):
beyond it they queue in the replica first come first served, before the engine's fair share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import load  # bench/load.py: the SSE client, the local Ray + Serve app

FANOUT_KEY, PROBE_KEY = "fanout-tenant-key", "probe-tenant-key"


@dataclass
class FanOut:
    """The fan-out client's requests: (start, end, completion tokens or an error)."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    in_flight_since: float | None = None


def fanout_body(target: load.Target, prompts: int, n: int, max_tokens: int, round_: int) -> dict[str, Any]:
    words = load.WORDS
    texts = [f"{load.TASKS[i % len(load.TASKS)]} {words[(round_ * 7 + i) % len(words)]} {words[i % len(words)]}"
             for i in range(prompts)]
    return {"model": target.model, "prompt": texts, "n": n, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}


async def fanout_request(session: aiohttp.ClientSession, target: load.Target, args: argparse.Namespace,
                         state: FanOut, round_: int) -> None:
    """One fan-out request, waited for; its span and tokens (or error) go to `state`."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = state.in_flight_since = time.perf_counter()
    body = fanout_body(target, args.prompts, args.n, args.fanout_max_tokens, round_)
    try:
        async with session.post(target.base_url + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=args.timeout_s)) as resp:
            reply = await resp.json(content_type=None)
        if resp.status != 200:
            state.errors.append(f"http_{resp.status}: {str(reply)[:200]}")
        else:
            state.tokens += reply["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        state.errors.append(f"{type(exc).__name__}: {exc}")
    state.in_flight_since = None
    state.spans.append((start, time.perf_counter()))


async def fanout_loop(session: aiohttp.ClientSession, target: load.Target, args: argparse.Namespace,
                      state: FanOut, stop: asyncio.Event) -> None:
    """Send fan-out requests back to back until `stop` is set (the one in flight then finishes)."""
    round_ = 1  # round 0 ran alone
    while not stop.is_set():
        await fanout_request(session, target, args, state, round_)
        round_ += 1


async def probe(session: aiohttp.ClientSession, target: load.Target, args: argparse.Namespace, index: int) -> load.Result:
    spec = load.RequestSpec(index=index, prompt=f"Continue this text: {load.WORDS[index % len(load.WORDS)]}",
                            max_tokens=args.probe_max_tokens)
    return await load.stream_request(session, target, spec, load.Sampling(endpoint="completions", ignore_eos=True),
                                     args.timeout_s)


async def probes(session: aiohttp.ClientSession, target: load.Target, args: argparse.Namespace, first: int,
                 state: FanOut | None = None) -> list[float]:
    """TTFTs (s) of `args.probes` probes, one after another; with `state`, only those that ran
    wholly inside one fan-out request."""
    ttfts = []
    for i in range(args.probes):
        await asyncio.sleep(args.gap_s)
        began = state.in_flight_since if state is not None else None
        res = await probe(session, target, args, first + i)
        if not res.ok or res.ttft is None:
            print(f"probe {first + i} failed: {res.error} {res.detail}", flush=True)
            continue
        if state is not None and (began is None or state.in_flight_since != began):
            continue  # no fan-out in flight for the whole probe
        ttfts.append(res.ttft)
    return ttfts


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median_ms": None, "p90_ms": None}
    ordered = sorted(values)
    return {"n": len(values), "median_ms": 1000 * statistics.median(values),
            "p90_ms": 1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


async def measure(target: load.Target, args: argparse.Namespace) -> dict[str, Any]:
    fan_target = target if args.one_tenant else load.Target(**{**target.__dict__, "api_key": args.fanout_key})
    probe_target = target if args.one_tenant else load.Target(**{**target.__dict__, "api_key": args.probe_key})
    async with aiohttp.ClientSession() as session:
        await probes(session, probe_target, argparse.Namespace(**{**vars(args), "probes": 2}), 10**6)  # warm-up
        idle = await probes(session, probe_target, args, 0)
        alone = FanOut()
        progress("idle", idle)
        for _ in range(args.alone):  # the fan-out's throughput with nothing else running
            await fanout_request(session, fan_target, args, alone, 0)
        progress("alone", alone=alone)
        state, stop = FanOut(), asyncio.Event()
        t0 = time.perf_counter()
        loop = asyncio.ensure_future(fanout_loop(session, fan_target, args, state, stop))
        await asyncio.sleep(args.settle_s)  # the first fan-out admitted and decoding
        busy = await probes(session, probe_target, args, 1000, state)
        progress("busy", busy)
        stop.set()
        await loop
        wall = time.perf_counter() - t0
    return summary(idle, busy, alone, state, wall, args)


# -- --manager: the engine alone (a manager in this process: no HTTP, no Ray) -------------------


def manager_probe(manager: Any, prompt: list[int], args: argparse.Namespace, index: int) -> float:
    """TTFT (s) of one streamed probe, from submission to its first token."""
    start = time.perf_counter()
    rid = manager.add_request(prompt, max_new_tokens=args.probe_max_tokens, streaming=True, tenant="probe",
                              parent_id=f"probe-{index}")
    ttft = None
    for out in manager.request_id_iter(rid):
        if ttft is None and out.generated_tokens:
            ttft = time.perf_counter() - start
    return ttft


def manager_fanout_request(manager: Any, prompts: list[list[int]], args: argparse.Namespace, state: FanOut,
                           round_: int) -> None:
    start = state.in_flight_since = time.perf_counter()
    tenant = "probe" if args.one_tenant else "fanout"
    rids = [manager.add_request(p, max_new_tokens=args.fanout_max_tokens, tenant=tenant,
                                parent_id=f"fanout-{round_}") for p in prompts for _ in range(args.n)]
    for rid in rids:
        out = manager.get_result(rid, timeout=args.timeout_s)
        state.tokens += len(out.generated_tokens) if out is not None else 0
    state.in_flight_since = None
    state.spans.append((start, time.perf_counter()))


def manager_fanout(manager: Any, prompts: list[list[int]], args: argparse.Namespace, state: FanOut,
                   stop: threading.Event) -> None:
    round_ = 1  # round 0 ran alone
    while not stop.is_set():
        manager_fanout_request(manager, prompts, args, state, round_)
        round_ += 1


def manager_probes(manager: Any, tokenizer: Any, args: argparse.Namespace, first: int,
                   state: FanOut | None = None) -> list[float]:
    ttfts = []
    for i in range(args.probes):
        time.sleep(args.gap_s)
        began = state.in_flight_since if state is not None else None
        prompt = tokenizer(f"Continue this text: {load.WORDS[(first + i) % len(load.WORDS)]}").input_ids
        ttft = manager_probe(manager, prompt, args, first + i)
        if state is None or (began is not None and state.in_flight_since == began):
            ttfts.append(ttft)
    return ttfts


def measure_manager(args: argparse.Namespace) -> dict[str, Any]:
    """The same measurement on the engine alone: a manager in this process."""
    from transformers import GenerationConfig

    import cbserve
    from cbserve.models import load_model

    model, tokenizer = load_model(args.model, dtype="float32")
    gc = GenerationConfig(do_sample=False, eos_token_id=None)  # every choice runs to its max_new_tokens
    manager = cbserve.ContinuousBatchingManager(model, gc, cbserve.ContinuousBatchingConfig(**json.loads(args.engine)))
    manager.start()
    try:
        body = fanout_body(load.Target("manager", "", ""), args.prompts, args.n, args.fanout_max_tokens, 0)
        prompts = [tokenizer(t).input_ids for t in body["prompt"]]
        manager_probes(manager, tokenizer, argparse.Namespace(**{**vars(args), "probes": 2}), 10**6)  # warm-up
        idle = manager_probes(manager, tokenizer, args, 0)
        alone = FanOut()
        progress("idle", idle)
        for _ in range(args.alone):
            manager_fanout_request(manager, prompts, args, alone, 0)
        progress("alone", alone=alone)
        state, stop = FanOut(), threading.Event()
        t0 = time.perf_counter()
        loop = threading.Thread(target=manager_fanout, args=(manager, prompts, args, state, stop))
        loop.start()
        time.sleep(args.settle_s)
        busy = manager_probes(manager, tokenizer, args, 1000, state)
        progress("busy", busy)
        stop.set()
        loop.join()
        wall = time.perf_counter() - t0
    finally:
        manager.stop()
    return summary(idle, busy, alone, state, wall, args)


def progress(phase: str, ttfts: list[float] | None = None, alone: FanOut | None = None) -> None:
    """A phase's figures as it ends (a run cut short by a timeout still shows them)."""
    if ttfts is not None:
        print(f"{phase}: TTFT ms {[round(1000 * t) for t in ttfts]}", flush=True)
    if alone is not None:
        seconds = sum(e - s for s, e in alone.spans)
        print(f"{phase}: {alone.tokens} tokens in {seconds:.1f} s, errors {alone.errors[:2]}", flush=True)


def summary(idle: list[float], busy: list[float], alone: FanOut, state: FanOut, wall: float,
            args: argparse.Namespace) -> dict:
    idle_s, busy_s = _stats(idle), _stats(busy)
    ratio = (busy_s["median_ms"] / idle_s["median_ms"]) if idle_s["median_ms"] and busy_s["median_ms"] else None
    alone_s = sum(e - s for s, e in alone.spans)
    return {"idle_ttft": idle_s, "busy_ttft": busy_s, "busy_over_idle_median": ratio,
            "fanout_alone": {"requests": len(alone.spans), "completion_tokens": alone.tokens,
                             "tokens_per_s": alone.tokens / alone_s if alone_s else None, "errors": alone.errors[:5]},
            "fanout": {"requests": len(state.spans), "choices_each": args.prompts * args.n,
                       "completion_tokens": state.tokens, "tokens_per_s": state.tokens / wall,
                       "seconds_each": [round(e - s, 2) for s, e in state.spans], "errors": state.errors[:5]}}


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """`make serve`'s app (the args of `--config`, by default ray_config.yaml) with one worker
    replica of `--cpus` CPUs, `--engine` and `--worker` laid over, and the two clients' API keys."""
    import yaml

    app = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    worker = {k: v for k, v in app.get("worker", {}).items() if k != "autoscaling"}
    app["worker"] = {**worker, "num_replicas": 1, "num_cpus": args.cpus, **json.loads(args.worker)}
    app["engine"] = {**app.get("engine", {}), **json.loads(args.engine)}
    limits = app.setdefault("limits", {})
    for name, wanted in (("max_prompts", args.prompts), ("max_n", args.n),
                         ("max_tokens", max(args.fanout_max_tokens, args.probe_max_tokens))):
        if name in limits and limits[name] is None:  # no limit (max_tokens: the context)
            continue
        limits[name] = max(limits.get(name, wanted), wanted)
    if args.model:
        app["model"] = args.model
    if not args.one_tenant:
        app["api_keys"] = [args.fanout_key, args.probe_key]
    return app


def start_target(stack: contextlib.ExitStack, args: argparse.Namespace) -> load.Target:
    if args.url:
        return load.url_target(args.url, args.model_name, args.api_key)
    app = app_args(args)
    return load.start_cbserve(stack, app.pop("model", None), args.cpus, app.pop("engine"), app)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server instead of a local Ray + Serve app")
    p.add_argument("--manager", action="store_true", help="the engine alone: a manager in this process (no HTTP)")
    p.add_argument("--api-key", help="with --url: the key of both clients (one tenant)")
    p.add_argument("--model-name", help="with --url: the served model name")
    p.add_argument("--model", help="model folder or HF id for the local app (default: the default model)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local app's worker replica")
    p.add_argument("--engine", default="{}", help="JSON: ContinuousBatchingConfig fields of the local app (over "
                   "--config's) or of the manager")
    p.add_argument("--config", default=str(ROOT / "ray_config.yaml"), help="the local app's Serve config")
    p.add_argument("--worker", default="{}", help="JSON: worker settings of the local app, over --config's")
    p.add_argument("--alone", type=int, default=1, help="fan-out requests timed alone (no probes) first")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--fanout-max-tokens", type=int, default=16)
    p.add_argument("--probe-max-tokens", type=int, default=4)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--gap-s", type=float, default=0.5, help="pause before each probe")
    p.add_argument("--settle-s", type=float, default=3.0, help="after the fan-out starts, before the first probe")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--one-tenant", action="store_true", help="no API keys: both clients are one tenant")
    p.add_argument("--fanout-key", default=FANOUT_KEY)
    p.add_argument("--probe-key", default=PROBE_KEY)
    p.add_argument("--out", help="write the report (JSON) here")
    args = p.parse_args(argv)
    if args.url and (args.engine != "{}" or args.model):
        p.error("--engine and --model configure the local app; they cannot change a server at --url")
    if args.url:
        args.one_tenant = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.manager:
        report = {"args": vars(args), "target": "manager", **measure_manager(args)}
    else:
        with contextlib.ExitStack() as stack:
            target = start_target(stack, args)
            report = {"args": vars(args), "target": target.info, **asyncio.run(measure(target, args))}
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ratio = report["busy_over_idle_median"]
    print(f"TTFT median idle {report['idle_ttft']['median_ms']} ms, busy {report['busy_ttft']['median_ms']} ms, "
          f"ratio {ratio if ratio is None else round(ratio, 2)} (target <= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
