"""HTTP load test: N concurrent streaming clients against an OpenAI-compatible API on loopback.

Every client loops: take the next request of a seeded sequence (mixed prompt lengths from a fixed
word list, mixed `max_tokens`), stream it (`stream: true`, server-sent events), record when each
content chunk arrives, then take the next one. A concurrency level stops by itself: no request
starts after `--duration` seconds or once `--requests` have started; requests still in flight then
get `--drain-timeout` seconds to finish, after which they are cancelled and counted as errors
(`unfinished_at_drain`). Every started request ends as completed or as one error of a named kind.

Per level: requests/s and output tokens/s of completed requests (over the level's wall time,
start to last answer; `all tok/s` adds the tokens that unfinished or failed streams received),
time to first token (first content chunk) and inter-token latency (gap between consecutive content
chunks, pooled), both over every request that got them, unfinished ones included; time per
output token ((last - first chunk) / (tokens - 1)) of completed requests; each p50/p90/p99; and
errors by kind. Output tokens are the server's `usage.completion_tokens`
when it sends usage, else the number of content chunks. OpenAI's API has no "ignore EOS", so a
request may stop before its `max_tokens`; the actual count is what is reported.

Targets (run one after the other, never at once, on the same sequence of requests):
- `cbserve` (default): this process starts a local Ray (`address="local"`), Serve on a free
  loopback port and the cbserve app (one worker replica, default model unless `--model`), and
  shuts both down at the end;
- `transformers`: `transformers serve --continuous-batching <folder>` as a subprocess on a free
  port, offline (`HF_HUB_OFFLINE=1`), on the same weights (the default model's dequantized cache
  folder, or `--model` when it is a folder); the report adds cbserve/transformers ratios;
- `url`: an already running server (`--url http://127.0.0.1:8000`).

    python bench/load.py --concurrency 8,32,128 --duration 60 --requests 400 --target cbserve,transformers
    python bench/load.py --url http://127.0.0.1:8000 --concurrency 16 --duration 30
    python bench/load.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # bench/common.py, found through the path above

TARGETS = ("cbserve", "transformers", "url")
# Level k sends requests k*LEVEL_STRIDE, k*LEVEL_STRIDE+1, ...: the same ones on every target, and
# no prompt repeated across levels (a prefix cache would otherwise serve later levels' prompts).
LEVEL_STRIDE = 1_000_000
WARMUP_FIRST = 10**9
RAY_INIT_ATTEMPTS = 3

# A fixed vocabulary for prompts: plain English words, so that every tokenizer handles them.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it be are this or an not but have had "
    "river mountain city market garden window engine signal letter bridge forest harbor winter summer "
    "morning evening teacher doctor farmer pilot sailor painter child friend family village station "
    "library museum kitchen school office road field stone cloud storm light shadow music story "
    "question answer number paper table chair door wall river ocean island valley desert planet "
    "star moon sun rain snow wind fire water bread apple coffee tea dinner journey travel build "
    "write read learn teach open close follow carry change remember explain describe imagine "
    "quiet bright ancient modern small large quick slow careful strange simple difficult happy"
)
WORDS = _WORD_TEXT.split()

TASKS = (
    "Write a short story that uses these words:",
    "Summarize the following notes in plain English:",
    "Explain what these words have in common:",
    "Continue this text:",
    "Write a poem inspired by:",
    "Describe a place using the words:",
)


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """Request `i` of the sequence depends only on (seed, i): every target gets the same ones."""

    seed: int = 0
    min_words: int = 8
    max_words: int = 200
    min_tokens: int = 16
    max_tokens: int = 128

    def spec(self, index: int) -> RequestSpec:
        rng = random.Random(f"load-{self.seed}-{index}")
        words = [rng.choice(WORDS) for _ in range(rng.randint(self.min_words, self.max_words))]
        prompt = f"{TASKS[rng.randrange(len(TASKS))]} {' '.join(words)}"
        return RequestSpec(index, prompt, rng.randint(self.min_tokens, self.max_tokens))


# -- server-sent events ------------------------------------------------------------------------


class SSEParser:
    """Incremental server-sent-events parser: feed raw bytes as they arrive, get each event's data.

    Handles events split anywhere across chunks, CRLF line ends, comments (`: ...`), other fields
    (ignored) and multi-line data (joined with newlines), as the SSE spec says.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if name == b"data":
                self._data.append(value.decode("utf-8", errors="replace"))
        return events

    def close(self) -> list[str]:
        """The last event when the stream ended without the blank line that terminates it."""
        rest = self.feed(b"\n\n") if self._buf or self._data else []
        self._buf = b""
        return rest


# -- one streaming request ---------------------------------------------------------------------


@dataclass
class Target:
    name: str
    base_url: str  # without the trailing /v1
    model: str
    api_key: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    index: int
    start: float
    end: float
    error: str | None = None  # kind; None = completed
    detail: str = ""
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks, perf_counter seconds
    output_tokens: int = 0
    token_source: str = "chunks"
    finish_reason: str | None = None
    done_marker: bool = False  # the stream ended with `data: [DONE]`

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Sampling:
    endpoint: str = "chat"  # chat | completions
    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM's and cbserve's extension: every request runs to its max_tokens


def request_body(target: Target, spec: RequestSpec, sampling: Sampling) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": spec.max_tokens,
        "temperature": sampling.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


async def stream_request(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, sampling: Sampling, timeout: float,
    live: dict[int, Result] | None = None,
) -> Result:
    """Send one streaming request; never raises except CancelledError. While it runs, its `Result`
    is in `live` (so that a caller that cancels it still has what it received)."""
    path = "/v1/chat/completions" if sampling.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    res = Result(spec.index, start=time.perf_counter(), end=0.0)
    if live is not None:
        live[spec.index] = res
    usage_tokens: int | None = None
    try:
        async with asyncio.timeout(timeout):
            async with session.post(
                target.base_url + path, json=request_body(target, spec, sampling), headers=headers
            ) as resp:
                if resp.status != 200:
                    res.error = f"http_{resp.status}"
                    res.detail = (await resp.text())[:300]
                    return res
                parser, done = SSEParser(), False
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    for data in parser.feed(chunk):
                        done, usage_tokens = _apply(data, now, res, done, usage_tokens)
                        if res.error:
                            return res
                for data in parser.close():
                    done, usage_tokens = _apply(data, time.perf_counter(), res, done, usage_tokens)
                res.done_marker = done
                if res.error is None and not done and res.finish_reason is None:
                    # `transformers serve` ends a stream with its finish_reason and usage but sends no
                    # `data: [DONE]`: only a stream with neither is cut short.
                    res.error = "truncated"
                    res.detail = "the stream ended without a finish_reason or data: [DONE]"
    except TimeoutError:
        res.error, res.detail = "timeout", f"no complete answer within {timeout:g} s"
    except aiohttp.ClientConnectorError as e:
        res.error, res.detail = "connect", str(e)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
        res.error, res.detail = "disconnected", str(e) or type(e).__name__
    except aiohttp.ClientError as e:
        res.error, res.detail = f"client_{type(e).__name__}", str(e)
    except Exception as e:  # noqa: BLE001 - a load test counts every failure, it never stops on one
        res.error, res.detail = f"exception_{type(e).__name__}", str(e)
    finally:
        res.end = time.perf_counter()
        if usage_tokens is not None:
            res.output_tokens, res.token_source = usage_tokens, "usage"
        else:
            res.output_tokens = len(res.chunk_times)
    return res


def _apply(data: str, now: float, res: Result, done: bool, usage: int | None) -> tuple[bool, int | None]:
    got = _handle_event(data, now, res)
    if got is None:
        return done, usage
    return done or got[0], usage if got[1] is None else got[1]


def _handle_event(data: str, now: float, res: Result) -> tuple[bool, int | None] | None:
    """Apply one SSE data payload to `res`: (saw [DONE], usage tokens or None); sets res.error."""
    if data.strip() == "[DONE]":
        return True, None
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        res.error, res.detail = "bad_event", data[:200]
        return None
    if not isinstance(event, dict):
        res.error, res.detail = "bad_event", data[:200]
        return None
    if event.get("error"):
        res.error, res.detail = "stream_error", json.dumps(event["error"])[:300]
        return None
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        if text:
            if not res.chunk_times:
                res.ttft = now - res.start
            res.chunk_times.append(now)
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return False, tokens


# -- one concurrency level ---------------------------------------------------------------------


@dataclass
class LevelRun:
    concurrency: int
    started: int
    results: list[Result]
    wall: float
    load_before: tuple[float, float, float] | None
    load_after: tuple[float, float, float] | None


async def run_level(
    target: Target,
    workload: Workload,
    sampling: Sampling,
    concurrency: int,
    max_requests: int,
    duration: float,
    request_timeout: float = 600.0,
    drain_timeout: float = 300.0,
    first_index: int = 0,
) -> LevelRun:
    """`concurrency` clients stream requests first_index, first_index+1, ... until `max_requests`
    have started or `duration` seconds have passed; then in-flight ones get `drain_timeout`."""
    results: list[Result] = []
    started = 0
    in_flight: dict[int, Result] = {}
    load_before = common.loadavg()
    t0 = time.perf_counter()
    deadline = t0 + duration
    connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)
    ) as session:

        async def client() -> None:
            nonlocal started
            while started < max_requests and time.perf_counter() < deadline:
                spec = workload.spec(first_index + started)
                started += 1
                result = await stream_request(session, target, spec, sampling, request_timeout, in_flight)
                del in_flight[spec.index]
                results.append(result)

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration + drain_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        now = time.perf_counter()
        for _, res in sorted(in_flight.items()):  # cancelled: keep what they had received
            res.end, res.error = now, "unfinished_at_drain"
            res.detail = f"still running {drain_timeout:g} s after the duration cap"
            res.output_tokens = len(res.chunk_times)
            results.append(res)
    end = max((r.end for r in results), default=time.perf_counter())
    return LevelRun(concurrency, started, results, end - t0, load_before, common.loadavg())


# -- statistics --------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between closest ranks; None if empty."""
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
        "n": len(values),
    }


def summarize(run: LevelRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    errors = Counter(r.error for r in failed)
    samples: dict[str, list[str]] = {}
    for r in failed:
        samples.setdefault(r.error or "", [])
        if len(samples[r.error or ""]) < 3:
            samples[r.error or ""].append(r.detail)
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [b - a for r in run.results for a, b in pairwise(r.chunk_times)]
    tpot = [
        (r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
        for r in ok
        if r.output_tokens > 1 and len(r.chunk_times) >= 2
    ]
    wall = max(run.wall, 1e-9)
    return {
        "concurrency": run.concurrency,
        "started": run.started,
        "completed": len(ok),
        "errors": len(failed),
        "errors_by_kind": dict(sorted(errors.items())),
        "error_samples": samples,
        "wall_s": run.wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "partial_tokens_of_failed": sum(r.output_tokens for r in failed),
        # every token received, failed requests' partial streams included (content chunks for those)
        "all_tokens_per_s": (out_tokens + sum(r.output_tokens for r in failed)) / wall,
        "token_count_source": dict(Counter(r.token_source for r in ok)),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        "completed_without_tokens": sum(1 for r in ok if r.output_tokens == 0),
        "completed_without_done_marker": sum(1 for r in ok if not r.done_marker),
        # first tokens and token gaps of every request that got them, unfinished ones included
        "ttft_s": _dist([r.ttft for r in run.results if r.ttft is not None]),
        "itl_s": _dist(itl),
        "tpot_s": _dist(tpot),
        "e2e_s": _dist([r.end - r.start for r in ok]),
        "load_before": run.load_before,
        "load_after": run.load_after,
    }


# -- targets -----------------------------------------------------------------------------------


class TargetUnavailable(RuntimeError):
    """The target could not be started; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cbserve(stack: contextlib.ExitStack, model: str | None, cpus: int, engine: dict[str, Any],
                  extra_args: dict[str, Any] | None = None) -> Target:
    """A local Ray and the cbserve Serve app with one worker replica of `cpus` CPUs (Ray gives the
    replica OMP_NUM_THREADS = its CPUs); torn down by `stack`."""
    import ray
    from ray import serve

    from cbserve.cluster.app import build_app
    from cbserve.cluster.settings import ClusterArgs

    app_args: dict[str, Any] = {
        "model": model,
        "engine": engine,
        "worker": {"num_replicas": 1, "num_cpus": cpus},
        **(extra_args or {}),
    }
    cfg = ClusterArgs(**app_args)  # fail early, naming the field
    port = free_port()
    # address="local": a new cluster of our own, never one that `ray start` left on this machine.
    for attempt in range(1, RAY_INIT_ATTEMPTS + 1):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:  # Ray gives its raylet 30 s to start, which a loaded machine misses
            ray.shutdown()
            if attempt == RAY_INIT_ATTEMPTS:
                raise TargetUnavailable(f"ray.init failed {attempt} times, last: {e}") from e
            print(f"ray.init failed ({e}); retrying, {attempt}/{RAY_INIT_ATTEMPTS}", flush=True)
    stack.callback(ray.shutdown)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stack.callback(serve.shutdown)

    @ray.remote(num_cpus=cpus)
    def omp_threads() -> str | None:  # what Ray gives an actor of `cpus` CPUs, as the replica gets
        return os.environ.get("OMP_NUM_THREADS")

    threads = ray.get(omp_threads.remote(), timeout=300)
    t0 = time.perf_counter()
    serve.run(build_app(app_args), name="cbserve", route_prefix="/")
    info = {"startup_s": time.perf_counter() - t0, "app_args": app_args, "omp_num_threads": threads}
    return Target("cbserve", f"http://127.0.0.1:{port}", cfg.model_name, cfg.resolved_api_key(), info)


def transformers_model_folder(model: str | None) -> str:
    """A folder `transformers serve` loads offline: `model` itself, or the dequantized cache of the
    default model / of a GGUF file (built by cbserve's loader when missing)."""
    from cbserve.models import checkpoint_folder

    try:
        return str(checkpoint_folder(model).resolve())
    except OSError as exc:
        raise TargetUnavailable(f"--model {model!r}: {exc}") from exc


def start_transformers(stack: contextlib.ExitStack, model: str | None, threads: int,
                       start_timeout: float, log_path: Path, extra: list[str] | None = None) -> Target:
    """`transformers serve --continuous-batching <folder>` in its own process group, offline."""
    exe = Path(sys.executable).parent / "transformers"
    if not exe.exists():
        found = shutil.which("transformers")
        if found is None:
            raise TargetUnavailable("no `transformers` command next to this Python or on PATH")
        exe = Path(found)
    folder = transformers_model_folder(model)
    port = free_port()
    cmd = [str(exe), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--log-level", "warning", *(extra or []), folder]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the stack
    stack.callback(log.close)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stack.callback(stop_process, proc)
    base = f"http://127.0.0.1:{port}"
    import urllib.request

    while True:
        if proc.poll() is not None:
            raise TargetUnavailable(
                f"`{' '.join(cmd)}` exited with code {proc.returncode} before it served /health; "
                f"log tail:\n{common.log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.perf_counter() - t0 > start_timeout:
            raise TargetUnavailable(f"`transformers serve` did not answer /health within {start_timeout:g} s; "
                                    f"log tail:\n{common.log_tail(log_path)}")
        time.sleep(0.5)
    info = {"startup_s": time.perf_counter() - t0, "command": cmd, "omp_num_threads": threads,
            "log": str(log_path)}
    return Target("transformers", base, folder, None, info)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started, then SIGKILL it after 15 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def url_target(url: str, model: str | None, api_key: str | None) -> Target:
    base = url.rstrip("/")
    base = base.removesuffix("/v1")
    if model is None:
        import urllib.request

        req = urllib.request.Request(base + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    return Target("url", base, model, api_key, {"url": url})


async def warm_up(target: Target, workload: Workload, sampling: Sampling, count: int, timeout: float) -> list:
    """`count` short requests at once, not measured (first-request costs: model warm-up, threads)."""
    if count <= 0:
        return []
    async with aiohttp.ClientSession() as session:
        specs = [RequestSpec(-1 - i, workload.spec(WARMUP_FIRST + i).prompt, 8) for i in range(count)]
        results = await asyncio.gather(*(stream_request(session, target, s, sampling, timeout) for s in specs))
    return [r.error for r in results if r.error]


# -- report ------------------------------------------------------------------------------------


def _ms(d: dict[str, float | None]) -> str:
    return "/".join("-" if d[k] is None else f"{1000 * d[k]:.0f}" for k in ("p50", "p90", "p99"))


def format_table(reports: dict[str, list[dict[str, Any]]]) -> str:
    head = (f"{'target':<13}{'conc':>5}{'started':>8}{'ok':>6}{'err':>5}{'wall s':>8}{'req/s':>8}"
            f"{'out tok/s':>10}{'all tok/s':>10}  {'TTFT p50/p90/p99 ms':<22}{'ITL p50/p90/p99 ms':<20}{'TPOT p50 ms':>11}  load")
    lines = [head, "-" * len(head)]
    for name, levels in reports.items():
        for s in levels:
            tpot = s["tpot_s"]["p50"]
            load = s["load_before"][0] if s["load_before"] else float("nan")
            lines.append(
                f"{name:<13}{s['concurrency']:>5}{s['started']:>8}{s['completed']:>6}{s['errors']:>5}"
                f"{s['wall_s']:>8.1f}{s['requests_per_s']:>8.2f}{s['output_tokens_per_s']:>10.1f}"
                f"{s['all_tokens_per_s']:>10.1f}  "
                f"{_ms(s['ttft_s']):<22}{_ms(s['itl_s']):<20}"
                f"{'-' if tpot is None else f'{1000 * tpot:.0f}':>11}  {load:.1f}"
            )
            if s["errors_by_kind"]:
                kinds = ", ".join(f"{k}: {v}" for k, v in s["errors_by_kind"].items())
                lines.append(f"{'':<13}errors: {kinds}; e.g. {next(iter(s['error_samples'].values()))[0]!r:.150}")
    return "\n".join(lines)


def ratios(reports: dict[str, list[dict[str, Any]]], a: str = "cbserve", b: str = "transformers") -> list[dict]:
    """a/b per concurrency: throughput ratios (>1: a is faster) and latency ratios (<1: a is faster)."""
    if a not in reports or b not in reports:
        return []
    theirs = {s["concurrency"]: s for s in reports[b]}
    out = []
    for s in reports[a]:
        t = theirs.get(s["concurrency"])
        if t is None:
            continue

        def div(x: float | None, y: float | None) -> float | None:
            return None if x is None or not y else x / y

        out.append({
            "concurrency": s["concurrency"],
            "requests_per_s": div(s["requests_per_s"], t["requests_per_s"]),
            "output_tokens_per_s": div(s["output_tokens_per_s"], t["output_tokens_per_s"]),
            "all_tokens_per_s": div(s["all_tokens_per_s"], t["all_tokens_per_s"]),
            "ttft_p50": div(s["ttft_s"]["p50"], t["ttft_s"]["p50"]),
            "itl_p50": div(s["itl_s"]["p50"], t["itl_s"]["p50"]),
            "tpot_p50": div(s["tpot_s"]["p50"], t["tpot_s"]["p50"]),
        })
    return out


def format_ratios(rows: list[dict], a: str = "cbserve", b: str = "transformers") -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines = [f"{a}/{b}: throughput >1 = {a} faster; latency <1 = {a} faster",
             (f"{'conc':>5}{'req/s':>9}{'out tok/s':>11}{'all tok/s':>11}{'TTFT p50':>10}{'ITL p50':>9}"
              f"{'TPOT p50':>10}")]
    for r in rows:
        lines.append(f"{r['concurrency']:>5}{f(r['requests_per_s']):>9}{f(r['output_tokens_per_s']):>11}"
                     f"{f(r['all_tokens_per_s']):>11}"
                     f"{f(r['ttft_p50']):>10}{f(r['itl_p50']):>9}{f(r['tpot_p50']):>10}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "load": common.loadavg()}


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None,
                   help=f"comma-separated, run in this order: {TARGETS} (default: url with --url, else cbserve)")
    p.add_argument("--url", default=None, help="an already running server (implies --target url)")
    p.add_argument("--model-name", default=None, help="`model` sent to --url (default: its first /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("CBSERVE_API_KEY"), help="for --url")
    p.add_argument("--model", default=None, help="model for the started servers (default: SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", default="8,32,128", help="comma-separated client counts, one level each")
    p.add_argument("--requests", type=int, default=400, help="at most this many requests start per level")
    p.add_argument("--duration", type=float, default=60.0, help="no request starts after this many seconds")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="then in-flight requests get this long before they are cancelled (counted as errors)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (both servers honour it)")
    p.add_argument("--prompt-words", default="8-200", help="prompt length range, in words")
    p.add_argument("--max-tokens", default="16-128", help="max_tokens range")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests sent to each target first")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="CPUs of the cbserve worker replica (its torch threads) and OMP_NUM_THREADS of "
                        "transformers serve")
    p.add_argument("--engine", default="{}", help="JSON of ContinuousBatchingConfig fields for cbserve")
    p.add_argument("--transformers-args", default="",
                   help="extra flags for `transformers serve`, e.g. '--cb-num-blocks 512' (default: none)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny settings: concurrency 2,4, 8 requests, 15 s, prompts 4-32 words, 4-16 tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests, args.duration = "2,4", 8, 15.0
        args.prompt_words, args.max_tokens, args.warmup, args.drain_timeout = "4-32", "4-16", 1, 120.0
    targets = args.target or ("url" if args.url else "cbserve")
    args.targets = [t.strip() for t in targets.split(",") if t.strip()]
    if not args.targets or set(args.targets) - set(TARGETS):
        p.error(f"--target: choose from {TARGETS}")
    if "url" in args.targets and not args.url:
        p.error("--target url needs --url")
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
        args.words = tuple(int(x) for x in args.prompt_words.split("-"))
        args.tokens = tuple(int(x) for x in args.max_tokens.split("-"))
        args.engine_cfg = json.loads(args.engine)
    except ValueError as e:
        p.error(str(e))
    if min(args.levels) < 1 or len(args.words) != 2 or len(args.tokens) != 2 or min(args.words + args.tokens) < 1:
        p.error("concurrency levels, --prompt-words and --max-tokens must be positive (ranges as LO-HI)")
    if args.requests < 1 or args.duration <= 0:
        p.error("--requests and --duration must be positive")
    return args


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # clean up on `kill` as on Ctrl-C
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    workload = Workload(args.seed, *args.words, *args.tokens)
    sampling = Sampling(args.endpoint, args.temperature)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['load']} at start", flush=True)
    print(f"load: levels {args.levels}, <= {args.requests} requests and <= {args.duration:g} s per level "
          f"(+ drain <= {args.drain_timeout:g} s), prompts {args.prompt_words} words, max_tokens "
          f"{args.max_tokens}, temperature {args.temperature}, /v1/{args.endpoint}, seed {args.seed}", flush=True)
    reports: dict[str, list[dict[str, Any]]] = {}
    target_info: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="cbserve-load-"))
    try:
        for name in args.targets:
            with contextlib.ExitStack() as stack:
                print(f"\n== {name}: starting (load average {common.loadavg()}) ...", flush=True)
                try:
                    if name == "cbserve":
                        target = start_cbserve(stack, args.model, args.cpus, args.engine_cfg)
                    elif name == "transformers":
                        target = start_transformers(stack, args.model, args.cpus, args.start_timeout,
                                                    tmp / "transformers-serve.log",
                                                    shlex.split(args.transformers_args))
                    else:
                        target = url_target(args.url, args.model_name, args.api_key)
                except TargetUnavailable as e:
                    unavailable[name] = str(e)
                    print(f"{name} could not be run: {e}", flush=True)
                    continue
                target_info[name] = {"base_url": target.base_url, "model": target.model, **target.info}
                print(f"{name}: {target.base_url}, model {target.model!r}, "
                      f"{json.dumps({k: v for k, v in target.info.items() if k != 'app_args'}, default=str)}",
                      flush=True)
                t0 = time.perf_counter()
                failed = asyncio.run(warm_up(target, workload, sampling, args.warmup, args.request_timeout))
                print(f"{name}: warm-up of {args.warmup} requests took {time.perf_counter() - t0:.1f} s"
                      + (f", errors: {failed}" if failed else ""), flush=True)
                reports[name] = []
                for level, conc in enumerate(args.levels):
                    print(f"{name}: {conc} clients ... (load average {common.loadavg()})", flush=True)
                    run = asyncio.run(run_level(target, workload, sampling, conc, args.requests, args.duration,
                                                args.request_timeout, args.drain_timeout,
                                                first_index=level * LEVEL_STRIDE))
                    s = summarize(run)
                    assert s["completed"] + s["errors"] == s["started"], s  # every request accounted for
                    reports[name].append(s)
                    print(f"  {s['completed']}/{s['started']} ok, {s['requests_per_s']:.2f} req/s, "
                          f"{s['output_tokens_per_s']:.1f} out tok/s, {s['wall_s']:.1f} s, errors "
                          f"{s['errors_by_kind'] or 0}", flush=True)
                print(f"{name}: shutting down", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(format_table(reports))
    rows = ratios(reports)
    if rows:
        print()
        print(format_ratios(rows))
    for name, why in unavailable.items():
        print(f"\n{name} was not run: {why}")
    print(f"\nload average at the end: {common.loadavg()}")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": info, "args": {k: v for k, v in vars(args).items() if k != "json"},
            "targets": target_info, "levels": reports, "ratios": rows, "unavailable": unavailable,
        }, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if not unavailable else 2


if __name__ == "__main__":
    sys.exit(main())
