"""Batch jobs (`python -m cbserve.batch`) on a local Ray with the tiny model.

- 200 input lines, bad ones among them: every good line's record equals `generate_batch`'s greedy
  result, every bad line gets an error; a rerun after deleting the last 50 records (and leaving a
  torn line) redoes exactly those 50.
- The same lines through a running Serve app's worker deployment (`--serve-app`).
- The real `ray job submit` CLI against a `ray start --head` cluster started here: SUCCEEDED.
- Without Ray: resuming from an output file (torn tail, missing newline, engine errors) and the
  example prompts file.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cbserve.batch.io import prepare_output
from cbserve.batch.job import BatchOptions, run_batch
from cbserve.batch.schema import BatchLine, parse_line, record_key
from tests.support.cluster import WORDS, free_port, start_local_ray, tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"page_size": 8, "num_blocks": 512, "max_batch_tokens": 256}
DEFAULT_MAX_TOKENS = 12  # --max-tokens of the job: lines without max_tokens get this
NUM_LINES = 200
NUM_STOP_LINES = 10


@dataclass
class Lines:
    texts: list[str]  # the input file's lines, in order
    good: dict[str, dict[str, Any]] = field(default_factory=dict)  # record key -> expected record
    bad: dict[int, tuple[str, str]] = field(
        default_factory=dict
    )  # line number -> (error_type, text in error)


# ---- building the input and its expected results -----------------------------------------------


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _good_specs(rng: random.Random, vocab_size: int) -> list[dict[str, Any]]:
    """150 good lines (148 + two): chat and raw prompts, chats, token ids; greedy by line or by the flag."""
    specs = []
    for i in range(NUM_LINES - 52):
        line: dict[str, Any] = {"id": i if i % 10 == 3 else f"g{i}"}
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        kind = i % 4
        if kind == 0:
            line["prompt"] = text
        elif kind == 1:
            line.update(prompt=text, raw=True)
        elif kind == 2:
            line["messages"] = ([{"role": "system", "content": "be brief"}] if i % 8 == 2 else []) + [
                {"role": "user", "content": text}
            ]
        else:
            line["input_ids"] = [rng.randrange(4, vocab_size) for _ in range(rng.randint(1, 24))]
        max_tokens = rng.choice([None, 4, 8, 16])
        if max_tokens is not None:
            line["max_tokens"] = max_tokens
        if i % 2:
            line["temperature"] = 0.0  # the others are greedy through --temperature 0
        if i % 7 == 0:
            line["metadata"] = {"n": i}
        specs.append(line)
    specs.append({"id": "7", "input_ids": [10, 11, 12], "temperature": 0})  # "7" is not 7
    specs.append({"id": 7, "input_ids": [10, 11, 12], "max_tokens": 4})
    return specs


def _prompt_ids(tokenizer: Any, line: dict[str, Any]) -> list[int]:
    if "input_ids" in line:
        return list(line["input_ids"])
    if "messages" in line:
        return _chat_ids(tokenizer, line["messages"])
    if line.get("raw"):
        return list(tokenizer(line["prompt"]).input_ids)
    return _chat_ids(tokenizer, [{"role": "user", "content": line["prompt"]}])


def _greedy_reference(model: Any, tokenizer: Any, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`generate_batch` (the Python API), greedy, one call per max_tokens."""
    from transformers import GenerationConfig

    import cbserve

    eos = model.generation_config.eos_token_id
    by_max: dict[int, list[int]] = {}
    for i, line in enumerate(specs):
        by_max.setdefault(line.get("max_tokens", DEFAULT_MAX_TOKENS), []).append(i)
    expected: list[dict[str, Any]] = [{} for _ in specs]
    for max_tokens, idx in by_max.items():
        prompts = [_prompt_ids(tokenizer, specs[i]) for i in idx]
        outs = cbserve.generate_batch(
            model,
            prompts,
            GenerationConfig(max_new_tokens=max_tokens, eos_token_id=eos, do_sample=False),
            cbserve.ContinuousBatchingConfig(**ENGINE),
            progress_bar=False,
        )
        for j, i in enumerate(idx):
            out = outs[f"req_{j}"]
            tokens = list(out.generated_tokens)
            assert out.status == cbserve.RequestStatus.FINISHED
            expected[i] = {
                "id": specs[i]["id"],
                "text": tokenizer.decode(tokens, skip_special_tokens=True),
                "token_ids": tokens,
                "finish_reason": "length" if out.finish_reason == cbserve.FinishReason.LENGTH else "stop",
                "usage": {
                    "prompt_tokens": len(prompts[j]),
                    "completion_tokens": len(tokens),
                    "total_tokens": len(prompts[j]) + len(tokens),
                },
            }
            if "metadata" in specs[i]:
                expected[i]["metadata"] = specs[i]["metadata"]
    return expected


def _add_stop_strings(specs: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """A stop string taken from the middle of the reference text: the record must be cut there."""
    added = 0
    for line, exp in zip(specs, expected, strict=True):
        text = exp["text"]
        cut = next(
            (k for k in range(2, len(text) - 2) if text[k : k + 2].isascii() and text[k : k + 2].isalpha()),
            None,
        )
        if cut is None or "input_ids" in line:
            continue
        stop = text[cut : cut + 2]
        line["stop"] = [stop, "never-seen-stop"] if added % 2 else stop
        exp.update(
            text=text[: text.index(stop)],
            finish_reason="stop",
            stop_prefix=exp.pop("token_ids"),
            prompt_tokens=exp.pop("usage")["prompt_tokens"],
        )
        added += 1
        if added == NUM_STOP_LINES:
            return
    raise AssertionError(f"only {added} lines could get a stop string")


def _bad_lines() -> list[tuple[str, str, str]]:
    """(line text, error_type, a piece of the error message)."""
    long_ids = json.dumps(list(range(5, 305)) * 2)
    templates = [
        ("not json at all", "invalid_json", "invalid JSON"),
        ('{"id": "t", "prompt": "a"', "invalid_json", "invalid JSON"),
        ("[1, 2]", "invalid_line", "JSON object"),
        ('{"prompt": "no id"}', "invalid_line", "id"),
        ('{"id": true, "prompt": "x"}', "invalid_line", "id"),
        ('{"id": "", "prompt": "x"}', "invalid_line", "id"),
        (
            '{"id": "{id}", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
            "invalid_line",
            "exactly one",
        ),
        ('{"id": "{id}"}', "invalid_line", "exactly one"),
        ('{"id": "{id}", "prompt": ""}', "invalid_line", "prompt"),
        ('{"id": "{id}", "input_ids": []}', "invalid_line", "input_ids"),
        ('{"id": "{id}", "input_ids": [1, "x"]}', "invalid_line", "input_ids"),
        ('{"id": "{id}", "input_ids": [100000]}', "invalid_request", "vocabulary"),
        ('{"id": "{id}", "input_ids": [-1]}', "invalid_request", "vocabulary"),
        ('{"id": "{id}", "prompt": "x", "max_tokens": 0}', "invalid_line", "max_tokens"),
        ('{"id": "{id}", "prompt": "x", "max_tokens": 1.5}', "invalid_line", "max_tokens"),
        ('{"id": "{id}", "prompt": "x", "temperature": "hot"}', "invalid_line", "temperature"),
        ('{"id": "{id}", "prompt": "x", "temperature": -1}', "invalid_line", "temperature"),
        ('{"id": "{id}", "prompt": "x", "temperature": NaN}', "invalid_line", "temperature"),
        ('{"id": "{id}", "prompt": "x", "top_p": 0}', "invalid_line", "top_p"),
        ('{"id": "{id}", "prompt": "x", "top_k": -2}', "invalid_line", "top_k"),
        ('{"id": "{id}", "prompt": "x", "seed": -1}', "invalid_line", "seed"),
        ('{"id": "{id}", "prompt": "x", "unknown_field": 1}', "invalid_line", "unknown_field"),
        ('{"id": "{id}", "messages": [{"role": "user"}]}', "invalid_line", "messages"),
        ('{"id": "{id}", "messages": "hi"}', "invalid_line", "messages"),
        ('{"id": "{id}", "input_ids": [1, 2], "raw": true}', "invalid_line", "raw"),
        ('{"id": "{id}", "prompt": "x", "stop": ["", "a"]}', "invalid_line", "stop"),
        ('{"id": "{id}", "input_ids": ' + long_ids + "}", "invalid_request", "context"),  # prompt too long
    ]
    out = []
    for k in range(47):
        text, kind, piece = templates[k % len(templates)]
        out.append((text.replace("{id}", f"bad{k}"), kind, piece))
    return out


def build_lines(tokenizer: Any, model: Any) -> tuple[Lines, list[dict[str, Any]]]:
    rng = random.Random(1234)
    specs = _good_specs(rng, int(model.config.vocab_size))
    expected = _greedy_reference(model, tokenizer, specs)
    _add_stop_strings(specs, expected)
    entries: list[tuple[str, Any]] = [("good", (s, e)) for s, e in zip(specs, expected, strict=True)]
    entries += [("bad", b) for b in _bad_lines()]
    rng.shuffle(entries)
    # Three lines repeating earlier good ids (a string id, an integer id, and "7" after 7 or "7").
    for dup_id in ("g0", 3, "7"):
        first = next(i for i, (kind, val) in enumerate(entries) if kind == "good" and val[0]["id"] == dup_id)
        pos = rng.randint(first + 1, len(entries))
        text = json.dumps({"id": dup_id, "prompt": "again"})
        entries.insert(pos, ("bad", (text, "duplicate_id", "already used by line")))
    assert len(entries) == NUM_LINES
    lines = Lines(texts=[])
    for lineno, (kind, val) in enumerate(entries, 1):
        if kind == "good":
            spec, exp = val
            lines.texts.append(json.dumps(spec))
            lines.good[record_key({"id": spec["id"], "line": lineno})] = {**exp, "line": lineno}
        else:
            text, error_type, piece = val
            lines.texts.append(text)
            lines.bad[lineno] = (error_type, piece)
    return lines, specs


# ---- checking the output --------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def check_records(records: list[dict[str, Any]], lines: Lines) -> None:
    keys = [record_key(r) for r in records]
    assert len(keys) == len(set(keys)), "a line was written twice"
    assert len(records) == len(lines.texts)
    for rec in records:
        key = record_key(rec)
        if key in lines.good:
            exp = lines.good[key]
            assert "error" not in rec, (rec, exp)
            assert rec["line"] == exp["line"] and rec["id"] == exp["id"]
            assert rec["text"] == exp["text"], (rec, exp)
            assert rec["finish_reason"] == exp["finish_reason"], (rec, exp)
            assert rec.get("metadata") == exp.get("metadata")
            if "stop_prefix" in exp:  # cut by a stop string: the tokens generated until it was seen
                assert rec["token_ids"] == exp["stop_prefix"][: len(rec["token_ids"])], (rec, exp)
                assert rec["usage"]["prompt_tokens"] == exp["prompt_tokens"]
                assert rec["usage"]["completion_tokens"] == len(rec["token_ids"])
            else:
                assert rec["token_ids"] == exp["token_ids"], (rec, exp)
                assert rec["usage"] == exp["usage"], (rec, exp)
        else:
            assert rec["line"] in lines.bad, rec
            error_type, piece = lines.bad[rec["line"]]
            assert rec["error_type"] == error_type, (rec, lines.texts[rec["line"] - 1])
            assert piece in rec["error"], (rec, piece)
            assert "text" not in rec and "token_ids" not in rec


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def lines(model_dir: Path) -> Lines:
    import cbserve

    # The engines' dtype (ClusterArgs.dtype), not load_model's "auto".
    model, tokenizer = cbserve.load_model(str(model_dir), dtype="float32")
    built, _ = build_lines(tokenizer, model)
    return built


def subset_of(lines: Lines, n: int) -> Lines:
    """The first n lines (duplicates always come after the line they repeat)."""
    return Lines(
        texts=lines.texts[:n],
        good={k: v for k, v in lines.good.items() if v["line"] <= n},
        bad={lineno: v for lineno, v in lines.bad.items() if lineno <= n},
    )


def write_input(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(t + "\n" for t in texts) + "\n", encoding="utf-8")  # a trailing blank line
    return path


def options(model_dir: Path, inp: Path, out: Path, **extra: Any) -> BatchOptions:
    base: dict[str, Any] = {
        "model": str(model_dir),
        "engine": ENGINE,
        "max_tokens": DEFAULT_MAX_TOKENS,
        "temperature": 0.0,
        "progress": False,
        "log_every": 50,
    }
    base.update(extra)
    return BatchOptions(input=inp, output=out, **base)


# ---- on an in-process local Ray -------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
class TestOnLocalRay:
    @pytest.fixture(scope="class", autouse=True)
    def local_ray(self) -> Any:
        import ray

        # address="local": a new cluster, never one that `ray start` left on this machine
        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()

    def test_engine_pool_200_lines_then_resume_redoes_only_the_last_50(
        self, model_dir: Path, lines: Lines, tmp_path: Path
    ) -> None:
        inp = write_input(tmp_path / "prompts.jsonl", lines.texts)
        out = tmp_path / "results.jsonl"
        opts = options(model_dir, inp, out, replicas=2, concurrency=48)

        first = asyncio.run(run_batch(opts))
        assert [e["tp_ranks"] for e in first.engines] == [1, 1]
        records = read_records(out)
        check_records(records, lines)
        assert (first.lines, first.blank, first.skipped, first.written) == (NUM_LINES, 1, 0, NUM_LINES)
        assert first.ok == len(lines.good)
        assert sum(first.errors.values()) == len(lines.bad)

        # A crash: the last 50 records never written, and a torn half line at the end.
        kept, lost = records[:-50], records[-50:]
        torn = json.dumps(lost[0])[:25]
        out.write_text("".join(json.dumps(r) + "\n" for r in kept) + torn, encoding="utf-8")

        opts.replicas = 1  # a new job, and a smaller pool this time
        second = asyncio.run(run_batch(opts))
        assert (second.skipped, second.written) == (NUM_LINES - 50, 50)
        redone = read_records(out)
        assert redone[:-50] == kept  # untouched, torn line gone
        assert {record_key(r) for r in redone[-50:]} == {record_key(r) for r in lost}
        assert second.ok == sum(1 for r in lost if record_key(r) in lines.good)
        check_records(redone, lines)

        third = asyncio.run(run_batch(opts))  # nothing left to do: no engine is even started
        assert (third.skipped, third.written) == (NUM_LINES, 0)
        assert read_records(out) == redone

    def test_tensor_parallel_engine_equals_python_api(
        self, model_dir: Path, lines: Lines, tmp_path: Path
    ) -> None:
        """--tp-size 2: one engine actor (rank 0) and its second rank in one placement group."""
        inp = write_input(tmp_path / "prompts.jsonl", lines.texts[:30])
        out = tmp_path / "results.jsonl"
        summary = asyncio.run(run_batch(options(model_dir, inp, out, tp_size=2, num_cpus=1.0)))
        [engine] = summary.engines
        assert (engine["has_chat_template"], engine["tp_ranks"]) == (True, 2)
        sub = subset_of(lines, 30)
        assert summary.written == 30 and summary.ok == len(sub.good)
        check_records(read_records(out), sub)

    def test_serve_app_mode_equals_python_api(self, model_dir: Path, lines: Lines, tmp_path: Path) -> None:
        from ray import serve

        from cbserve.cluster.app import build_app

        subset = list(range(60))  # good, bad and duplicate lines among the first 60
        inp = write_input(tmp_path / "prompts.jsonl", [lines.texts[i] for i in subset])
        out = tmp_path / "results.jsonl"
        serve.start(proxy_location="Disabled")  # the job reaches the workers through a handle, not HTTP
        try:
            args = {
                "model": str(model_dir),
                "engine": ENGINE,
                "generation": {"max_tokens": 16},
                "worker": {"num_replicas": 1, "num_cpus": 1.0},
            }
            serve.run(build_app(args), name="batchapp", route_prefix="/batchapp")
            summary = asyncio.run(run_batch(options(model_dir, inp, out, serve_app="batchapp")))
            with pytest.raises(RuntimeError, match="no Serve application named 'nope'"):
                asyncio.run(run_batch(options(model_dir, inp, tmp_path / "other.jsonl", serve_app="nope")))
        finally:
            serve.shutdown()
        sub = subset_of(lines, len(subset))
        assert summary.written == len(subset) and summary.ok == len(sub.good)
        check_records(read_records(out), sub)


# ---- the real `ray job submit` --------------------------------------------------------------


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=timeout)


@dataclass
class RayHead:
    address: str  # the dashboard's, for `ray job`
    env: dict[str, str]  # this cluster's own auth token: ~/.ray/auth_token is shared with other clusters


@pytest.fixture
def ray_head() -> Any:
    """`ray start --head --block` in its own session; stopped by signalling that process only."""
    temp_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths have a length limit
    dash = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex}
    cmd = [_ray_cli(), "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=1",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--temp-dir={temp_dir}", "--disable-usage-stats"]  # fmt: skip
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(f"http://127.0.0.1:{dash}", env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, Path(temp_dir, "ray-start.log").read_text()
            probe = _run([_ray_cli(), "job", "list", "--address", head.address], env, 60)
            if probe.returncode == 0:
                break
            assert time.monotonic() < deadline, f"the Ray head did not come up: {probe.stderr[-2000:]}"
            time.sleep(2)
        yield head
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


JOB_STATUS = (
    "import sys; from ray.job_submission import JobSubmissionClient as C; "
    "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)"
)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit_succeeds(ray_head: RayHead, model_dir: Path, lines: Lines, tmp_path: Path) -> None:
    subset = list(range(30))
    inp = write_input(tmp_path / "prompts.jsonl", [lines.texts[i] for i in subset])
    out = tmp_path / "results.jsonl"
    job_id = f"cbserve-batch-test-{uuid.uuid4().hex[:8]}"
    job = [sys.executable, "-m", "cbserve.batch", "--input", str(inp), "--output", str(out),
           "--model", str(model_dir), "--engine", json.dumps(ENGINE), "--max-tokens", str(DEFAULT_MAX_TOKENS),
           "--temperature", "0", "--no-progress", "--log-every", "10"]  # fmt: skip
    deadline = time.monotonic() + 300  # a cold clean clone's agent took over 120 s once
    while True:  # the head answers `ray job list` before its job agent has registered
        submit = _run([_ray_cli(), "job", "submit", "--address", ray_head.address, "--submission-id", job_id,
                       "--working-dir", str(REPO), "--", *job], ray_head.env, 300)  # fmt: skip
        if "No available agent to submit job" not in submit.stdout + submit.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert "summary:" in submit.stdout, submit.stdout[-4000:]
    status = _run([sys.executable, "-c", JOB_STATUS, ray_head.address, job_id], ray_head.env, 120)
    assert status.stdout.strip() == "SUCCEEDED", status.stdout + status.stderr[-2000:]
    sub = subset_of(lines, len(subset))
    assert sub.good and sub.bad
    check_records(read_records(out), sub)


# ---- without Ray ----------------------------------------------------------------------------


def test_prepare_output_repairs_and_reports_done_lines(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    assert prepare_output(out).done == set()
    ok = {"id": "a", "line": 1, "text": "x", "token_ids": [1], "finish_reason": "length"}
    bad = {"id": None, "line": 2, "error": "invalid JSON", "error_type": "invalid_json"}
    dup = {"id": "a", "line": 3, "error": "dup", "error_type": "duplicate_id"}
    failed = {"id": 4, "line": 4, "error": "engine died", "error_type": "engine_error"}
    body = "".join(json.dumps(r) + "\n" for r in (ok, bad, dup))

    out.write_text(body + '{"id": "b", "li')  # torn
    state = prepare_output(out)
    assert state.torn and state.done == {'id:"a"', "line:2", "line:3"}
    assert out.read_text() == body

    out.write_text(body + json.dumps({"id": "b", "line": 5, "text": ""}))  # whole, newline missing
    state = prepare_output(out)
    assert not state.torn and 'id:"b"' in state.done
    assert out.read_text() == body + json.dumps({"id": "b", "line": 5, "text": ""}) + "\n"

    out.write_text(body + json.dumps(failed) + "\nnot json\n")  # engine errors and junk run again
    state = prepare_output(out)
    assert (state.dropped_retryable, state.dropped_invalid, state.kept) == (1, 1, 3)
    assert "id:4" not in state.done
    assert out.read_text() == body


def test_parse_line_names_the_field() -> None:
    assert isinstance(parse_line('{"id": 1, "prompt": "hi", "stop": "x"}', 1), BatchLine)
    err = parse_line('{"id": "a", "prompt": "hi", "top_p": 2}', 9)
    assert not isinstance(err, BatchLine)
    assert (err.id, err.line, err.error_type) == ("a", 9, "invalid_line")
    assert err.error.startswith("top_p:")
    assert parse_line('{"id": 1.5, "prompt": "hi"}', 2).id is None  # not usable: keyed by line number


def test_example_prompts_are_valid_lines() -> None:
    texts = [t for t in (REPO / "examples" / "prompts.jsonl").read_text().splitlines() if t.strip()]
    parsed = [parse_line(t, n) for n, t in enumerate(texts, 1)]
    assert all(isinstance(p, BatchLine) for p in parsed), parsed
    assert any(p.messages for p in parsed) and any(p.input_ids for p in parsed)
    assert any(p.prompt and not p.raw for p in parsed)
