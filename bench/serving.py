"""What serving costs: the same requests through the engine's own manager and over HTTP, one run.

For each concurrency level, `C` clients run the same sequence of requests (token-id prompts of
exactly `--prompt-tokens` tokens, `--max-tokens` new tokens, greedy) twice, back to back:

- `engine`: in this process, a `ContinuousBatchingManager` built as the worker replica builds
  it (the serve config's model, `dtype` and `engine` fields; torch threads = the worker's CPUs),
  each client a task reading `manager.async_request_iter`;
- `http`: streaming `POST /v1/completions` (aiohttp, server-sent events) against the app that
  `make serve` starts (`python -m cbserve.cluster.run <config>`, here on free ports, stopped with
  SIGINT at the end), or against `--url`.

Per level and path: output tok/s (tokens of completed requests over the level's wall time),
TTFT and inter-token latency p50/p90 (the engine's inter-token gaps are its step times at that
batch), CPU time per output token (this process and the server's process tree: what serving
costs, which a shared machine disturbs less than the rates), how often the engine's threads were
preempted (involuntary context switches a second of the busiest threads, its OpenMP team), then the
HTTP/engine ratios and the done-when checks of issue 21: HTTP tok/s >= 85% of
the engine's, HTTP ITL p50 <= 1.3x the engine's step time, and at 1 client HTTP TTFT <= the
engine's (the prefill time) + 50 ms. The machine's load average is printed with every phase.

    python bench/serving.py --concurrency 1,32 --per-client 2
    python bench/serving.py --url http://127.0.0.1:8000 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # bench/common.py: load averages, log tails
import load  # bench/load.py: the SSE client, percentiles

DEFAULT_CONFIG = ROOT / "ray_config.yaml"


# -- requests ----------------------------------------------------------------------------------


def make_prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids (random words from load.WORDS, cut)."""
    prompts = []
    for i in range(count):
        rng = random.Random(f"serving-{seed}-{i}")
        ids: list[int] = []
        while len(ids) < length:
            text = " ".join(rng.choice(load.WORDS) for _ in range(length))
            ids += tokenizer(f"{load.TASKS[i % len(load.TASKS)]} {text}").input_ids
        prompts.append(ids[:length])
    return prompts


@dataclass
class Record:
    """One request as its client saw it: when it started, when each chunk of tokens arrived."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = True


async def _closed_loop(concurrency: int, count: int, one: Any) -> tuple[list[Record], float]:
    """`concurrency` clients run requests 0..count-1 in order, each after its previous one."""
    records: list[Record | None] = [None] * count
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < count:
            i, next_index = next_index, next_index + 1
            records[i] = await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    done = [r for r in records if r is not None]
    return done, max(r.end for r in done) - t0


# -- engine ------------------------------------------------------------------------------------


def start_engine(cfg: Any, threads: int, num_pages: int | None = None) -> tuple[Any, Any, Any]:
    """(manager, tokenizer, eos) built as `EngineReplica` builds them, torch on `threads` threads,
    with `num_pages` KV pages (the server's) when given: the memory budget gives a replica started
    at another moment another number."""
    import torch
    from transformers import GenerationConfig

    import cbserve
    from cbserve.cluster.engine_replica import engine_config, eos_ids
    from cbserve.config import with_fields

    torch.set_num_threads(threads)
    model, tokenizer = cbserve.load_model(cfg.model, dtype=cfg.dtype)
    eos = eos_ids(model, tokenizer)
    manager = cbserve.init_continuous_batching(
        model, generation_config=GenerationConfig(max_new_tokens=cfg.generation.max_tokens, eos_token_id=eos),
        continuous_batching_config=with_fields(engine_config(cfg), **({"num_blocks": num_pages} if num_pages else {})),
    )
    manager.start()
    return manager, tokenizer, eos


async def engine_level(manager: Any, eos: Any, prompts: list[list[int]], concurrency: int,
                       max_tokens: int) -> tuple[list[Record], float]:
    async def one(i: int) -> Record:
        rec = Record(start=time.perf_counter())
        rid = manager.add_request(prompts[i], max_new_tokens=max_tokens, streaming=True, eos_token_id=eos,
                                  temperature=0.0, top_k=0, top_p=1.0)
        async for out in manager.async_request_iter(rid):
            if out.new_tokens:
                rec.chunk_times.append(time.perf_counter())
                rec.tokens += len(out.new_tokens)
        rec.end = time.perf_counter()
        return rec

    return await _closed_loop(concurrency, len(prompts), one)


# -- HTTP --------------------------------------------------------------------------------------


async def http_level(target: load.Target, prompts: list[list[int]], concurrency: int,
                     max_tokens: int, timeout: float, ignore_eos: bool = False,
                     models: list[str] | None = None, fresh_connections: bool = False) -> tuple[list[Record], float]:
    """`models`: each request's `model` (LoRA adapters, bench/lora.py); default the target's.
    `fresh_connections`: a connection per request (llama.cpp's server closes a connection after a
    streamed answer, and the next request on it fails)."""
    import dataclasses

    import aiohttp

    sampling = load.Sampling(endpoint="completions", temperature=0.0, ignore_eos=ignore_eos)
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(i: int) -> Record:
            spec = load.RequestSpec(i, prompts[i], max_tokens)  # type: ignore[arg-type] - token ids
            to = target if models is None else dataclasses.replace(target, model=models[i])
            res = await load.stream_request(session, to, spec, sampling, timeout)
            return Record(start=res.start, end=res.end, chunk_times=res.chunk_times, tokens=res.output_tokens,
                          ok=res.ok)

        return await _closed_loop(concurrency, len(prompts), one)


def _free_ports(config: dict[str, Any]) -> int:
    port = load.free_port()
    config.setdefault("http_options", {})["port"] = port
    if "grpc_options" in config:
        config["grpc_options"]["port"] = load.free_port()
    return port


def start_server(stack: contextlib.ExitStack, config: dict[str, Any], log: Path, timeout: float,
                 env: dict[str, str] | None = None) -> tuple[str, int]:
    """`config` served as `make serve` serves it (`python -m cbserve.cluster.run`: a Ray of its own),
    on free ports, in its own process group; SIGINT (Ctrl-C) at the end. Returns the base URL once
    the API answers, and the server's process id."""
    port = _free_ports(config)
    path = log.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    out = open(log, "wb")  # noqa: SIM115 - closed by the stack
    stack.callback(out.close)
    # Its own process group (for the SIGINT), but this session: with the kernel's autogroup
    # scheduling a new session would get a CPU share of its own on a shared machine, which the
    # in-process engine does not get.
    proc = subprocess.Popen([sys.executable, "-m", "cbserve.cluster.run", str(path)], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, process_group=0, env={**os.environ, **(env or {})})
    stack.callback(stop_server, proc)
    base = f"http://127.0.0.1:{port}"
    wait_until_ready(proc, base, timeout, log)
    return base, proc.pid


def wait_until_ready(proc: subprocess.Popen, base: str, timeout: float, log: Path) -> None:
    """Until `base`/v1/models answers 200 (any OpenAI server: cbserve's, vLLM's); raises with the
    log's tail when the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; log tail:\n{common.log_tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer within {timeout:g} s; log tail:\n{common.log_tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops `make serve`; SIGKILL of the group if it has not ended in 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


# -- CPU time ----------------------------------------------------------------------------------


def tree_cpu(root: int | None) -> dict[int, tuple[str, float]]:
    """{pid: (process title, CPU seconds used so far)} of process `root` and its descendants
    (Linux /proc; empty elsewhere). On a shared machine CPU time per token is steadier than tokens
    per second."""
    if root is None:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    parents, used = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            parents[pid], used[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in tree}
        tree |= frontier
    out = {}
    for pid in tree & used.keys():
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            out[pid] = (title.split(".")[0] if title.startswith("ray::") else Path(title).name, used[pid])
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds used between two `tree_cpu` snapshots, by process title."""
    out: dict[str, float] = {}
    for pid, (title, cpu) in after.items():
        out[title] = out.get(title, 0.0) + cpu - before.get(pid, (title, 0.0))[1]
    return out


def thread_stats(pids: list[int]) -> dict[tuple[int, int], tuple[float, int]]:
    """{(pid, thread id): (CPU seconds, involuntary context switches)} of every thread of `pids`
    (Linux /proc; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
                switches = int(status.split("nonvoluntary_ctxt_switches:", 1)[1].split()[0])
                out[(pid, int(task.name))] = ((int(fields[11]) + int(fields[12])) / tick, switches)
    return out


def team_preemptions(before: dict[tuple[int, int], tuple[float, int]], after: dict[tuple[int, int], tuple[float, int]],
                     wall: float, threads: int) -> float | None:
    """Involuntary context switches per second and thread of the `threads` threads that used the most
    CPU between two `thread_stats` snapshots (the engine's OpenMP team): how often other work took a
    core from a thread that a parallel region then waits for."""
    deltas = sorted(((cpu - before.get(key, (0.0, 0))[0], n - before.get(key, (0.0, 0))[1])
                     for key, (cpu, n) in after.items()), reverse=True)[:threads]
    if not deltas or wall <= 0:
        return None
    return sum(n for _, n in deltas) / len(deltas) / wall


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- report ------------------------------------------------------------------------------------


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.chunk_times[0] - r.start for r in records if r.chunk_times]
    itl = [b - a for r in records for a, b in pairwise(r.chunk_times)]
    return {
        "requests": len(records), "completed": len(ok), "output_tokens": tokens, "wall_s": wall,
        "output_tokens_per_s": tokens / max(wall, 1e-9),
        "ttft_p50": load.percentile(ttft, 50), "ttft_p90": load.percentile(ttft, 90),
        "itl_p50": load.percentile(itl, 50), "itl_p90": load.percentile(itl, 90),
        "tokens_per_chunk": sum(r.tokens for r in records) / max(1, sum(len(r.chunk_times) for r in records)),
        "per_request_tokens": [r.tokens for r in records],
    }


def checks(level: int, engine: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    out = {
        "throughput_ratio": div(http["output_tokens_per_s"], engine["output_tokens_per_s"]),
        "ttft_ratio": div(http["ttft_p50"], engine["ttft_p50"]),
        "itl_ratio": div(http["itl_p50"], engine["itl_p50"]),
        "ttft_extra_ms": None if http["ttft_p50"] is None or engine["ttft_p50"] is None
        else 1000 * (http["ttft_p50"] - engine["ttft_p50"]),
        "same_token_counts": engine["per_request_tokens"] == http["per_request_tokens"],
        "cpu_ratio": div(http["cpu_ms_per_token"], engine["cpu_ms_per_token"]),
    }
    out["throughput_ok"] = (out["throughput_ratio"] or 0) >= 0.85
    out["itl_ok"] = out["itl_ratio"] is not None and out["itl_ratio"] <= 1.3
    if level == 1:
        out["ttft_ok"] = out["ttft_extra_ms"] is not None and out["ttft_extra_ms"] <= 50
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def format_report(rows: list[dict[str, Any]]) -> str:
    head = (f"{'clients':>7} {'path':<7}{'ok':>5}{'out tok/s':>11}{'TTFT p50/p90 ms':>17}{'ITL p50/p90 ms':>16}"
            f"{'tok/chunk':>10}{'CPU ms/tok':>11}{'load':>6}")
    lines = [head, "-" * len(head)]
    for row in rows:
        for path in ("engine", "http"):
            s = row[path]
            lines.append(f"{row['concurrency']:>7} {path:<7}{s['completed']:>5}{s['output_tokens_per_s']:>11.1f}"
                         f"{_ms(s['ttft_p50']) + '/' + _ms(s['ttft_p90']):>17}"
                         f"{_ms(s['itl_p50']) + '/' + _ms(s['itl_p90']):>16}{s['tokens_per_chunk']:>10.2f}"
                         f"{s['cpu_ms_per_token']:>11.1f}{s['load'][0]:>6.1f}")
        c = row["checks"]

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        verdict = ", ".join(f"{k[:-3]} {'ok' if v else 'MISSED'}" for k, v in c.items() if k.endswith("_ok"))
        lines.append(f"{'':>7} http/engine: out tok/s {f(c['throughput_ratio'])}, TTFT p50 {f(c['ttft_ratio'])} "
                     f"(+{f(c['ttft_extra_ms'])} ms), ITL p50 {f(c['itl_ratio'])}, CPU per token "
                     f"{f(c['cpu_ratio'])}; same token counts: "
                     f"{c['same_token_counts']}; {verdict}")
    for level in sorted({row["concurrency"] for row in rows}):
        lines.append(level_summary(level, [row["checks"] for row in rows if row["concurrency"] == level]))
    return "\n".join(lines)


def level_summary(level: int, checks: list[dict[str, Any]]) -> str:
    """The rounds of a level together: on a shared machine one round's ratio moves by +-10%."""
    def spread(key: str) -> str:
        values = [c[key] for c in checks if c[key] is not None]
        if not values:
            return "-"
        return f"mean {sum(values) / len(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"

    return (f"{level:>7} clients, {len(checks)} round(s): out tok/s http/engine {spread('throughput_ratio')}; "
            f"ITL p50 http/engine {spread('itl_ratio')}")


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the Serve config (default: ray_config.yaml)")
    p.add_argument("--model", default=None, help="override the config's args.model (an HF id or a folder)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override an args field, dotted: --set worker.num_cpus=2 --set engine.page_size=32")
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of the server (and its Ray) only, e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--url", default=None, help="measure this running server instead of starting one")
    p.add_argument("--concurrency", default="1,32", help="comma-separated client counts, one level each")
    p.add_argument("--per-client", type=int, default=2, help="requests per client and level (at least 8 a level)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="engine then HTTP, this many times per level")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="before each level, one unmeasured request per client with this many tokens on each path")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the in-process engine (default: what the worker replica uses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    return args


def serve_config(args: argparse.Namespace) -> dict[str, Any]:
    config = yaml.safe_load(args.config.read_text())
    app_args = config["applications"][0].setdefault("args", {})
    if args.model is not None:
        app_args["model"] = args.model
    for item in args.set:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = app_args
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = json.loads(value)
    return config


def server_series(base: str, api_key: str | None, name: str) -> float | None:
    """A series of the server's /metrics summed over its worker replicas (None when it has none)."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(req, timeout=30) as r:
            lines = [ln for ln in r.read().decode().splitlines() if ln.startswith(name + "{")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) if lines else None
    return None


def server_kv_pages(base: str, api_key: str | None) -> int | None:
    """The worker replicas' KV pages, from the server's /metrics (None when it does not say)."""
    pages = server_series(base, api_key, "cbserve:kv_pages_total")
    return None if pages is None else int(pages)


def first_kv_pages(target: load.Target, wait_s: float = 15.0) -> int | None:
    """The server's KV pages once its replicas have reported their stats (None if they do not)."""
    deadline = time.monotonic() + wait_s
    while (pages := server_kv_pages(target.base_url, target.api_key)) is None and time.monotonic() < deadline:
        time.sleep(1.0)
    return pages


def check_same_kv(target: load.Target, manager: Any) -> None:
    """Warn when the server's KV cache differs from the engine's: `max_memory_percent` sizes it from
    the memory free when a replica starts, and a replica restarted on a machine short of memory
    holds fewer requests at once, which is no measure of the serving path."""
    here, there = manager.stats()["total_pages"], server_kv_pages(target.base_url, target.api_key)
    print(f"KV pages: engine {here}, server {there}", flush=True)
    if there is not None and there != here:
        print("WARNING: the server's KV cache differs from the engine's (a replica restarted short of memory?): "
              "its figures are not comparable", flush=True)


def engine_counters(manager: Any) -> Any:
    """(steps, busy seconds) of the in-process engine, as a callable."""
    def read() -> tuple[float, float] | None:
        s = manager.stats()
        return s["steps"], s["busy_seconds"]
    return read


def server_counters(target: load.Target) -> Any:
    """(steps, busy seconds) of the server's engines, from /metrics. The series come from stats the
    replicas report every `routing.stats_period_s`: read again until two reads agree (the engine
    is idle after a phase)."""
    def one() -> tuple[float, float] | None:
        steps = server_series(target.base_url, target.api_key, "cbserve:engine_steps_total")
        busy = server_series(target.base_url, target.api_key, "cbserve:engine_busy_seconds_total")
        return None if steps is None or busy is None else (steps, busy)

    def read() -> tuple[float, float] | None:
        last = one()
        for _ in range(8):
            time.sleep(1.5)
            now = one()
            if now == last:
                return now
            last = now
        return last
    return read


def _engine_share(before: Any, after: Any, wall: float) -> dict[str, Any]:
    """Steps, mean step time and the share of the wall time the engine was busy in a phase."""
    if before is None or after is None or after[0] <= before[0]:
        return {"steps": None, "step_ms": None, "busy_share": None}
    steps, busy = after[0] - before[0], after[1] - before[1]
    return {"steps": int(steps), "step_ms": 1000 * busy / steps, "busy_share": busy / wall}


def _phase(name: str, level: int, coroutine: Any, server: int | None, counters: Any,
           engine_pids: list[int], threads: int) -> dict[str, Any]:
    """`engine_pids`: the processes the engine runs in (this one, or the server's), whose busiest
    `threads` threads are its OpenMP team."""
    before = common.loadavg()
    print(f"  {name:<6} {level:>3} clients ... (load average {before})", flush=True)
    cpu0, steps0, team0 = (own_cpu_s(), tree_cpu(server)), counters(), thread_stats(engine_pids)
    records, wall = asyncio.run(coroutine)
    s = summarize(records, wall)
    s["engine_preemptions_per_s"] = team_preemptions(team0, thread_stats(engine_pids), wall, threads)
    s["load"] = before or (float("nan"),) * 3
    by_process = cpu_used(cpu0[1], tree_cpu(server))
    s["server_cores"] = {k: round(v / wall, 3) for k, v in sorted(by_process.items(), key=lambda kv: -kv[1])}
    s["cpu_s"] = {"bench": own_cpu_s() - cpu0[0], "server": sum(by_process.values())}
    s["cpu_ms_per_token"] = 1000 * sum(s["cpu_s"].values()) / max(1, s["output_tokens"])
    s["engine"] = _engine_share(steps0, counters(), wall)  # after the CPU times: it may wait for the server
    print(f"    {s['completed']}/{s['requests']} ok, {s['output_tokens_per_s']:.1f} out tok/s, TTFT p50 "
          f"{_ms(s['ttft_p50'])} ms, ITL p50 {_ms(s['itl_p50'])} ms, {wall:.1f} s, CPU {s['cpu_s']['bench']:.1f} s "
          f"here + {s['cpu_s']['server']:.1f} s server", flush=True)
    e = s["engine"]
    if e["steps"]:
        print(f"    engine: {e['steps']} steps of {e['step_ms']:.1f} ms on average, busy {100 * e['busy_share']:.0f}% "
              "of the wall time", flush=True)
    if s["engine_preemptions_per_s"] is not None:
        print(f"    engine threads: each preempted {s['engine_preemptions_per_s']:.0f} times a second", flush=True)
    busy = [f"{k} {v:.2f}" for k, v in s["server_cores"].items() if v >= 0.02]
    if busy:
        print(f"    server cores used: {', '.join(busy)}", flush=True)
    return s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and args.server_env:
        sys.exit("--server-env sets the environment of a server this bench starts; not with --url")
    from cbserve.cluster.settings import ClusterArgs, torch_threads

    config = serve_config(args)
    cfg = ClusterArgs(**config["applications"][0]["args"])
    threads = args.threads or torch_threads(cfg)
    info = load.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['load']}; model {cfg.model_name}, "
          f"{cfg.dtype}, engine torch threads {threads}", flush=True)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="cbserve-serving-"))
        env = dict(item.split("=", 1) for item in args.server_env)
        base, server = (args.url, None) if args.url else start_server(stack, config, tmp / "serve.log",
                                                                       args.start_timeout, env)
        print(f"http: {base}" + ("" if args.url else f" (server log: {tmp / 'serve.log'})"), flush=True)
        target = load.Target("http", base.rstrip("/").removesuffix("/v1"), cfg.model_name, cfg.resolved_api_key())
        manager, tokenizer, eos = start_engine(cfg, threads, first_kv_pages(target))
        stack.callback(manager.stop, timeout=30)
        for n, level in enumerate(args.levels):
            # The first batch of a size pays for its memory (allocator growth, page faults) on either path.
            warm = make_prompts(tokenizer, level, args.prompt_tokens, 1000 * args.seed + 100 * n + 1)
            asyncio.run(engine_level(manager, eos, warm, level, args.warmup_tokens))
            asyncio.run(http_level(target, warm, level, args.warmup_tokens, args.request_timeout))
            for r in range(args.rounds):  # new prompts every round: no prefix-cache hits on either path
                total = max(8, args.per_client * level)
                prompts = make_prompts(tokenizer, total, args.prompt_tokens, 1000 * args.seed + 100 * n + r + 2)
                eng = _phase("engine", level, engine_level(manager, eos, prompts, level, args.max_tokens), server,
                             engine_counters(manager), [os.getpid()], threads)
                http = _phase("http", level, http_level(target, prompts, level, args.max_tokens,
                                                        args.request_timeout), server, server_counters(target),
                              list(tree_cpu(server)), threads)
                check_same_kv(target, manager)
                rows.append({"concurrency": level, "engine": eng, "http": http, "checks": checks(level, eng, http)})
    print()
    print(format_report(rows))
    print(f"\nload average at the end: {common.loadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "levels": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
