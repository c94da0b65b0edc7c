"""`bench/serving.py` (issue 21): prompts of an exact token count, the statistics and the
HTTP/engine checks on made-up records, and the CPU accounting of a process tree."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.cluster import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = serving  # dataclasses look their module up by name
_spec.loader.exec_module(serving)


def test_prompts_have_exactly_the_asked_token_count(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir(tmp_path_factory)))
    prompts = serving.make_prompts(tok, 5, 64, seed=3)
    assert [len(p) for p in prompts] == [64] * 5 and len({tuple(p) for p in prompts}) == 5
    assert prompts == serving.make_prompts(tok, 5, 64, seed=3)  # the same requests for both paths


def _records(step: float, first: float, tokens: int, count: int) -> list:
    return [serving.Record(start=0.0, end=first + step * (tokens - 1),
                           chunk_times=[first + step * i for i in range(tokens)], tokens=tokens)
            for _ in range(count)]


def test_summary_and_checks() -> None:
    engine = serving.summarize(_records(0.100, 0.300, 10, 4), wall=1.2)
    http = serving.summarize(_records(0.125, 0.340, 10, 4), wall=1.5)
    assert engine["output_tokens_per_s"] == pytest.approx(40 / 1.2)
    assert engine["itl_p50"] == pytest.approx(0.100) and http["ttft_p50"] == pytest.approx(0.340)
    for s in (engine, http):
        s["cpu_ms_per_token"] = 5.0
    c = serving.checks(1, engine, http)
    assert c["throughput_ratio"] == pytest.approx(0.8) and not c["throughput_ok"]
    assert c["itl_ratio"] == pytest.approx(1.25) and c["itl_ok"]
    assert c["ttft_extra_ms"] == pytest.approx(40) and c["ttft_ok"]
    assert c["same_token_counts"] and "ttft_ok" not in serving.checks(32, engine, http)


def test_cpu_of_a_process_tree() -> None:
    before = serving.tree_cpu(os.getpid())
    sum(i * i for i in range(2_000_000))
    used = serving.cpu_used(before, serving.tree_cpu(os.getpid()))
    assert sum(used.values()) > 0


def test_engine_share_and_the_rounds_summary() -> None:
    share = serving._engine_share((10, 2.0), (110, 11.0), wall=10.0)  # 100 steps, 9 s busy in 10 s
    assert share == {"steps": 100, "step_ms": pytest.approx(90.0), "busy_share": pytest.approx(0.9)}
    assert serving._engine_share(None, (110, 11.0), wall=10.0)["steps"] is None  # the server has no counters
    line = serving.level_summary(32, [{"throughput_ratio": 0.8, "itl_ratio": 1.2},
                                      {"throughput_ratio": 1.0, "itl_ratio": None}])
    assert "mean 0.90 (min 0.80, max 1.00)" in line and "ITL p50 http/engine mean 1.20" in line


def test_the_engine_teams_preemptions() -> None:
    before = {(1, 10): (5.0, 100), (1, 11): (4.0, 50), (1, 12): (0.1, 900)}
    after = {(1, 10): (15.0, 300), (1, 11): (13.0, 150), (1, 12): (0.3, 5900), (1, 13): (0.1, 7)}
    # The two threads that used the most CPU (10 and 9 s): 200 and 100 preemptions in 10 s.
    assert serving.team_preemptions(before, after, wall=10.0, threads=2) == 15.0
    assert serving.team_preemptions(before, after, wall=10.0, threads=1) == 20.0
    assert serving.team_preemptions({}, {}, wall=10.0, threads=2) is None
    # This process's threads, from /proc: the busy one is found and its counters never go down.
    stats0 = serving.thread_stats([os.getpid()])
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    stats1 = serving.thread_stats([os.getpid()])
    assert (os.getpid(), threading.get_native_id()) in stats1
    mine = stats1[(os.getpid(), threading.get_native_id())]
    assert mine[0] - stats0[(os.getpid(), threading.get_native_id())][0] >= 0.2
    assert all(after_[1] >= stats0[k][1] for k, after_ in stats1.items() if k in stats0)
    # Preemptions only: a thread that sleeps 60 times gives its CPU up 60 times and is hardly preempted.
    # It stays (waiting) while it is read: a finished thread leaves /proc.
    done = threading.Event()

    def sleeper() -> None:
        for _ in range(60):
            time.sleep(0.001)
        done.wait(10)

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.5)
    preempted = serving.thread_stats([os.getpid()])[(os.getpid(), thread.native_id)][1]
    done.set()
    thread.join()
    assert preempted < 30
