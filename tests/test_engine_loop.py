"""The engine loop's lifecycle (cbserve/engine_loop.py) against a fake engine: which moves the
state table allows, and that each way through a session (drain, overdue drain, hard stop, a
broken engine, a dying thread, destroy) takes exactly its legal path, and an illegal one raises."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cbserve.engine_loop import (
    MAX_FAILED_STEPS,
    TRANSITIONS,
    EngineLoop,
    IllegalTransition,
    LoopState,
    check_transition,
)
from cbserve.outputs import FinishReason, RequestStatus
from cbserve.scheduler.request import Request

S = LoopState
TIMEOUT = 30.0


class FakeEngine:
    """What the loop asks of an engine. Each step gives every request one token (a request ends
    after `max_new_tokens`); a step waits while `gate` is cleared; the next `failing` steps raise
    `fault`."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.requests: dict[str, Request] = {}
        self.holds_model = False
        self.cache_freed = False
        self.gate = threading.Event()
        self.gate.set()
        self.stepping = threading.Event()  # set while a step waits at the gate
        self.failing = 0
        self.fault: BaseException = RuntimeError("fake kernel fault")

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def step(self) -> list[Request]:
        self.stepping.set()
        assert self.gate.wait(TIMEOUT)
        self.stepping.clear()
        if self.failing:
            self.failing -= 1
            raise self.fault
        updated = list(self.requests.values())
        for request in updated:
            request.append_token(7, None)
            if len(request.generated) >= request.max_new_tokens:
                del self.requests[request.request_id]
                request.finish(RequestStatus.FINISHED, FinishReason.LENGTH)
        return updated

    def cancel_request(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            request.finish(RequestStatus.CANCELLED, FinishReason.CANCELLED)
        return request

    def fail_request(self, request: Request, error: BaseException) -> None:
        self.requests.pop(request.request_id, None)
        request.finish(RequestStatus.FAILED, FinishReason.ERROR, error)

    def fail_all(self, error: BaseException) -> list[Request]:
        failed = list(self.requests.values())
        for request in failed:
            self.fail_request(request, error)
        return failed

    def take_model(self) -> None:
        self.holds_model = True

    def give_back_model(self) -> None:
        self.holds_model = False

    release_model = give_back_model

    def free_cache(self) -> None:
        self.cache_freed = True

    def check_health(self) -> None:
        pass


class RecordingLoop(EngineLoop):
    """Records every move it makes."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__(engine)  # type: ignore[arg-type]
        self.moves: list[LoopState] = []

    def _enter(self, state: LoopState) -> None:
        super()._enter(state)
        if not self.moves or self.moves[-1] is not state:
            self.moves.append(state)


def request(rid: str, max_new_tokens: int = 3) -> Request:
    return Request(request_id=rid, prompt_ids=[1, 2], max_new_tokens=max_new_tokens, eos_token_ids=frozenset())


def final(loop: EngineLoop, rid: str):
    out = loop.outputs.get(rid, timeout=TIMEOUT)
    assert out is not None and out.is_finished(), out
    return out


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def loop(engine: FakeEngine):
    loop = RecordingLoop(engine)
    yield loop
    engine.gate.set()
    if loop.stop(hard=True):
        loop.join(TIMEOUT)


# -- the table ----------------------------------------------------------------------------------


def reachable(start: LoopState) -> set[LoopState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_every_state_is_reachable_and_destroyed_is_the_only_end() -> None:
    assert reachable(S.IDLE) == set(S)
    for state in S:
        assert S.DESTROYED in reachable(state)
    assert [s for s in S if not TRANSITIONS[s]] == [S.DESTROYED]


def test_the_thread_ends_only_from_a_state_refusing_work() -> None:
    """A state that accepts work never moves to one without a thread: no accepted request is stranded."""
    for state in S:
        for nxt in TRANSITIONS[state]:
            if state.accepting and state.looping:
                assert nxt.looping and not nxt.accepting, (state, nxt)
    assert {s for s in S if S.STOPPED in TRANSITIONS[s]} == {S.DRAINING, S.OVERDUE, S.ABORTING}


@pytest.mark.parametrize(("old", "new"), [
    (S.IDLE, S.DRAINING), (S.IDLE, S.STOPPED), (S.RUNNING, S.STOPPED), (S.RUNNING, S.IDLE),
    (S.RUNNING, S.DESTROYED), (S.DRAINING, S.RUNNING), (S.ABORTING, S.DRAINING), (S.ABORTING, S.OVERDUE),
    (S.OVERDUE, S.DRAINING), (S.STOPPED, S.DRAINING), (S.STOPPED, S.ABORTING), (S.DESTROYED, S.RUNNING),
    (S.DESTROYED, S.IDLE),
])
def test_illegal_moves_raise(old: LoopState, new: LoopState) -> None:
    with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
        check_transition(old, new)


def test_legal_moves_and_staying_put_pass() -> None:
    for old in S:
        check_transition(old, old)
        for new in TRANSITIONS[old]:
            check_transition(old, new)


# -- sessions -----------------------------------------------------------------------------------


def test_requests_queued_before_start_run_and_a_drain_finishes_them(loop: RecordingLoop,
                                                                    engine: FakeEngine) -> None:
    assert loop.state is S.IDLE and loop.state.accepting
    loop.queue([request("a")])
    assert not engine.holds_model
    loop.start()
    assert engine.holds_model and loop.state is S.RUNNING
    assert final(loop, "a").status == RequestStatus.FINISHED
    engine.gate.clear()
    loop.queue([request("b", 5)])
    assert engine.stepping.wait(TIMEOUT)
    assert loop.stop()
    assert loop.state is S.DRAINING and not loop.state.accepting
    engine.gate.set()
    assert loop.join(TIMEOUT)
    out = final(loop, "b")
    assert out.status == RequestStatus.FINISHED and len(out.generated_tokens) == 5  # drained, not failed
    assert loop.state is S.STOPPED and not engine.holds_model and not loop.is_running()
    assert loop.moves == [S.RUNNING, S.DRAINING, S.STOPPED]
    loop.start()  # a new session
    assert loop.state is S.RUNNING and engine.holds_model
    loop.queue([request("c")])
    assert final(loop, "c").status == RequestStatus.FINISHED


def test_a_drain_past_its_timeout_is_overdue_then_a_hard_stop_fails_what_is_left(
        loop: RecordingLoop, engine: FakeEngine) -> None:
    loop.start()
    engine.gate.clear()
    loop.queue([request("slow", 50)])
    assert engine.stepping.wait(TIMEOUT)
    loop.stop()
    assert not loop.join(0.05)
    assert loop.state is S.OVERDUE
    loop.stop()  # a second graceful stop keeps it overdue
    assert loop.state is S.OVERDUE
    loop.stop(hard=True)
    assert loop.state is S.ABORTING
    engine.gate.set()
    assert loop.join(TIMEOUT)
    out = final(loop, "slow")
    assert out.status == RequestStatus.FAILED and "hard-stopped" in out.error
    assert loop.moves == [S.RUNNING, S.DRAINING, S.OVERDUE, S.ABORTING, S.STOPPED]


def test_a_hard_stop_fails_queued_and_running_work(loop: RecordingLoop, engine: FakeEngine) -> None:
    loop.start()
    engine.gate.clear()
    loop.queue([request("running", 50)])
    assert engine.stepping.wait(TIMEOUT)
    loop.queue([request("queued")])
    loop.stop(hard=True)
    engine.gate.set()
    assert loop.join(TIMEOUT)
    for rid in ("running", "queued"):
        assert final(loop, rid).status == RequestStatus.FAILED
    assert loop.moves == [S.RUNNING, S.ABORTING, S.STOPPED] and not loop.live


def test_a_broken_engine_ends_the_loop_after_max_failed_steps(loop: RecordingLoop, engine: FakeEngine) -> None:
    engine.failing = MAX_FAILED_STEPS
    loop.start()
    for i in range(MAX_FAILED_STEPS):
        assert loop.state is S.RUNNING  # a fault alone does not end it
        loop.queue([request(f"r{i}")])
        assert final(loop, f"r{i}").status == RequestStatus.FAILED
    assert loop.join(TIMEOUT)
    assert loop.moves == [S.RUNNING, S.ABORTING, S.STOPPED]
    assert loop.engine_fault is engine.fault
    assert f"failed {MAX_FAILED_STEPS} steps in a row" in str(loop.refusal())
    with pytest.raises(RuntimeError, match="not running"):
        loop.check_health()


def test_a_dying_thread_fails_everything_and_stops(loop: RecordingLoop, engine: FakeEngine) -> None:
    class Fatal(BaseException):
        pass

    engine.failing, engine.fault = 1, Fatal("the thread dies")
    loop.start()
    loop.queue([request("a")])
    out = final(loop, "a")
    assert out.status == RequestStatus.FAILED and "batching loop died" in out.error
    assert loop.join(TIMEOUT)
    assert loop.moves == [S.RUNNING, S.ABORTING, S.STOPPED] and isinstance(loop.error, Fatal)


def test_destroy_only_from_a_stopped_loop_and_for_good(loop: RecordingLoop, engine: FakeEngine) -> None:
    loop.start()
    with pytest.raises(IllegalTransition, match="from running to destroyed"):
        loop.destroy()
    assert loop.state is S.RUNNING and engine.holds_model and not engine.cache_freed  # nothing was freed
    loop.queue([request("a")])
    assert final(loop, "a").status == RequestStatus.FINISHED
    loop.stop()
    assert loop.join(TIMEOUT)
    assert loop.destroy() and engine.cache_freed and loop.state is S.DESTROYED
    assert not loop.destroy()  # twice: a no-op
    with pytest.raises(RuntimeError, match="destroyed and cannot be restarted"):
        loop.start()
    assert loop.moves == [S.RUNNING, S.DRAINING, S.STOPPED, S.DESTROYED]


def test_destroying_an_unstarted_loop_fails_what_was_queued(loop: RecordingLoop, engine: FakeEngine) -> None:
    loop.queue([request("never")])
    assert loop.destroy()
    out = final(loop, "never")
    assert out.status == RequestStatus.FAILED and "destroyed before these requests ran" in out.error
    assert loop.moves == [S.DESTROYED] and not loop.state.accepting


def test_a_pause_parks_between_steps_without_changing_the_state(loop: RecordingLoop, engine: FakeEngine) -> None:
    with pytest.raises(RuntimeError, match="no generation loop is running"), loop.pause():
        pass
    loop.start()
    loop.queue([request("long", 10**6)])
    with loop.pause():
        assert not engine.holds_model and loop.holds_pause()
        assert loop.state is S.RUNNING
        steps = len(loop.live["long"].generated)
        time.sleep(0.05)
        assert len(loop.live["long"].generated) == steps  # parked
    assert not loop.holds_pause()
    loop.cancel("long")
    assert final(loop, "long").status == RequestStatus.CANCELLED
    assert engine.holds_model and loop.moves == [S.RUNNING]


def test_start_hands_back_the_calling_threads_openmp_team_first(loop: RecordingLoop, monkeypatch) -> None:
    """Before the engine thread exists (kernels/openmp.py: one team per process, the engine's)."""
    from cbserve.kernels import openmp

    calls: list[tuple[threading.Thread, bool]] = []
    monkeypatch.setattr(openmp, "release_thread_team",
                        lambda: calls.append((threading.current_thread(), loop.is_running())) or True)
    loop.start()
    assert calls == [(threading.current_thread(), False)]


def run_one_request(loop: EngineLoop) -> None:
    """Start the loop, run one one-token request to its end, stop the loop."""
    loop.queue([request("a", 1)])
    loop.start()
    try:
        assert final(loop, "a").status == RequestStatus.FINISHED
    finally:
        loop.stop()
        loop.join(TIMEOUT)


def _threads_at_nice(nice: int) -> set[int]:
    """Native ids of this process's threads whose nice value is `nice` (/proc: Linux)."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if int(stat[stat.rindex(")") + 2:].split()[16]) == nice:
            out.add(int(tid))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_engine_nice_lowers_the_engine_thread_and_its_openmp_team_only(engine: FakeEngine) -> None:
    """`engine_nice`: the engine thread, and the OpenMP workers of its first parallel region (which
    inherit it), run at the nice value; the thread that started the loop keeps its own."""
    seen: dict[str, object] = {}
    step = engine.step

    def step_and_look() -> list[Request]:
        seen["engine"] = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        torch.ones(1 << 22).mul_(2)  # a parallel region: this thread's OpenMP team starts here
        seen["at_nice"] = _threads_at_nice(7)
        return step()

    engine.step = step_and_look  # type: ignore[method-assign]
    before = _threads_at_nice(7)
    loop = EngineLoop(engine, nice=7)  # type: ignore[arg-type]
    run_one_request(loop)
    assert seen["nice"] == 7
    workers = seen["at_nice"] - before - {seen["engine"]}  # type: ignore[operator]
    assert seen["engine"] in seen["at_nice"] and len(workers) >= min(1, torch.get_num_threads() - 1), (
        seen, torch.get_num_threads())
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0


def test_engine_nice_zero_leaves_the_engine_thread_alone(engine: FakeEngine) -> None:
    niceness: list[int] = []
    step = engine.step
    engine.step = lambda: niceness.append(os.nice(0)) or step()  # type: ignore[method-assign]
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    run_one_request(loop)
    assert niceness == [os.nice(0)]
