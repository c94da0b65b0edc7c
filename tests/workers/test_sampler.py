"""The sampler alone, on fake logits (no model): greedy and seeded draws, log-probabilities and
top pairs under the distribution drawn from, and a faulted row that draws nothing while the
others draw as they would alone. Its output is the `StepResult` the scheduler takes."""

from __future__ import annotations

import pytest
import torch

from cbserve.errors import RequestFault
from cbserve.kernels import cpu_kernels
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import StepResult
from cbserve.workers.sampler import Sampler

VOCAB = 12


def request(rid: str, **sampling) -> Request:
    return Request(rid, [1, 2, 3], 8, frozenset(), SamplingParams(**sampling))


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_rows_take_the_argmax_with_its_logprob_and_top_pairs() -> None:
    x = logits(3)
    requests = [request("a"), request("b", top_logprobs=2), request("c")]
    result = Sampler(VOCAB, seed=0)(x, requests, want_logprobs=True)
    assert isinstance(result, StepResult) and result.requests == requests and result.faults == []
    assert result.tokens == x.argmax(-1).tolist()
    expected = x.log_softmax(-1)
    assert result.logprobs == [float(expected[i, t]) for i, t in enumerate(result.tokens)]
    top = expected[1].topk(2)
    assert result.top_logprobs[1] == list(zip(top.indices.tolist(), top.values.tolist()))
    assert result.top_logprobs[0] == result.top_logprobs[2] == []


def test_no_logprobs_unless_asked() -> None:
    result = Sampler(VOCAB, seed=0)(logits(2), [request("a"), request("b")], want_logprobs=False)
    assert result.logprobs is None and result.top_logprobs is None


def test_a_seeded_request_draws_the_same_whatever_shares_its_batch() -> None:
    x = logits(1, seed=3).repeat(3, 1) / 10  # flat rows: the draws differ
    alone = Sampler(VOCAB)(x[:1], [request("s", do_sample=True, seed=42)], False).tokens[0]
    sampler = Sampler(VOCAB, seed=1)
    seeded = [request(f"s{i}", do_sample=True, seed=42) for i in range(2)]
    together = sampler(x, [request("other", do_sample=True), *seeded], False).tokens
    assert together[1] == together[2] == alone
    later = [sampler(x[:1], [seeded[0]], False).tokens[0] for _ in range(20)]  # its own generator goes on
    replay_request, fresh = request("s0", do_sample=True, seed=42), Sampler(VOCAB, seed=9)
    replay = [fresh(x[:1], [replay_request], False).tokens[0] for _ in range(21)]
    assert [together[1], *later] == replay and len(set(replay)) > 1


def test_sampled_logprobs_are_under_the_processed_distribution() -> None:
    x = logits(1, seed=5)
    r = request("t", do_sample=True, temperature=0.5, top_k=3, seed=0)
    result = Sampler(VOCAB)(x, [r], want_logprobs=True)
    kept = x[0] / 0.5
    kept[kept < kept.topk(3).values[-1]] = float("-inf")
    assert result.tokens[0] in x[0].topk(3).indices.tolist()
    assert result.logprobs[0] == float(kept.log_softmax(-1)[result.tokens[0]])


def test_a_faulted_row_draws_nothing_and_the_others_draw_as_alone() -> None:
    x = logits(3, seed=7)
    blocked = request("blocked", suppress_tokens=tuple(range(VOCAB)))  # no token left to draw
    a, b = request("a", top_logprobs=1), request("b")
    result = Sampler(VOCAB)(x, [a, blocked, b], want_logprobs=True)
    [(faulted, fault)] = result.faults
    assert faulted is blocked and isinstance(fault, RequestFault) and fault.field == "suppress_tokens"
    assert result.requests == [a, b]
    alone = Sampler(VOCAB)(x[[0, 2]], [request("a", top_logprobs=1), request("b")], want_logprobs=True)
    assert (result.tokens, result.logprobs, result.top_logprobs) == (alone.tokens, alone.logprobs, alone.top_logprobs)


@pytest.mark.skipif(bool(cpu_kernels.unavailable_reason()), reason="the C++ CPU kernels are unavailable")
def test_the_greedy_kernel_picks_as_torch_and_steps_aside_for_sampled_rows() -> None:
    x = logits(4) * 3
    kernel = Sampler(VOCAB, seed=0, greedy_kernel=True)
    greedy = kernel(x, [request(str(i)) for i in range(4)], want_logprobs=True)
    assert greedy.tokens == x.argmax(-1).tolist()
    expected = x.log_softmax(-1)
    assert greedy.logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(greedy.tokens)], abs=1e-6)
    assert kernel(x, [request(str(i)) for i in range(4)], want_logprobs=False).logprobs is None
    # A step mixing rows: each row as it is drawn alone (the kernel's rows as by the kernel, a
    # sampled or top-logprobs row as by torch's path), whatever its neighbours.
    mixed = [request("a"), request("s", do_sample=True, seed=3), request("t", top_logprobs=2), request("b")]
    both = Sampler(VOCAB, seed=0, greedy_kernel=True)(x, mixed, want_logprobs=True)
    torch_rows = Sampler(VOCAB, seed=0)(x[[1, 2]], mixed[1:3], want_logprobs=True)
    kernel_rows = Sampler(VOCAB, seed=0, greedy_kernel=True)(x[[0, 3]], [mixed[0], mixed[3]], want_logprobs=True)
    assert both.tokens == [kernel_rows.tokens[0], *torch_rows.tokens, kernel_rows.tokens[1]]
    assert both.logprobs == [kernel_rows.logprobs[0], *torch_rows.logprobs, kernel_rows.logprobs[1]]
    assert both.top_logprobs == [[], *torch_rows.top_logprobs, []] and both.requests == mixed
    # Without logprobs the kernel skips its pass of exponentials: the same tokens.
    assert Sampler(VOCAB, seed=0, greedy_kernel=True)(x, mixed, want_logprobs=False).tokens == both.tokens
