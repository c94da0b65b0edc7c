"""Batch jobs: every input line gets exactly one record, whatever fails (issue 26).

- A line refused while its request is built (`InvalidRequestError`: a `logit_bias` key that is no
  token id, two constraints) gets an `invalid_request` record naming the field.
- An engine that raises gets an `engine_error` record, never silence; a rerun retries the line.
  On Ray, the engine actor's exception arrives as a `RayTaskError`.
- A driver killed with SIGKILL in the middle of writing a record (a real subprocess, a real torn
  line), then resumed: exactly one whole record per line, none duplicated, none torn.
- The output is locked: a second job on the same output is refused while the first runs.

The engine is the job's own (`EngineActor`: an `EngineReplica` and its manager), run in this
process without Ray except where Ray's own error is the point.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cbserve.batch.backends import EngineActor, EnginePool
from cbserve.batch.io import OutputInUseError, OutputLock
from cbserve.batch.job import BatchJob, BatchOptions
from cbserve.batch.requests import RequestDefaults
from cbserve.batch.schema import record_key
from cbserve.cluster.settings import ClusterArgs
from cbserve.serving.front.replies import ChoiceResult
from cbserve.serving.protocol import WorkerRequest
from tests.support.cluster import start_local_ray, tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"page_size": 8, "num_blocks": 256, "max_batch_tokens": 128}
BIG = 16 << 20  # bytes of a big line's metadata: writing its record takes long enough to be cut


def engine_args(model_dir: Path) -> ClusterArgs:
    return ClusterArgs(model=str(model_dir), engine=ENGINE, worker={"num_cpus": 1.0})


class InProcessEngine:
    """The job's engine actor (`EngineActor`) in this process, as a `Backend`."""

    default_concurrency = 4

    def __init__(self, model_dir: Path):
        self._args = engine_args(model_dir)
        self._actor: EngineActor | None = None
        self.has_chat_template = False
        self.engines: list[dict[str, Any]] = []

    async def start(self) -> None:
        self._actor = EngineActor(self._args)
        self.engines = [self._actor.info()]
        self.has_chat_template = bool(self.engines[0]["has_chat_template"])

    async def run(self, req: WorkerRequest) -> ChoiceResult:
        assert self._actor is not None
        return await self._actor.run(req)

    async def close(self) -> None:
        if self._actor is not None:
            self._actor._replica.manager.stop(block=True, timeout=30)


class FaultyEngine(InProcessEngine):
    """Raises for the prompt "boom", as an engine with a bug would."""

    async def run(self, req: WorkerRequest) -> ChoiceResult:
        if req.prompt == "boom":
            raise ZeroDivisionError("injected engine fault")
        return await super().run(req)


def make_job(model_dir: Path, inp: Path, out: Path, backend: Any = None, **opts: Any) -> BatchJob:
    options = BatchOptions(input=inp, output=out, **{"progress": False, "retries": 0, "retry_delay_s": 0.01, **opts})
    defaults = RequestDefaults(max_tokens=4, temperature=0.0)
    return BatchJob(options, backend if backend is not None else InProcessEngine(model_dir), defaults)


async def run_job(job: BatchJob) -> Any:
    try:
        return await job.run()
    finally:
        await job.backend.close()


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def records_by_key(path: Path) -> dict[str, dict[str, Any]]:
    """The output's records by key; fails on a torn or duplicated record."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the output ends in a torn line"
    records = [json.loads(raw) for raw in data.split(b"\n")[:-1]]
    keys = [record_key(r) for r in records]
    assert len(keys) == len(set(keys)), "a line was written twice"
    return dict(zip(keys, records, strict=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


GOOD = [{"id": "a", "prompt": "the sea", "raw": True}, {"id": "b", "input_ids": [10, 11, 12]}]


def test_a_line_refused_while_its_request_is_built_gets_a_record(model_dir: Path, tmp_path: Path) -> None:
    bad = [
        {"id": "bias", "prompt": "x", "raw": True, "logit_bias": {"abc": 1.0}},
        {"id": "two", "prompt": "x", "raw": True, "guided_choice": ["yes"], "guided_regex": "a+"},
    ]
    inp = write_lines(tmp_path / "in.jsonl", [GOOD[0], *bad, GOOD[1]])
    out = tmp_path / "out.jsonl"
    summary = asyncio.run(run_job(make_job(model_dir, inp, out)))
    records = records_by_key(out)
    assert set(records) == {'id:"a"', 'id:"bias"', 'id:"two"', 'id:"b"'}
    assert records['id:"bias"']["error_type"] == "invalid_request"
    assert records['id:"bias"']["error"].startswith("logit_bias:"), records['id:"bias"']
    assert records['id:"two"']["error_type"] == "invalid_request"
    assert "only one output constraint" in records['id:"two"']["error"], records['id:"two"']
    assert records['id:"a"']["finish_reason"] == "length" and records['id:"b"']["token_ids"]
    assert (summary.written, summary.ok, summary.errors["invalid_request"]) == (4, 2, 2)
    again = asyncio.run(run_job(make_job(model_dir, inp, out)))  # refusals are final: nothing reruns
    assert (again.skipped, again.written) == (4, 0)


def test_an_engine_that_raises_gets_a_record_and_a_rerun_retries_the_line(model_dir: Path, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [GOOD[0], {"id": "boom", "prompt": "boom", "raw": True}, GOOD[1]])
    out = tmp_path / "out.jsonl"
    first = asyncio.run(run_job(make_job(model_dir, inp, out, FaultyEngine(model_dir))))
    records = records_by_key(out)
    assert set(records) == {'id:"a"', 'id:"boom"', 'id:"b"'}
    assert records['id:"boom"']["error_type"] == "engine_error"
    assert "ZeroDivisionError: injected engine fault" in records['id:"boom"']["error"]
    assert (first.written, first.ok, first.errors["engine_error"]) == (3, 2, 1)

    second = asyncio.run(run_job(make_job(model_dir, inp, out)))  # the engine works again
    assert (second.skipped, second.written, second.ok) == (2, 1, 1)
    records = records_by_key(out)
    assert set(records) == {'id:"a"', 'id:"boom"', 'id:"b"'}
    assert "error" not in records['id:"boom"'] and records['id:"boom"']["finish_reason"] == "length"


def test_exit_status_says_whether_lines_are_left_to_retry() -> None:
    from cbserve.batch.__main__ import exit_status
    from cbserve.batch.progress import Summary

    done = Summary(lines=3, written=3, ok=2)
    done.errors["invalid_request"] = 1
    assert exit_status(done) == 0  # every line has its final record
    left = Summary(lines=3, written=3, ok=2)
    left.errors["engine_error"] = 1
    assert exit_status(left) == 1


# ---- the output lock ----------------------------------------------------------------------------


def test_output_lock_refuses_a_second_holder_by_any_path(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    alias = tmp_path / "alias.jsonl"
    alias.symlink_to(out)
    refusal = r"--output: .*out\.jsonl is being written by another batch job \(pid \d+ on "
    with OutputLock(out), pytest.raises(OutputInUseError, match=refusal):
        OutputLock(alias).acquire()
    with OutputLock(alias):  # released: free again
        pass


# ---- a driver killed with SIGKILL in the middle of a record -------------------------------------

CHILD = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.batch.test_batch_isolation import make_job, run_job
asyncio.run(run_job(make_job(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), concurrency=2)))
"""


def kill_lines() -> list[dict[str, Any]]:
    """Small lines and, every third line, one with a 16 MiB metadata of two-byte characters."""
    lines: list[dict[str, Any]] = []
    for i in range(1, 13):
        line: dict[str, Any] = {"id": f"l{i}", "prompt": f"the sea {i}", "raw": True}
        if i % 3 == 0:
            line["metadata"] = {"blob": chr(0xE9) * (BIG // 2), "i": i}
        lines.append(line)
    return lines


def _torn(path: Path, min_size: int) -> bool:
    """The output holds at least `min_size` bytes and ends inside a record."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < min_size:
                return False
            f.seek(size - 1)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _kill_mid_write(model_dir: Path, inp: Path, out: Path) -> bool:
    """Start the job in a subprocess; once it holds the output, check that a second job is refused;
    SIGKILL it while a big record is half written. False if it finished first."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(model_dir), str(inp), str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not (out.exists() and out.stat().st_size) and child.poll() is None:
            assert time.monotonic() < deadline, "the job wrote nothing"
            time.sleep(0.01)
        if child.poll() is None:
            with pytest.raises(OutputInUseError, match=str(child.pid)):
                asyncio.run(run_job(make_job(model_dir, inp, out)))
        while child.poll() is None:  # a whole big record first, then a cut one
            if _torn(out, BIG + 1):
                child.send_signal(signal.SIGKILL)
                break
        assert time.monotonic() < deadline, "no record was cut"
    finally:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate(timeout=60)
    if child.returncode != -signal.SIGKILL:
        assert child.returncode == 0, err.decode(errors="replace")[-3000:]
        return False
    return True


@pytest.mark.slow
def test_resume_after_sigkill_mid_write_gives_one_whole_record_per_line(model_dir: Path, tmp_path: Path) -> None:
    lines = kill_lines()
    inp = write_lines(tmp_path / "in.jsonl", lines)
    reference = tmp_path / "reference.jsonl"
    asyncio.run(run_job(make_job(model_dir, inp, reference, concurrency=2)))
    expected = records_by_key(reference)
    assert len(expected) == len(lines) and all("error" not in r for r in expected.values())

    out = tmp_path / "out.jsonl"
    for _ in range(3):  # a job that finished before a record could be cut runs again
        out.unlink(missing_ok=True)
        if _kill_mid_write(model_dir, inp, out):
            break
    else:
        pytest.fail("the job always finished before a record could be cut")
    data = out.read_bytes()
    assert not data.endswith(b"\n")  # killed mid-record: a torn line
    whole = data.count(b"\n")
    assert 0 < whole < len(lines)

    summary = asyncio.run(run_job(make_job(model_dir, inp, out)))
    assert (summary.skipped, summary.written) == (whole, len(lines) - whole)
    assert records_by_key(out) == expected


# ---- on Ray: the engine actor raises ------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_engine_actor_raising_is_a_record_not_lost(model_dir: Path, tmp_path: Path) -> None:
    """The actor's exception reaches the job as a `RayTaskError`: the line gets an `engine_error`
    record (an `InvalidRequestError` inside it, an `invalid_request`); a rerun retries the line."""
    import ray

    from cbserve.errors import InvalidRequestError

    class RaisingActor(EngineActor):  # defined here: Ray ships it to the actor by value
        async def _run(self, req: WorkerRequest) -> ChoiceResult:
            if req.prompt == "boom":
                raise ZeroDivisionError("injected engine fault")
            if req.prompt == "refuse":
                raise InvalidRequestError("temperature", "temperature: injected refusal")
            return await super()._run(req)

    lines = [GOOD[0], {"id": "boom", "prompt": "boom", "raw": True},
             {"id": "refuse", "prompt": "refuse", "raw": True}, GOOD[1]]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = EnginePool(engine_args(model_dir), 1, 1, 1.0, 0.0, actor_cls=RaisingActor)
        first = asyncio.run(run_job(make_job(model_dir, inp, out, pool, retries=1)))
        records = records_by_key(out)
        assert set(records) == {'id:"a"', 'id:"boom"', 'id:"refuse"', 'id:"b"'}
        assert records['id:"boom"']["error_type"] == "engine_error"
        assert "ZeroDivisionError: injected engine fault" in records['id:"boom"']["error"]
        assert records['id:"refuse"'] == {"id": "refuse", "line": 3, "error_type": "invalid_request",
                                          "error": "temperature: injected refusal"}
        assert (first.ok, first.retries, dict(first.errors)) == (2, 1, {"engine_error": 1, "invalid_request": 1})

        pool = EnginePool(engine_args(model_dir), 1, 1, 1.0, 0.0)
        second = asyncio.run(run_job(make_job(model_dir, inp, out, pool)))
        assert (second.skipped, second.written, second.ok) == (3, 1, 1)
        assert "error" not in records_by_key(out)['id:"boom"']
    finally:
        ray.shutdown()
