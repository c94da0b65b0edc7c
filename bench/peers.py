"""cbserve against vLLM's own CPU engine, side by side on the same requests, in one command (issue 28).

Every engine runs in a subprocess of its own, alternating (cbserve, vLLM, cbserve, vLLM, ...), vLLM in
its venv's Python (`make peers` installs it into .venv-vllm):

- offline: vLLM's `LLM.generate` vs cbserve's manager with its default config
  (`init_continuous_batching` + `add_request`, what users run); optionally `cbserve_sized`, the
  `EngineCore` that bench/throughput.py sizes for each workload, `cbserve_gguf`, the manager on the
  GGUF file's own quantized blocks (quantization='auto'), `cbserve_int8`, the manager on the dense
  weights quantized at load (quantization='int8'), and `llamacpp`, llama-cpp-python on the
  same GGUF file (`make peers-llamacpp`; one request at a time, as its Python API runs them). Workloads (bench/common.py):
  mixed (64 requests, prompts 16-256, outputs 8-128), decode (128 x 16 -> 128), long
  (16 x 2,000 -> 64), shared (a 512-token system prompt; prefix caching on for both), single (one
  stream, 256 -> 256). EOS ignored, greedy, random token ids.
- served: `python -m vllm.entrypoints.openai.api_server` vs `make serve`'s app
  (`python -m cbserve.cluster.run ray_config.yaml`, on free ports), streamed `/v1/completions`
  (bench/serving.py's client) with 256-token prompts and 128 new tokens (ignore_eos) at 1, 8 and 32
  clients: output tok/s, TTFT and ITL p50/p90; and each server's time to ready and to its first token.
  With `cbserve_gguf` and `llamacpp` among the engines: the app on the GGUF file's own blocks
  (quantization 'auto') and llama.cpp's `llama-server` on the same file, one slot per client
  (continuous batching; it runs the file's own formats in every dtype's rounds, as the peer of
  each).
- float32 and bfloat16. vLLM gets its documented CPU settings (VLLM_CPU_KVCACHE_SPACE,
  VLLM_CPU_NUM_OF_RESERVED_CPU, VLLM_CPU_OMP_THREADS_BIND, tcmalloc / libiomp preload): with
  `--vllm-settings tune` (the default) each candidate runs a short offline probe and the fastest is
  kept for every vLLM run; the report says which.

Prints each figure, the median over `--repeat` rounds, cbserve/vLLM ratios and the greedy agreement
of the two on the first tokens; writes a JSON to bench/results/. A missing peer is skipped, saying so.

    python bench/peers.py                                   # everything: the official figures
    python bench/peers.py --mode offline --workloads mixed --dtypes bfloat16 --repeat 3
    python bench/peers.py --mode served --clients 1 --vllm-settings all-cores
    python bench/peers.py --mode served --engines cbserve,cbserve_gguf,llamacpp --dtypes bfloat16
    python bench/peers.py --check-peer                      # does vLLM import and generate offline?
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # standard library only: vLLM's venv imports this file too

DEFAULT_PEER_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_LLAMACPP_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
DEFAULT_LLAMA_SERVER = ROOT / ".venv-llamacpp" / "bin" / "llama-server"  # built by `make peers-llamacpp`
RESULTS = ROOT / "bench" / "results"
PEER = "vllm"
OFFLINE_ENGINES = ("cbserve", "vllm", "cbserve_sized", "cbserve_gguf", "cbserve_int8", "llamacpp", "cbserve_ngram",
                   "vllm_ngram", "cbserve_draft")
# Speculative decoding, n-gram prompt lookup, the same settings on both (vLLM's field names).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VLLM_ENGINES = (PEER, "vllm_ngram")  # run in vLLM's venv
# Served: `make serve`'s app (dense; `cbserve_gguf` on the GGUF file's own blocks), vLLM's OpenAI
# server, and llama.cpp's `llama-server` on the same GGUF file with continuous-batching slots.
SERVED_ENGINES = ("cbserve", "vllm", "cbserve_gguf", "llamacpp")
WARMUP = ([16, 32, 8, 24], [4, 8, 2, 6])  # prompt lengths, outputs: first-call costs, not timed


# -- the peer and its settings ---------------------------------------------------------------------


def peer_status(python: Path, timeout: float = 300.0, module: str = "vllm",
                target: str = "peers") -> tuple[str | None, str | None]:
    """(the peer's version, None) when `import <module>` works in `python`, else (None, why not)."""
    if not Path(python).exists():
        return None, f"{python} not found: `make {target}` installs {module} there"
    try:
        done = subprocess.run([str(python), "-c", f"import {module}; print({module}.__version__)"],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"`import {module}` in {python} took over {timeout:g} s"
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"`import {module}` failed in {python}: {last}"
    return done.stdout.strip().splitlines()[-1], None


def find_tcmalloc() -> str | None:
    """The system's tcmalloc (Debian/Ubuntu: apt-get install libtcmalloc-minimal4), if any."""
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        found = sorted(glob.glob(f"{folder}/libtcmalloc_minimal.so*")) + sorted(glob.glob(f"{folder}/libtcmalloc.so*"))
        if found:
            return found[0]
    return None


def find_iomp(python: Path) -> str | None:
    """Intel's OpenMP runtime that vllm-cpu installs (intel-openmp) into its venv's lib/."""
    path = Path(python).parent.parent / "lib" / "libiomp5.so"
    return str(path) if path.exists() else None


def vllm_candidates(kv_gib: int, tcmalloc: str | None, iomp: str | None) -> dict[str, dict[str, str]]:
    """vLLM's documented CPU settings, one environment each. `defaults`: vLLM binds its OpenMP threads
    itself and keeps one core of the node for its scheduler (x86); `all-cores` gives that core to the
    model too; the preloads are the install guide's performance tips (vLLM preloads torch's libgomp
    when no OpenMP is preloaded)."""
    base = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    every = {**base, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    out = {"defaults": base, "all-cores": every, "nobind": {**base, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
    if tcmalloc:
        out["all-cores+tcmalloc"] = {**every, "LD_PRELOAD": tcmalloc}
    if tcmalloc and iomp:
        out["all-cores+tcmalloc+iomp"] = {**every, "LD_PRELOAD": f"{tcmalloc}:{iomp}"}
    return out


def pick_fastest(probes: dict[str, float | None]) -> str:
    """The candidate with the highest probe tok/s (None: it failed)."""
    ran = {name: rate for name, rate in probes.items() if rate is not None}
    if not ran:
        raise RuntimeError(f"every vLLM settings candidate failed: {sorted(probes)}")
    return max(ran, key=ran.__getitem__)


# -- subprocesses ----------------------------------------------------------------------------------


def run_child(python: Path, job: dict[str, Any], env: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    """This file's worker (`--worker JOB`) in `python`, with `env` on top of ours; its result."""
    with tempfile.TemporaryDirectory(prefix="cbserve-peers-job-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        cmd = [str(python), str(Path(__file__).resolve()), "--worker", str(job_path), "--worker-out", str(out_path)]
        with open(log, "ab") as out:
            done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  check=False, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env})
        if done.returncode or not out_path.exists():
            raise RuntimeError(f"{job['engine']} exited with {done.returncode}; log {log}:\n{common.log_tail(log, 20)}")
        return json.loads(out_path.read_text())


def worker_main(job_path: Path, out_path: Path) -> int:
    job = json.loads(job_path.read_text())
    run = {"cbserve": offline_cbserve, "vllm": offline_vllm, "cbserve_sized": offline_cbserve_sized,
           "cbserve_gguf": offline_cbserve, "cbserve_int8": offline_cbserve, "llamacpp": offline_llamacpp,
           "cbserve_ngram": offline_cbserve,
           "cbserve_draft": offline_cbserve,
           "vllm_ngram": offline_vllm}[job["engine"]]
    out_path.write_text(json.dumps(run(job)))
    return 0


# -- offline engines (in the subprocess) -----------------------------------------------------------


def timed_workloads(job: dict[str, Any], generate: Any, ready_s: float, note: str) -> dict[str, Any]:
    """`generate(prompts, lengths) -> tokens` on the warm-up, then timed on each workload."""
    generate(*job["warmup"])
    runs = []
    for work in job["workloads"]:
        start = time.perf_counter()
        tokens = generate(work["prompts"], work["lengths"])
        seconds = time.perf_counter() - start
        runs.append(run_record(work, tokens, seconds))
        print(f"{job['engine']} {work['name']}: {runs[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    return {"engine": job["engine"], "dtype": job["dtype"], "ready_s": ready_s, "note": note, "runs": runs}


def run_record(work: dict[str, Any], tokens: list[list[int]], seconds: float) -> dict[str, Any]:
    """One timed workload: useful output tokens (never more than asked) over the wall time."""
    useful = sum(min(len(t), n) for t, n in zip(tokens, work["lengths"], strict=True))
    return {"workload": work["name"], "requests": len(tokens), "seconds": seconds, "output_tokens": useful,
            "tokens_per_s": useful / max(seconds, 1e-9),
            "exact_lengths": [len(t) for t in tokens] == work["lengths"], "tokens": tokens}


def offline_vllm(job: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    spec = {"speculative_config": NGRAM} if job["engine"] == "vllm_ngram" else {}
    llm = LLM(model=job["folder"], dtype=job["dtype"], enable_prefix_caching=True, seed=job["seed"], **spec)
    ready = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return timed_workloads(job, generate, ready, f"vllm {vllm.__version__} LLM.generate")


def _load_cbserve(job: dict[str, Any]) -> tuple[Any, int | None]:
    import cbserve

    model, tokenizer = cbserve.load_model(job["model"], dtype=job["dtype"])
    model.generation_config.eos_token_id = None  # EOS ignored: every request runs to its length
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, pad


def offline_cbserve(job: dict[str, Any]) -> dict[str, Any]:
    """The manager as a user builds it: default ContinuousBatchingConfig, no workload hints
    (`cbserve_gguf`: quantization='auto', the GGUF file's own blocks; `cbserve_int8`:
    quantization='int8'; `cbserve_ngram`: speculative decoding, NGRAM; `cbserve_draft`: a draft model,
    the model's own GGUF file on its quantized blocks, `draft_spec`)."""
    from throughput import greedy_config

    import cbserve

    start = time.perf_counter()
    model, pad = _load_cbserve(job)
    longest = max(n for work in job["workloads"] for n in work["lengths"])
    config = cbserve.ContinuousBatchingConfig(
        quantization={"cbserve_gguf": "auto", "cbserve_int8": "int8"}.get(job["engine"], "none"),
        speculative={"cbserve_ngram": NGRAM, "cbserve_draft": draft_spec(job)}.get(job["engine"]))
    manager = cbserve.init_continuous_batching(model, greedy_config(longest, pad), config)
    manager.start()
    ready = time.perf_counter() - start
    try:
        result = timed_workloads(job, lambda p, n: manager_generate(manager, p, n), ready, "")
        stats = manager.stats()
        result["note"] = (f"manager, default config: {stats.get('total_pages')} KV pages of "
                          f"{manager.config.page_size} tokens, max_batch_tokens {manager.engine.max_batch_tokens}")
        if config.speculative is not None:
            proposed, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
            result["note"] += f"; {accepted} of {proposed} proposed tokens accepted ({accepted / max(proposed, 1):.1%})"
        return result
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()


def offline_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python on the model's GGUF file (its own venv, `make peers-llamacpp`): greedy, EOS
    ignored; its Python API runs one sequence at a time, so requests go one after another."""
    import llama_cpp

    threads = len(os.sched_getaffinity(0))
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=4096, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, seed=job["seed"], verbose=False)
    ready = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        outs = []
        for prompt, n in zip(prompts, lengths, strict=True):
            tokens = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == n:
                    break
            outs.append(tokens)
        return outs

    return timed_workloads(job, generate, ready, f"llama-cpp-python {llama_cpp.__version__}, {threads} threads, "
                           "one request at a time")


def draft_spec(job: dict[str, Any]) -> dict[str, Any]:
    """`cbserve_draft`'s speculative config: the model's GGUF file on its own quantized blocks as the
    draft of the dense (dequantized) model: as cheap per pass as `cbserve_gguf`, and nearly always right."""
    return {"method": "draft_model", "model": job["gguf"], "quantization": "auto", "num_speculative_tokens": 4}


def manager_generate(manager: Any, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Every prompt through `add_request` at once, then each one's final output."""
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError(f"the manager stopped: {manager.error}")
            continue
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            done[out.request_id] = out
    return [list(done[i].generated_tokens) for i in ids]


def offline_cbserve_sized(job: dict[str, Any]) -> dict[str, Any]:
    """bench/throughput.py's EngineCore, sized for each workload (an engine per workload)."""
    import throughput

    start = time.perf_counter()
    model, pad = _load_cbserve(job)
    ready = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        work = common.Workload("job", prompts, lengths)
        return throughput.timed_run("cbserve", model, work, pad, None).tokens

    return timed_workloads(job, generate, ready, "EngineCore sized for each workload (bench/throughput.py)")


# -- offline (parent) ------------------------------------------------------------------------------


def build_workloads(names: list[str], requests: int | None, seed: int, model: str | None) -> list[common.Workload]:
    """The same token ids for every engine: the tokenizer's ordinary ids (no special tokens)."""
    from transformers import AutoTokenizer

    from cbserve.models import checkpoint_folder

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_folder(model)), local_files_only=True)
    special = set(tokenizer.all_special_ids)
    allowed = [t for t in range(len(tokenizer)) if t not in special]
    copy_ids = tokenizer.apply_chat_template([{"role": "user", "content": common.COPY_INSTRUCTION + common.COPY_TEXT}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    return [common.copy_workload(copy_ids, requests) if n == "copy" else common.make_workload(n, allowed, requests, seed)
            for n in names]


def gguf_file(model: str | None) -> str | None:
    """The GGUF file of `model` (the default model's by default), for cbserve_gguf and llama.cpp."""
    from cbserve.models import _resolve_gguf

    found = _resolve_gguf(model)
    return str(found[1]) if found else None


def offline_job(engine: str, dtype: str, workloads: list[common.Workload], args: argparse.Namespace,
                folder: str) -> dict[str, Any]:
    warm_prompts = [[100 + i for i in range(n)] for n in WARMUP[0]]
    return {"engine": engine, "dtype": dtype, "model": args.model, "folder": folder, "seed": args.seed,
            "gguf": gguf_file(args.model),
            "warmup": [warm_prompts, WARMUP[1]],
            "workloads": [{"name": w.name, "prompts": w.prompts, "lengths": w.lengths} for w in workloads]}


def tune_vllm(args: argparse.Namespace, folder: str, candidates: dict[str, dict[str, str]], logs: Path) -> dict:
    """A short mixed probe per candidate (the first dtype); the fastest is kept."""
    probe = build_workloads(["mixed"], args.tune_requests, args.seed + 1, args.model)
    rates: dict[str, float | None] = {}
    for name, env in candidates.items():
        print(f"tuning vLLM: {name} {env} ...", flush=True)
        try:
            res = run_child(args.vllm_python, offline_job(PEER, args.dtypes[0], probe, args, folder),
                            {**env, **args.vllm_env}, logs / f"tune-{name}.log", args.child_timeout)
            rates[name] = res["runs"][0]["tokens_per_s"]
            print(f"  {rates[name]:.1f} tok/s", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            rates[name] = None
            print(f"  failed: {str(error).splitlines()[0]}", flush=True)
    best = pick_fastest(rates)
    print(f"vLLM settings kept: {best} {candidates[best]}", flush=True)
    return {"probe_tokens_per_s": rates, "chosen": best}


def run_offline(args: argparse.Namespace, engines: list[str], folder: str, vllm_env: dict[str, str],
                logs: Path) -> list[dict[str, Any]]:
    """Each dtype: `repeat` rounds of every engine in turn, each round in a fresh subprocess."""
    workloads = build_workloads(args.workloads, args.requests, args.seed, args.model)
    results = []
    for dtype in args.dtypes:
        for rep in range(args.repeat):
            for engine in engines:
                print(f"offline {dtype} round {rep + 1}/{args.repeat}: {engine} ...", flush=True)
                python, env = {PEER: (args.vllm_python, vllm_env), "vllm_ngram": (args.vllm_python, vllm_env),
                               "llamacpp": (args.llamacpp_python, {})}.get(engine, (Path(sys.executable), {}))
                res = run_child(python, offline_job(engine, dtype, workloads, args, folder), env,
                                logs / f"offline-{engine}-{dtype}-{rep}.log", args.child_timeout)
                results.append({**res, "round": rep})
    return results


# -- served ----------------------------------------------------------------------------------------


def start_vllm_server(stack: contextlib.ExitStack, args: argparse.Namespace, folder: str, dtype: str,
                      env: dict[str, str], log: Path, extra: list[str] | None = None) -> str:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port (`extra`: more of its
    arguments); SIGINT at the end."""
    import load

    port = load.free_port()
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
           "--served-model-name", Path(folder).name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--seed", str(args.seed), "--uvicorn-log-level", "warning", *(extra or ())]
    return _serve_process(stack, cmd, port, log, args.start_timeout,
                          {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env})


def _serve_process(stack: contextlib.ExitStack, cmd: list[str], port: int, log: Path, timeout: float,
                   env: dict[str, str] | None = None) -> str:
    """A peer's server `cmd` listening on loopback `port`, in its own process group, its output in
    `log`; the base URL once it answers; SIGINT at the end."""
    import serving

    out = stack.enter_context(open(log, "wb"))  # noqa: SIM115 - closed by the stack
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, process_group=0,
                            env={**os.environ, **(env or {})})
    stack.callback(serving.stop_server, proc)
    base = f"http://127.0.0.1:{port}"
    serving.wait_until_ready(proc, base, timeout, log)
    return base


def start_cbserve_server(stack: contextlib.ExitStack, args: argparse.Namespace, dtype: str, log: Path,
                         overrides: dict[str, Any] | None = None) -> str:
    """`make serve`'s app: ray_config.yaml as shipped but for the dtype (and free ports); `overrides`:
    more of the app's args (an `engine` dict is merged into the shipped one)."""
    import serving
    import yaml

    config = yaml.safe_load(serving.DEFAULT_CONFIG.read_text())
    app_args = config["applications"][0].setdefault("args", {})
    app_args["dtype"] = dtype
    for key, value in (overrides or {}).items():
        app_args[key] = {**app_args.get(key, {}), **value} if key == "engine" else value
    if args.model is not None:
        app_args["model"] = args.model
    base, _ = serving.start_server(stack, config, log, args.start_timeout)
    return base


def start_llamacpp_server(stack: contextlib.ExitStack, args: argparse.Namespace, log: Path) -> str:
    """llama.cpp's `llama-server` on the model's GGUF file, as its docs run it for concurrent
    clients: one slot per client of the largest level (`-np`), continuous batching (its default),
    a unified KV cache of the slots' whole context, every CPU for decode and prompt threads."""
    import load

    port, slots, threads = load.free_port(), max(args.clients), len(os.sched_getaffinity(0))
    context = slots * (args.prompt_tokens + args.max_tokens + 64)
    cmd = [str(args.llama_server), "-m", gguf_file(args.model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(context), "--kv-unified", "-t", str(threads), "-tb", str(threads),
           "--no-webui", "--seed", str(args.seed)]
    return _serve_process(stack, cmd, port, log, args.start_timeout)


def served_round(args: argparse.Namespace, engine: str, dtype: str, folder: str, tokenizer: Any,
                 vllm_env: dict[str, str], log: Path) -> dict[str, Any]:
    """One server: its startup (to ready, to the first token), then every client level."""
    import load
    import serving

    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        if engine == PEER:
            base = start_vllm_server(stack, args, folder, dtype, vllm_env, log)
        elif engine == "llamacpp":  # the file's own formats: `dtype` does not apply
            base = start_llamacpp_server(stack, args, log)
        else:
            quantization = {"engine": {"quantization": "auto"}} if engine == "cbserve_gguf" else None
            base = start_cbserve_server(stack, args, dtype, log, quantization)
        ready = time.perf_counter() - start
        ours = engine.startswith("cbserve")
        target = load.url_target(base, None, os.environ.get("CBSERVE_API_KEY") if ours else None)
        first = serving.make_prompts(tokenizer, 1, args.prompt_tokens, 10**6 + args.seed)
        fresh = engine == "llamacpp"  # see http_level
        records, _ = asyncio.run(serving.http_level(target, first, 1, 4, args.request_timeout, ignore_eos=True,
                                                    fresh_connections=fresh))
        first_token = records[0].chunk_times[0] - start if records[0].chunk_times else None
        print(f"  {engine} ready in {ready:.1f} s, first token at {_s(first_token)} s", flush=True)
        levels = [served_level(args, target, tokenizer, n, clients, fresh) for n, clients in enumerate(args.clients)]
    return {"engine": engine, "dtype": dtype, "ready_s": ready, "first_token_s": first_token, "levels": levels}


def served_level(args: argparse.Namespace, target: Any, tokenizer: Any, n: int, clients: int,
                 fresh_connections: bool = False) -> dict[str, Any]:
    """bench/serving.py's closed loop: `clients` streams, a warm-up request each first (unmeasured)."""
    import serving

    seed = 1000 * args.seed + 100 * n
    warm = serving.make_prompts(tokenizer, clients, args.prompt_tokens, seed + 1)
    asyncio.run(serving.http_level(target, warm, clients, args.warmup_tokens, args.request_timeout, ignore_eos=True,
                                   fresh_connections=fresh_connections))
    prompts = serving.make_prompts(tokenizer, max(8, args.per_client * clients), args.prompt_tokens, seed + 2)
    records, wall = asyncio.run(serving.http_level(target, prompts, clients, args.max_tokens, args.request_timeout,
                                                   ignore_eos=True, fresh_connections=fresh_connections))
    s = serving.summarize(records, wall)
    s.pop("per_request_tokens")
    print(f"    {clients:>3} clients: {s['completed']}/{s['requests']} ok, {s['output_tokens_per_s']:.1f} out tok/s, "
          f"TTFT p50 {_ms(s['ttft_p50'])} ms, ITL p50 {_ms(s['itl_p50'])} ms", flush=True)
    return {"clients": clients, **s}


def run_served(args: argparse.Namespace, engines: list[str], folder: str, vllm_env: dict[str, str],
               logs: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    results = []
    for dtype in args.dtypes:
        for rep in range(args.repeat):
            for engine in engines:
                print(f"served {dtype} round {rep + 1}/{args.repeat}: {engine} ...", flush=True)
                log = logs / f"served-{engine}-{dtype}-{rep}.log"
                results.append({**served_round(args, engine, dtype, folder, tokenizer, vllm_env, log), "round": rep})
    return results


# -- report (pure: tests/bench/test_peers.py) ------------------------------------------------------


def offline_summary(results: list[dict[str, Any]], agree_first: int) -> list[dict[str, Any]]:
    """Per (dtype, workload): each engine's tok/s over the rounds and their median, cbserve/vLLM,
    and the greedy agreement of cbserve's and vLLM's first rounds."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for res in results:
        for run in res["runs"]:
            row = rows.setdefault((res["dtype"], run["workload"]), {"dtype": res["dtype"], "workload": run["workload"],
                                                                     "rates": {}, "tokens": {}})
            row["rates"].setdefault(res["engine"], []).append(run["tokens_per_s"])
            row["tokens"].setdefault(res["engine"], run.get("tokens"))
    out = []
    for row in rows.values():
        medians = {engine: common.median(rates) for engine, rates in row["rates"].items()}
        tokens = row.pop("tokens")
        pair = tokens.get("cbserve"), tokens.get(PEER)
        # Speculation must not change greedy tokens: cbserve_ngram against cbserve, vLLM's against vLLM.
        spec_same = {e: tokens[e] == tokens[base] for e, base in (("cbserve_ngram", "cbserve"), ("cbserve_draft", "cbserve"),
                                                          ("vllm_ngram", PEER))
                     if tokens.get(e) and tokens.get(base)}
        agree = common.agreement(*pair, agree_first) if pair[0] and pair[1] else None
        ratios = {e: common.ratio(medians[e], medians.get(PEER)) for e in medians if e != PEER}
        to_llamacpp = {e: common.ratio(medians[e], medians.get("llamacpp")) for e in medians if e != "llamacpp"}
        out.append({**row, "median": medians, "ratio_to_vllm": ratios, "ratio_to_llamacpp": to_llamacpp,
                    "agreement": agree, "speculation_same_tokens": spec_same})
    return out


SERVED_KEYS = ("output_tokens_per_s", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90")


def served_summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, clients): each engine's medians over the rounds of every figure, cbserve/vLLM and,
    on the same GGUF file, cbserve_gguf/llama.cpp."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for res in results:
        for level in res["levels"]:
            row = rows.setdefault((res["dtype"], level["clients"]), {"dtype": res["dtype"], "clients": level["clients"],
                                                                      "values": {}})
            for key in SERVED_KEYS:
                row["values"].setdefault(res["engine"], {}).setdefault(key, []).append(level[key])
    out = []
    for row in rows.values():
        medians = {e: {k: common.median([v for v in vs if v is not None]) for k, vs in by_key.items()}
                   for e, by_key in row.pop("values").items()}
        out.append({**row, "median": medians, "ratio_to_vllm": _served_ratios(medians, "cbserve", PEER),
                    "gguf_to_llamacpp": _served_ratios(medians, "cbserve_gguf", "llamacpp")})
    return out


def _served_ratios(medians: dict[str, dict[str, float]], ours: str, peer: str) -> dict[str, float | None]:
    return {k: common.ratio(medians.get(ours, {}).get(k), medians.get(peer, {}).get(k)) for k in SERVED_KEYS}


def startup_summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, engine): median seconds from the server's start to ready and to its first token."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for res in results:
        row = rows.setdefault((res["dtype"], res["engine"]), {"dtype": res["dtype"], "engine": res["engine"],
                                                              "ready": [], "first": []})
        row["ready"].append(res["ready_s"])
        if res["first_token_s"] is not None:
            row["first"].append(res["first_token_s"])
    return [{"dtype": r["dtype"], "engine": r["engine"], "ready_s": common.median(r["ready"]),
             "first_token_s": common.median(r["first"])} for r in rows.values()]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_offline(rows: list[dict[str, Any]]) -> str:
    header = (f"{'dtype':<9} {'workload':<8} {'engine':<14} {'median tok/s':>12}  {'rounds':<24} {'/ vLLM':>8} "
              f"{'/ llama.cpp':>11}")
    lines = [header]
    for row in rows:
        for engine, rates in row["rates"].items():
            ratio = "" if engine == PEER else _x(row["ratio_to_vllm"].get(engine))
            to_llamacpp = "" if engine == "llamacpp" else _x(row.get("ratio_to_llamacpp", {}).get(engine))
            lines.append(f"{row['dtype']:<9} {row['workload']:<8} {engine:<14} {row['median'][engine]:>12.1f}  "
                         f"{' '.join(f'{r:.1f}' for r in rates):<24} {ratio:>8} {to_llamacpp:>11}")
        if row.get("speculation_same_tokens"):
            lines.append(f"{'':<9} {row['workload']:<8} greedy tokens unchanged by speculation: "
                         f"{row['speculation_same_tokens']}")
        a = row["agreement"]
        if a:
            lines.append(f"{'':<9} {row['workload']:<8} greedy cbserve vs vLLM: {a['agree_first']}/{a['requests']} "
                         f"agree on their first {a['first']} tokens, {a['identical']} identical, mean common prefix "
                         f"{a['mean_common_prefix']:.1f} tokens")
    return "\n".join(lines)


def format_served(rows: list[dict[str, Any]]) -> str:
    header = f"{'dtype':<9} {'clients':>7} {'engine':<12} {'out tok/s':>10} {'TTFT p50/p90 ms':>16} {'ITL p50/p90 ms':>15}"
    lines = [header]
    for row in rows:
        for engine, m in row["median"].items():
            lines.append(f"{row['dtype']:<9} {row['clients']:>7} {engine:<12} {_s(m['output_tokens_per_s']):>10} "
                         f"{_ms(m['ttft_p50']) + '/' + _ms(m['ttft_p90']):>16} "
                         f"{_ms(m['itl_p50']) + '/' + _ms(m['itl_p90']):>15}")
        for name, key, pair in (("cbserve/vLLM", "ratio_to_vllm", ("cbserve", PEER)),
                                ("cbserve_gguf/llama.cpp", "gguf_to_llamacpp", ("cbserve_gguf", "llamacpp"))):
            if set(pair) <= set(row["median"]):
                r = row[key]
                lines.append(f"{'':<9} {row['clients']:>7} {name}: out tok/s {_x(r['output_tokens_per_s'])}, "
                             f"TTFT p50 {_x(r['ttft_p50'])}, ITL p50 {_x(r['itl_p50'])}")
    return "\n".join(lines)


def format_startup(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'dtype':<9} {'engine':<12} {'to ready s':>10} {'to first token s':>17}"]
    lines += [f"{r['dtype']:<9} {r['engine']:<12} {_s(r['ready_s']):>10} {_s(r['first_token_s']):>17}" for r in rows]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", type=_csv, default=["offline", "served"], help="offline,served (default both)")
    p.add_argument("--engines", type=_csv, default=["cbserve", "vllm"],
                   help=f"offline: a subset of {OFFLINE_ENGINES}; served: of {SERVED_ENGINES}")
    p.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"])
    p.add_argument("--workloads", type=_csv, default=list(common.WORKLOADS))
    p.add_argument("--requests", type=int, default=None, help="shrink every offline workload to N requests")
    p.add_argument("--repeat", type=int, default=3, help="alternating rounds per engine (the median is reported)")
    p.add_argument("--clients", type=lambda v: [int(c) for c in _csv(v)], default=[1, 8, 32])
    p.add_argument("--per-client", type=int, default=2, help="served requests per client and level (at least 8)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (its dequantized cache folder)")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_PEER_PYTHON)
    p.add_argument("--llamacpp-python", type=Path, default=DEFAULT_LLAMACPP_PYTHON,
                   help="the venv of `make peers-llamacpp` (engine llamacpp, offline)")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER,
                   help="llama.cpp's server binary (engine llamacpp, served; `make peers-llamacpp` builds it)")
    p.add_argument("--vllm-settings", default="tune", help="tune, or one candidate: defaults, all-cores, nobind, "
                   "all-cores+tcmalloc, all-cores+tcmalloc+iomp")
    p.add_argument("--tune-requests", type=int, default=16, help="requests of the mixed probe per candidate")
    p.add_argument("--tune-candidates", type=_csv, default=None, help="tune among these only (default: all)")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-env", action="append", default=[], metavar="NAME=VALUE", help="more vLLM environment")
    p.add_argument("--agree-first", type=int, default=16, help="greedy agreement on this many first tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child-timeout", type=float, default=3600.0)
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="default: bench/results/peers-<UTC time>.json")
    p.add_argument("--check-peer", action="store_true", help="only check that vLLM imports and generates offline")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    env = [item.partition("=") for item in args.vllm_env]
    if any(not sep or not name for name, sep, _ in env):
        p.error("--vllm-env takes NAME=VALUE")
    args.vllm_env = {name: value for name, _, value in env}
    checks = [(set(args.mode) <= {"offline", "served"} and args.mode, "--mode: offline and/or served"),
              (set(args.engines) <= set(OFFLINE_ENGINES) and args.engines, f"--engines: a subset of {OFFLINE_ENGINES}"),
              (set(args.dtypes) <= {"float32", "bfloat16"} and args.dtypes, "--dtypes: float32 and/or bfloat16"),
              (set(args.workloads) <= set(common.WORKLOADS), f"--workloads: a subset of {common.WORKLOADS}"),
              (args.repeat >= 1 and (args.requests is None or args.requests >= 1), "--repeat and --requests >= 1"),
              (args.clients and min(args.clients) >= 1, "--clients: counts >= 1")]
    for ok, message in checks:
        if not ok:
            p.error(message)


def plan_engines(args: argparse.Namespace, peer_missing: str | None) -> tuple[list[str], list[str]]:
    """(offline engines, served engines) to run: the peer dropped, saying why, when it is missing."""
    offline = [e for e in args.engines if e in OFFLINE_ENGINES]
    served = [e for e in args.engines if e in SERVED_ENGINES]
    if peer_missing and set(VLLM_ENGINES) & set(args.engines):
        print(f"SKIPPING vLLM: {peer_missing}; measuring cbserve alone (no ratios)", flush=True)
        offline, served = [e for e in offline if e not in VLLM_ENGINES], [e for e in served if e != PEER]
    if "llamacpp" in offline and "offline" in args.mode:
        _, missing = peer_status(args.llamacpp_python, module="llama_cpp", target="peers-llamacpp")
        if missing:
            print(f"SKIPPING llama.cpp: {missing}", flush=True)
            offline = [e for e in offline if e != "llamacpp"]
    if "llamacpp" in served and "served" in args.mode and not os.access(args.llama_server, os.X_OK):
        print(f"SKIPPING llama.cpp's server: no {args.llama_server} (`make peers-llamacpp` builds it)", flush=True)
        served = [e for e in served if e != "llamacpp"]
    return offline, served


def choose_vllm_env(args: argparse.Namespace, folder: str, logs: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The vLLM environment every vLLM run gets, and how it was chosen."""
    candidates = vllm_candidates(args.vllm_kv_gib, find_tcmalloc(), find_iomp(args.vllm_python))
    if args.vllm_settings == "tune":
        unknown = set(args.tune_candidates or ()) - set(candidates)
        if unknown:
            sys.exit(f"--tune-candidates: {sorted(unknown)} not among {sorted(candidates)}")
        tried = {k: v for k, v in candidates.items() if args.tune_candidates is None or k in args.tune_candidates}
        tuning = tune_vllm(args, folder, tried, logs)
    elif args.vllm_settings in candidates:
        tuning = {"chosen": args.vllm_settings}
    else:
        sys.exit(f"--vllm-settings {args.vllm_settings!r}: tune or one of {sorted(candidates)} (tcmalloc: "
                 f"{find_tcmalloc() or 'not found: apt-get install libtcmalloc-minimal4'})")
    env = {**candidates[tuning["chosen"]], **args.vllm_env}
    return env, {**tuning, "env": env, "candidates": candidates}


def check_peer(args: argparse.Namespace, folder: str) -> int:
    """`make peers`' check: vLLM imports and generates offline on the default model's folder."""
    version, missing = peer_status(args.vllm_python)
    if missing:
        print(f"vLLM peer missing: {missing}")
        return 1
    job = offline_job(PEER, "float32", [common.Workload("check", [[100 + i for i in range(16)]], [8])], args, folder)
    log = Path(tempfile.mkdtemp(prefix="cbserve-peers-")) / "check.log"
    env = vllm_candidates(args.vllm_kv_gib, None, None)["defaults"]
    res = run_child(args.vllm_python, job, {**env, **args.vllm_env}, log, args.child_timeout)
    print(f"vLLM {version} generated {res['runs'][0]['output_tokens']} tokens offline from {folder} "
          f"(ready in {res['ready_s']:.0f} s; log {log})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.worker_out)
    import load

    from cbserve.models import checkpoint_folder

    folder = str(checkpoint_folder(args.model))
    if args.check_peer:
        return check_peer(args, folder)
    version, missing = peer_status(args.vllm_python)
    offline_engines, served_engines = plan_engines(args, missing)
    logs = Path(tempfile.mkdtemp(prefix="cbserve-peers-"))
    info = load.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['load']}; model folder {folder}; "
          f"vLLM {version or 'missing'}; logs in {logs}", flush=True)
    runs_vllm = any(mode in args.mode and PEER in engines  # tune only for a run that uses vLLM
                    for mode, engines in (("offline", offline_engines), ("served", served_engines)))
    vllm_env, tuning = choose_vllm_env(args, folder, logs) if runs_vllm else ({}, {})
    report: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                              "vllm": {"version": version, "missing": missing, "settings": tuning}}
    if "offline" in args.mode:
        results = run_offline(args, offline_engines, folder, vllm_env, logs)
        report["offline"] = offline_summary(results, args.agree_first)
        report["offline_rounds"] = [{**r, "runs": [{**x, "tokens": None} for x in r["runs"]]} for r in results]
    if "served" in args.mode:
        results = run_served(args, served_engines, folder, vllm_env, logs)
        report["served"], report["startup"] = served_summary(results), startup_summary(results)
        report["served_rounds"] = results
    path = args.json or RESULTS / f"peers-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2, default=str))  # first: a report that fails to print is kept
    print_report(report)
    print(f"wrote {path}")
    return 0


def print_report(report: dict[str, Any]) -> None:
    vllm = report["vllm"]
    print()
    if vllm["missing"]:
        print(f"vLLM: skipped ({vllm['missing']})")
    elif not vllm["settings"]:
        print("vLLM: not among the engines run")
    else:
        print(f"vLLM {vllm['version']}, settings {vllm['settings']['chosen']}: {vllm['settings']['env']}")
        probes = vllm["settings"].get("probe_tokens_per_s")
        if probes:
            print("  tuning probe tok/s: " + ", ".join(f"{k} {_s(v)}" for k, v in probes.items()))
    if "offline" in report:
        print("\noffline (tok/s, median of the rounds):\n" + format_offline(report["offline"]))
        notes = {r["engine"]: (r["note"], r["ready_s"]) for r in report["offline_rounds"]}
        for engine, (note, ready) in notes.items():
            print(f"  {engine}: {note} (loaded and ready in {ready:.0f} s)")
    if "served" in report:
        print("\nserved, streamed /v1/completions (medians of the rounds):\n" + format_served(report["served"]))
        print("\nstartup (from the server's start):\n" + format_startup(report["startup"]))


if __name__ == "__main__":
    sys.exit(main())
