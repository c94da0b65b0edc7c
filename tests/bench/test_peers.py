"""`bench/peers.py` (issue 28) without vLLM: the workloads, the greedy agreement, the report's medians
and ratios, the choice of vLLM settings and the skip of a missing peer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
peers = importlib.util.module_from_spec(_spec)
sys.modules["bench_peers"] = peers
_spec.loader.exec_module(peers)
common = peers.common  # bench/common.py, as peers.py imports it

ALLOWED = list(range(10, 500))


@pytest.mark.parametrize(("name", "count", "prompt_range", "output_range"), [
    ("mixed", 64, (16, 256), (8, 128)),
    ("decode", 128, (16, 16), (128, 128)),
    ("long", 16, (2000, 2000), (64, 64)),
    ("shared", 64, (512 + 16, 512 + 128), (16, 64)),
])
def test_workload_shapes(name: str, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> None:
    work = common.make_workload(name, ALLOWED, None, seed=0)
    assert work.name == name and len(work.prompts) == len(work.lengths) == count
    assert all(prompt_range[0] <= len(p) <= prompt_range[1] for p in work.prompts)
    assert all(output_range[0] <= n <= output_range[1] for n in work.lengths)
    assert {t for p in work.prompts for t in p} <= set(ALLOWED)
    again = common.make_workload(name, ALLOWED, None, seed=0)
    assert (again.prompts, again.lengths) == (work.prompts, work.lengths)  # every engine gets the same requests
    assert common.make_workload(name, ALLOWED, None, seed=1).prompts != work.prompts
    assert len(common.make_workload(name, ALLOWED, 3, seed=0).prompts) == 3


def test_shared_workload_shares_exactly_its_system_prompt() -> None:
    work = common.make_workload("shared", ALLOWED, 8, seed=0)
    system = work.prompts[0][: common.SHARED_PREFIX_TOKENS]
    assert all(p[: common.SHARED_PREFIX_TOKENS] == system for p in work.prompts)
    assert len({tuple(p[common.SHARED_PREFIX_TOKENS :]) for p in work.prompts}) == 8


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        common.make_workload("nope", ALLOWED, None, seed=0)


def test_agreement_counts_first_tokens_and_common_prefixes() -> None:
    a = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6], [7, 8, 9]]
    b = [[1, 2, 3, 4], [1, 2, 9, 9], [5, 6], [0, 8, 9]]
    got = common.agreement(a, b, first=2)
    assert got == {"requests": 4, "first": 2, "agree_first": 3, "identical": 2, "mean_common_prefix": (4 + 2 + 2) / 4}
    assert common.agreement(a, b, first=3)["agree_first"] == 2
    assert common.mismatches(a, b) == [(1, 2), (3, 0)]


def _offline(engine: str, rnd: int, rates: dict[str, float], tokens: list[list[int]]) -> dict:
    runs = [{"workload": w, "tokens_per_s": r, "tokens": tokens} for w, r in rates.items()]
    return {"engine": engine, "dtype": "bfloat16", "round": rnd, "runs": runs}


def test_offline_summary_medians_ratios_and_agreement() -> None:
    results = [
        _offline("cbserve", 0, {"mixed": 300.0, "decode": 100.0}, [[1, 2, 3]]),
        _offline("vllm", 0, {"mixed": 200.0, "decode": 50.0}, [[1, 2, 4]]),
        _offline("cbserve", 1, {"mixed": 330.0, "decode": 90.0}, [[9, 9, 9]]),
        _offline("vllm", 1, {"mixed": 100.0, "decode": 70.0}, [[9, 9, 9]]),
        _offline("cbserve", 2, {"mixed": 270.0, "decode": 80.0}, [[9, 9, 9]]),
        _offline("vllm", 2, {"mixed": 220.0, "decode": 60.0}, [[9, 9, 9]]),
    ]
    rows = {r["workload"]: r for r in peers.offline_summary(results, agree_first=2)}
    assert rows["mixed"]["rates"]["cbserve"] == [300.0, 330.0, 270.0]
    assert rows["mixed"]["median"] == {"cbserve": 300.0, "vllm": 200.0}
    assert rows["mixed"]["ratio_to_vllm"] == {"cbserve": pytest.approx(1.5)}
    assert rows["decode"]["ratio_to_vllm"]["cbserve"] == pytest.approx(90.0 / 60.0)
    agree = rows["mixed"]["agreement"]  # the first rounds' tokens: [1, 2, 3] vs [1, 2, 4]
    assert agree["agree_first"] == 1 and agree["identical"] == 0 and agree["mean_common_prefix"] == 2
    text = peers.format_offline(list(rows.values()))
    assert "1.50x" in text and "1/1 agree on their first 2 tokens" in text


def test_offline_summary_without_the_peer_has_no_ratio() -> None:
    rows = peers.offline_summary([_offline("cbserve", 0, {"mixed": 300.0}, [[1]])], agree_first=4)
    assert rows[0]["ratio_to_vllm"] == {"cbserve": None} and rows[0]["agreement"] is None
    assert "-" in peers.format_offline(rows)


def _served(engine: str, tok_s: float, itl: float, ttft: float | None, ready: float, first: float | None) -> dict:
    level = {"clients": 1, "output_tokens_per_s": tok_s, "ttft_p50": ttft, "ttft_p90": ttft, "itl_p50": itl,
             "itl_p90": itl}
    return {"engine": engine, "dtype": "float32", "ready_s": ready, "first_token_s": first, "levels": [level]}


def test_served_and_startup_summaries() -> None:
    results = [_served("cbserve", 40.0, 0.020, 0.10, 30.0, 31.0), _served("vllm", 50.0, 0.025, 0.20, 100.0, 101.0),
               _served("cbserve", 60.0, 0.030, None, 50.0, None), _served("vllm", 30.0, 0.015, 0.40, 120.0, 122.0)]
    (row,) = peers.served_summary(results)
    assert row["median"]["cbserve"]["output_tokens_per_s"] == 50.0 and row["median"]["vllm"]["itl_p50"] == 0.020
    assert row["median"]["cbserve"]["ttft_p50"] == 0.10  # a round without a TTFT is left out, not counted as 0
    assert row["ratio_to_vllm"]["output_tokens_per_s"] == pytest.approx(50.0 / 40.0)
    assert row["ratio_to_vllm"]["itl_p50"] == pytest.approx(0.025 / 0.020)
    assert row["ratio_to_vllm"]["ttft_p50"] == pytest.approx(0.10 / 0.30)
    startup = {r["engine"]: r for r in peers.startup_summary(results)}
    assert startup["cbserve"]["ready_s"] == 40.0 and startup["cbserve"]["first_token_s"] == 31.0
    assert startup["vllm"]["first_token_s"] == pytest.approx(111.5)
    assert "cbserve/vLLM: out tok/s 1.25x" in peers.format_served([row])


def test_vllm_candidates_and_the_fastest() -> None:
    bare = peers.vllm_candidates(4, None, None)
    assert set(bare) == {"defaults", "all-cores", "nobind"}
    assert all(env["VLLM_CPU_KVCACHE_SPACE"] == "4" for env in bare.values())
    assert bare["all-cores"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "LD_PRELOAD" not in bare["all-cores"]
    full = peers.vllm_candidates(2, "/lib/libtcmalloc_minimal.so.4", "/v/lib/libiomp5.so")
    assert full["all-cores+tcmalloc+iomp"]["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so"
    assert peers.pick_fastest({"defaults": 100.0, "all-cores": 150.0, "nobind": None}) == "all-cores"
    with pytest.raises(RuntimeError, match="every vLLM settings candidate failed"):
        peers.pick_fastest({"defaults": None})


def test_served_summary_compares_the_gguf_app_with_llamacpp_on_the_same_file() -> None:
    results = [_served("cbserve_gguf", 90.0, 0.020, 0.10, 30.0, 31.0), _served("llamacpp", 60.0, 0.040, 0.05, 2.0, 2.1)]
    (row,) = peers.served_summary(results)
    assert row["gguf_to_llamacpp"]["output_tokens_per_s"] == pytest.approx(1.5)
    assert row["gguf_to_llamacpp"]["itl_p50"] == pytest.approx(0.5)
    text = peers.format_served([row])
    assert "cbserve_gguf/llama.cpp: out tok/s 1.50x" in text and "cbserve/vLLM" not in text


def test_a_missing_llama_server_is_skipped_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = peers.parse_args(["--engines", "cbserve_gguf,llamacpp",
                             "--llama-server", str(tmp_path / "llama-server"),
                             "--llamacpp-python", str(tmp_path / "bin" / "python")])
    assert peers.plan_engines(args, None) == (["cbserve_gguf"], ["cbserve_gguf"])
    out = capsys.readouterr().out
    assert "SKIPPING llama.cpp's server" in out and "SKIPPING llama.cpp:" in out


def test_missing_peer_is_skipped_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    version, missing = peers.peer_status(tmp_path / "no-venv" / "bin" / "python")
    assert version is None and "make peers" in missing
    args = peers.parse_args(["--engines", "cbserve,vllm,cbserve_sized"])
    offline, served = peers.plan_engines(args, missing)
    assert offline == ["cbserve", "cbserve_sized"] and served == ["cbserve"]
    assert "SKIPPING vLLM" in capsys.readouterr().out
    assert peers.plan_engines(args, None) == (["cbserve", "vllm", "cbserve_sized"], ["cbserve", "vllm"])


def test_a_report_without_a_vllm_run_prints(capsys: pytest.CaptureFixture) -> None:
    """cbserve against its sized engine alone: vLLM installed but not run (no tuning, no settings)."""
    peers.print_report({"vllm": {"version": "0.32.0", "missing": None, "settings": {}}})
    assert "vLLM: not among the engines run" in capsys.readouterr().out


def test_a_python_without_vllm_is_a_missing_peer() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    version, missing = peers.peer_status(Path(sys.executable))
    assert version is None and "`import vllm` failed" in missing


def test_arguments_are_checked() -> None:
    args = peers.parse_args(["--vllm-env", "A=1", "--vllm-env", "B=x=y", "--clients", "1,32"])
    assert args.vllm_env == {"A": "1", "B": "x=y"} and args.clients == [1, 32]
    for bad in (["--mode", "online"], ["--dtypes", "float16"], ["--workloads", "huge"], ["--vllm-env", "A"],
                ["--engines", "sglang"], ["--repeat", "0"], ["--clients", "0"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_requests_ask_servers_to_ignore_eos() -> None:
    import load  # bench/load.py (peers.py put bench/ on the path), the served path's client

    target = load.Target("t", "http://127.0.0.1:1", "m")
    spec = load.RequestSpec(0, [1, 2, 3], 8)
    assert load.request_body(target, spec, load.Sampling("completions", 0.0, ignore_eos=True))["ignore_eos"] is True
    assert "ignore_eos" not in load.request_body(target, spec, load.Sampling("completions", 0.0))


def test_named_vllm_settings_need_no_probe(tmp_path: Path) -> None:
    args = peers.parse_args(["--vllm-settings", "all-cores", "--vllm-kv-gib", "3", "--vllm-env", "X=1"])
    env, how = peers.choose_vllm_env(args, "unused-folder", tmp_path)  # no subprocess: nothing to tune
    assert how["chosen"] == "all-cores" and "probe_tokens_per_s" not in how
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "X": "1"}
    for bad in (["--vllm-settings", "fastest"], ["--tune-candidates", "defaults,bogus"]):
        with pytest.raises(SystemExit):
            peers.choose_vllm_env(peers.parse_args(bad), "unused-folder", tmp_path)
