"""Output batching and the in-process serving path, without a Ray cluster (issue 21):

- the manager hands out every output of a request that is ready at once (`async_request_batches`),
  and a replica sends one delta for all of them (tokens, text, logprobs exact), at most one every
  `stream_interval_ms` when set;
- `colocated.LocalReplicas`: the in-process stand-in for the ingress's handle admits choices as
  Serve does (max_ongoing run, max_queued wait, the rest refused with `BackPressureError`) and
  gives a slot back however a stream ends;
- CPU budgeting (`worker.num_cpus: auto`) and where the ingress runs (`ingress_placement`).
"""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise
from typing import Any

import pytest

import cbserve
from cbserve.cluster.settings import ClusterArgs, cpus_per_rank, torch_threads, with_cpus
from cbserve.output_store import OutputStore
from cbserve.outputs import GenerationOutput, RequestStatus
from cbserve.serving.protocol import Sampling, WorkerEvent, WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, merge_outputs, run_request
from tests.support.cluster import running_manager, tiny_model_dir


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return cbserve.load_model(str(tiny_model_dir(tmp_path_factory)), dtype="float32")


@pytest.fixture(scope="module")
def manager(loaded: tuple[Any, Any]) -> Any:
    with running_manager(loaded[0]) as mgr:
        yield mgr


@pytest.fixture(scope="module")
def info(loaded: tuple[Any, Any]) -> ModelInfo:
    return ModelInfo(eos_token_id=None, max_context=512, default_max_tokens=16)  # no EOS: max_tokens each


def _greedy(mgr: Any, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    rid = mgr.add_request(ids, max_new_tokens=n, temperature=0.0, eos_token_id=None)
    out = None
    for out in mgr.request_id_iter(rid):
        pass
    return list(out.generated_tokens), list(out.logprobs)


# ---- the manager and its output store ---------------------------------------------------------


def _output(rid: str, n: int, final: bool = False) -> GenerationOutput:
    return GenerationOutput(rid, [1], RequestStatus.FINISHED if final else RequestStatus.DECODING,
                            new_tokens=[n], _tokens=list(range(n + 1)), _length=n + 1)


def test_output_store_hands_out_every_ready_output_at_once() -> None:
    async def scenario() -> list[list[int]]:
        store = OutputStore()
        for n in range(3):
            store.put(_output("a", n))
        first = await store.get_all_async("a", timeout=1)
        store.put(_output("a", 3))
        store.put(_output("a", 4, final=True))
        one = await store.get_all_async("a", timeout=1, limit=1)
        rest = await store.get_all_async("a", timeout=1)
        empty = await store.get_all_async("a", timeout=0.05)
        return [[o.new_tokens[0] for o in batch] for batch in (first, one, rest, empty)]

    assert asyncio.run(scenario()) == [[0, 1, 2], [3], [4], []]


def test_a_lagging_consumer_gets_the_missed_steps_in_one_batch(manager: Any, loaded: tuple[Any, Any]) -> None:
    ids = loaded[1]("hello world the sea").input_ids
    expected, _ = _greedy(manager, ids, 24)

    async def scenario() -> list[list[Any]]:
        rid = manager.add_request(ids, max_new_tokens=24, streaming=True, temperature=0.0, eos_token_id=None)
        batches = []
        async for batch in manager.async_request_batches(rid):
            batches.append(batch)
            await asyncio.sleep(0.05)  # several engine steps of the tiny model
        return batches

    batches = asyncio.run(scenario())
    assert [t for batch in batches for out in batch for t in out.new_tokens] == expected
    assert max(len(b) for b in batches) > 1, "the consumer never lagged: the test proves nothing"
    assert all(not o.is_finished() for b in batches for o in b[:-1]) and batches[-1][-1].is_finished()
    merged = merge_outputs(batches[1])
    assert merged.new_tokens == [t for o in batches[1] for t in o.new_tokens]
    assert merged.new_logprobs == batches[1][-1].logprobs[-len(merged.new_tokens):]


# ---- one delta per ready batch ----------------------------------------------------------------


async def _deltas(mgr: Any, tok: Any, info: ModelInfo, req: WorkerRequest, lag_s: float = 0.0,
                  interval_s: float = 0.0) -> list[tuple[float, WorkerEvent]]:
    out = []
    async for ev in run_request(mgr, tok, info, req, "local", interval_s):
        out.append((time.monotonic(), ev))
        await asyncio.sleep(lag_s)
    return out


def test_a_slow_consumer_gets_fewer_deltas_with_the_same_tokens_text_and_logprobs(
        manager: Any, loaded: tuple[Any, Any], info: ModelInfo) -> None:
    tok = loaded[1]
    ids = tok("one two three café").input_ids
    expected, logprobs = _greedy(manager, ids, 40)
    req = WorkerRequest(request_id="b-slow", prompt_ids=ids, max_tokens=40, sampling=Sampling(temperature=0.0), logprobs=True)
    events = [ev for _, ev in asyncio.run(_deltas(manager, tok, info, req, lag_s=0.05))]
    deltas = [ev for ev in events if ev.kind == "delta"]
    assert events[0].kind == "start" and events[-1].kind == "end" and events[-1].completion_tokens == len(expected)
    assert [t for ev in deltas for t in ev.token_ids] == expected
    assert "".join(ev.text for ev in deltas) == tok.decode(expected, skip_special_tokens=True)
    assert [lp for ev in deltas for lp in ev.logprobs] == pytest.approx(logprobs)
    assert [t for ev in deltas for t in ev.token_texts] == [tok.decode([t]) for t in expected]
    assert len(deltas) < 40 and max(len(ev.token_ids) for ev in deltas) > 1


def test_stream_interval_paces_the_deltas(manager: Any, loaded: tuple[Any, Any], info: ModelInfo) -> None:
    tok = loaded[1]
    ids = tok("hello world").input_ids
    expected, _ = _greedy(manager, ids, 60)
    req = WorkerRequest(request_id="b-paced", prompt_ids=ids, max_tokens=60, sampling=Sampling(temperature=0.0))
    timed = asyncio.run(_deltas(manager, tok, info, req, interval_s=0.1))
    deltas = [(t, ev) for t, ev in timed if ev.kind == "delta"]
    assert [t for _, ev in deltas for t in ev.token_ids] == expected
    gaps = [b - a for (a, _), (b, _) in pairwise(deltas)]
    assert gaps and min(gaps) >= 0.09, gaps
    assert len(deltas) < len(expected)


# ---- the ingress inside the worker: admission like Serve's ------------------------------------


class _FakeEngine:
    """An engine replica whose streams run until told to end."""

    def __init__(self) -> None:
        self.manager = self
        self.cancelled: list[str] = []
        self.release = asyncio.Event()

    def cancel_request(self, rid: str) -> None:
        self.cancelled.append(rid)
        self.release.set()

    async def generate(self, req: WorkerRequest) -> Any:
        yield WorkerEvent(kind="start", replica="r")
        await self.release.wait()
        yield WorkerEvent(kind="end", finish_reason="length")

    def stats(self) -> dict[str, int]:
        return {"running": 0}


def test_local_replicas_admit_queue_refuse_and_give_slots_back() -> None:
    from ray.serve.exceptions import BackPressureError

    from cbserve.cluster.colocated import LocalReplicas

    async def scenario() -> None:
        engine = _FakeEngine()
        args = ClusterArgs(worker={"max_ongoing_requests": 1, "max_queued_requests": 1, "retry_after_s": 3})
        replicas = LocalReplicas(engine, args.worker)  # type: ignore[arg-type]
        generate = replicas.options(stream=True, method_name="generate")
        running = generate.remote(WorkerRequest(request_id="a", prompt="x"))
        assert (await running.__anext__()).kind == "start"
        queued = generate.remote(WorkerRequest(request_id="b", prompt="x"))
        waiting = asyncio.ensure_future(queued.__anext__())
        await asyncio.sleep(0.05)
        assert not waiting.done() and replicas.admission.waiting == 1
        with pytest.raises(BackPressureError) as refused:
            generate.remote(WorkerRequest(request_id="c", prompt="x"))
        assert refused.value.status_code == 503 and refused.value.retry_after_s == 3
        assert await replicas.stats.remote() == {"running": 0}  # other methods are never held back
        running.cancel()  # the client went away: its request is cancelled, its slot given back
        assert engine.cancelled == ["a"]
        assert (await asyncio.wait_for(waiting, 5)).kind == "start"
        assert [ev.kind async for ev in queued] == ["end"]
        third = generate.remote(WorkerRequest(request_id="d", prompt="x"))  # both slots free again
        assert (await third.__anext__()).kind == "start"

    asyncio.run(scenario())


# ---- CPU budget and where the ingress runs ----------------------------------------------------


def test_auto_cpus_give_the_model_every_core_but_the_reserve() -> None:
    args = ClusterArgs()
    assert args.worker.num_cpus == "auto" and args.worker.reserved_cpus == 0.5
    assert cpus_per_rank(args, node_cpus=2) == 1.5 and torch_threads(args, node_cpus=2) == 2
    assert cpus_per_rank(args, node_cpus=16) == 15.5 and torch_threads(args, node_cpus=16) == 16
    assert cpus_per_rank(args, node_cpus=1) == 1.0  # never below one CPU
    tp = ClusterArgs(tp_size=2)
    assert cpus_per_rank(tp, node_cpus=8) == 3.75 and torch_threads(tp, node_cpus=8) == 4
    gpu = ClusterArgs(worker={"num_gpus": 1})
    assert cpus_per_rank(gpu, node_cpus=64) == 1.0  # GPU nodes as before
    fixed = ClusterArgs(worker={"num_cpus": 3})
    assert with_cpus(fixed, 64) is fixed and torch_threads(fixed) == 3
    assert with_cpus(args, 4).worker.num_cpus == 3.5


def test_the_ingress_runs_inside_a_single_worker_replica() -> None:
    from cbserve.cluster.app import DEFAULT_ROUTER_CLASS, colocated_options

    assert ClusterArgs().ingress_in_worker
    assert ClusterArgs(worker={"autoscaling": {"min_replicas": 1, "max_replicas": 1}}).ingress_in_worker
    assert not ClusterArgs(worker={"num_replicas": 2}).ingress_in_worker  # prefix routing needs its own
    assert not ClusterArgs(worker={"autoscaling": {"min_replicas": 1, "max_replicas": 3}}).ingress_in_worker
    assert not ClusterArgs(ingress_replicas=2).ingress_in_worker
    assert not ClusterArgs(ingress_placement="own").ingress_in_worker
    assert ClusterArgs(worker={"num_replicas": 2}, ingress_placement="worker").ingress_in_worker
    opts = colocated_options(ClusterArgs(worker={"max_ongoing_requests": 8, "max_queued_requests": 4}))
    assert opts["name"] == "LLMWorker" and opts["max_ongoing_requests"] > 8 + 4 and opts["max_queued_requests"] == -1
    assert opts["request_router_config"].request_router_class == DEFAULT_ROUTER_CLASS
