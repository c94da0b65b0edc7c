"""Speculative decoding (n-gram prompt lookup): greedy tokens and logprobs equal `generate()`'s
on tiny float64 models of each family, with proposals accepted and rejected; sampled tokens keep
the target distribution (the rejection rule, by enumeration and by draws); the scheduler's
budget, limits, opt-outs and counters; the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.config import SpeculativeConfig
from cbserve.errors import InvalidRequestError
from cbserve.kernels.quantized import QUANTIZED_AS
from cbserve.scheduler.ngram import NgramProposer
from cbserve.scheduler.request import SamplingParams
from cbserve.workers import speculative
from cbserve.workers.factory import build_engine
from tests.support.exactness import model_for, run_engine
from tests.support.tiny_models import random_prompts, reference_generate

MAX_NEW = 32
SPEC = {"num_speculative_tokens": 4, "disable_by_batch_size": None}  # 8 prompts decode at once


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (the proposer finds n-grams in them), and two that do not."""
    prompts = []
    for seed in (4, 7):  # seeds whose greedy outputs, on every family, repeat n-grams (proposals accepted)
        for n in (5, 12, 30):
            seg = random_prompts([n], seed=seed)[0]
            prompts.append(seg + seg[: n // 2] + seg)
    return prompts + random_prompts([3, 17], seed=9)


def _reference(arch: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [reference_generate(model_for(arch), p, MAX_NEW) for p in prompts]


def _assert_equal(requests, refs) -> None:
    for request, (tokens, logprobs) in zip(requests, refs):
        assert request.generated == tokens, request.request_id
        assert request.logprobs == pytest.approx(logprobs, abs=1e-6), request.request_id


# ---- greedy: exact -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2"])
def test_greedy_speculation_equals_generate(arch: str) -> None:
    prompts = _repetitive_prompts()
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, max_batch_tokens=128, return_logprobs=True,
                                           speculative=SPEC)
    requests, engine = run_engine(model_for(arch), prompts, cfg, max_new=MAX_NEW)
    _assert_equal(requests, _reference(arch, prompts))
    s = engine.scheduler
    # Proposals were made, some accepted and (but on the tiny Gemma 2, which loops on one token
    # whatever its prompt) some rejected: both paths of verification ran.
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens, (s.num_accepted_tokens, s.num_draft_tokens)
    assert arch == "gemma2" or s.num_accepted_tokens < s.num_draft_tokens
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert s.num_generated_tokens == MAX_NEW * len(prompts)


@pytest.mark.parametrize("offload", [0.0, 0.002])
def test_speculation_with_preemption_chunked_prefill_and_prefix_hits(offload: float) -> None:
    """A cache too small for every request (preemption and recompute, or with CPU offload the
    evicted pages kept in host memory and restored), a budget that chunks the prompts, pages of 4
    tokens, and prompts sharing a prefix (prefix-cache hits)."""
    base = _repetitive_prompts()
    prompts = base + [base[2][:40] + p for p in random_prompts([6, 9], seed=5)]
    cfg = cbserve.ContinuousBatchingConfig(page_size=4, num_blocks=70, max_batch_tokens=24, return_logprobs=True,
                                           speculative=SPEC, cpu_offload_space=offload)
    requests, engine = run_engine(model_for("llama"), prompts, cfg, max_new=MAX_NEW)
    _assert_equal(requests, _reference("llama", prompts))
    s = engine.scheduler
    assert s.num_preemptions > 0 and s.prefix_hit_tokens > 0 and s.num_accepted_tokens > 0
    assert (s.host_pages is not None and s.host_pages.num_restores > 0) == (offload > 0)


def test_accepting_every_proposal_is_caught(monkeypatch) -> None:
    """The comparison can fail: a verifier that accepts every proposal changes the output."""
    def credulous(rows, draft, params, generator, draft_probs=None):
        return list(draft) + [int(rows[len(draft)].argmax())], rows

    monkeypatch.setattr(speculative, "accept", credulous)
    prompts = _repetitive_prompts()
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, return_logprobs=True, speculative=SPEC)
    requests, _ = run_engine(model_for("llama"), prompts, cfg, max_new=MAX_NEW)
    with pytest.raises(AssertionError):
        _assert_equal(requests, _reference("llama", prompts))


def test_eos_inside_accepted_proposals_ends_the_request() -> None:
    """A request whose accepted proposals include EOS ends there: the tokens after it are dropped."""
    prompts = _repetitive_prompts()
    refs = _reference("llama", prompts)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, return_logprobs=True, speculative=SPEC)
    # Ungated: find a request whose speculation accepted tokens, and make its 6th greedy token EOS.
    eos = refs[5][0][5]
    requests, _ = run_engine(model_for("llama"), prompts, cfg, max_new=MAX_NEW, eos_token_id=eos)
    for request, (tokens, _) in zip(requests, refs):
        expected = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        assert request.generated == expected, request.request_id


# ---- sampled: the target distribution ----------------------------------------------------------


def _target(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from cbserve.workers.sampler import process_logits

    return process_logits(rows, [params] * rows.shape[0]).softmax(dim=-1)


@pytest.mark.parametrize("params", [SamplingParams(do_sample=True, temperature=0.8),
                                    SamplingParams(do_sample=True, temperature=1.3, top_k=4, top_p=0.9)])
def test_rejection_rule_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Draws of (first, second) token with a 2-token proposal match the target's joint
    distribution p0(x) * p1(y | x = proposal) (chi-square over the cells)."""
    torch.manual_seed(0)
    vocab, draft = 6, [2, 4]
    rows = torch.randn(3, vocab, dtype=torch.float64) * 1.5
    p = _target(rows, params)
    g = torch.Generator().manual_seed(1)
    n = 20000
    counts: dict[tuple[int, int | None], int] = {}
    for _ in range(n):
        tokens, _ = speculative.accept(rows, draft, params, g)
        key = (tokens[0], tokens[1] if tokens[0] == draft[0] else None)
        counts[key] = counts.get(key, 0) + 1
    expected = {}
    for x in range(vocab):
        if x == draft[0]:
            for y in range(vocab):
                expected[(x, y)] = n * float(p[0, x] * p[1, y])
        else:
            expected[(x, None)] = n * float(p[0, x])
    assert set(counts) <= {k for k, e in expected.items() if e > 0}  # nothing outside the support
    cells = [(counts.get(k, 0), e) for k, e in expected.items() if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)  # ~5 sigma: fails only when biased


def _chi2_ok(counts: list[int], probs: list[float]) -> bool:
    """Counts drawn from `probs` (chi-square over the cells with mass, within ~5 sigma)."""
    n = sum(counts)
    cells = [(o, n * p) for o, p in zip(counts, probs) if p > 0]
    if any(o for o, p in zip(counts, probs) if p == 0):
        return False  # a draw outside the support
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return chi2 < dof + 5 * math.sqrt(2 * dof)


def test_rejection_rule_with_draft_distributions_keeps_the_target_distribution() -> None:
    """Proposals drawn from a draft's q (not a point mass): accepted with min(1, p / q), else a
    draw from max(0, p - q); the first token is distributed as p0 and, after an accepted
    proposal, the next as p1. With q = p every proposal is accepted."""
    torch.manual_seed(0)
    params = SamplingParams(do_sample=True, temperature=0.9)
    vocab = 6
    rows = torch.randn(3, vocab, dtype=torch.float64) * 1.5
    p = _target(rows, params)
    q = torch.softmax(torch.randn(2, vocab, dtype=torch.float64), dim=-1)
    g, proposals = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    first, second, accepted, n = [0] * vocab, [0] * vocab, 0, 20000
    for _ in range(n):
        draft = [int(torch.multinomial(q[i], 1, generator=proposals)) for i in range(2)]
        tokens, _ = speculative.accept(rows, draft, params, g, q)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:  # accepted (a rejection never redraws d: p(d) < q(d) there)
            accepted += 1
            second[tokens[1]] += 1
    assert _chi2_ok(first, p[0].tolist()) and _chi2_ok(second, p[1].tolist())
    expected_rate = float(torch.minimum(p[0], q[0]).sum())  # P(accept) = sum_d min(p(d), q(d))
    assert abs(accepted / n - expected_rate) < 5 * math.sqrt(expected_rate * (1 - expected_rate) / n)
    same = p[:2].clone()
    for _ in range(200):
        draft = [int(torch.multinomial(same[i], 1, generator=proposals)) for i in range(2)]
        assert speculative.accept(rows, draft, params, g, same)[0][:2] == draft


def test_greedy_acceptance_rule() -> None:
    rows = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams()
    assert speculative.accept(rows, [1, 0], greedy, torch.Generator())[0] == [1, 0, 2]  # all accepted, one more
    assert speculative.accept(rows, [1, 2], greedy, torch.Generator())[0] == [1, 0]  # second rejected
    assert speculative.accept(rows, [2, 0], greedy, torch.Generator())[0] == [1]  # first rejected


def test_sampled_logprobs_are_the_target_models() -> None:
    """A seeded sampled request that speculated: each reported logprob is the token's under the
    temperature-scaled distribution of the model's own forward pass over prompt + output (the
    tiny Gemma 2: its outputs loop, so proposals are accepted even when sampling)."""
    model = model_for("gemma2")
    prompt = _repetitive_prompts()[5]
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, return_logprobs=True, speculative=SPEC)
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, temperature=0.5, eos_token_id=None)
    engine = build_engine(model, gc, cfg)
    try:
        request = engine.make_request(prompt, "r", sampling=SamplingParams(do_sample=True, temperature=0.5, seed=3))
        engine.add_request(request)
        while engine.has_work:
            engine.step()
        assert engine.scheduler.num_accepted_tokens > 0
    finally:
        engine.release_model()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + request.generated])).logits[0, len(prompt) - 1 : -1]
    # The engine samples from float32 logits (`ModelRunner`), as vLLM does: so does the reference.
    # Its log-softmax sums the vocabulary in another order than torch's: float32 rounding differs
    # by up to ~1e-6 (8 ulps seen on an AVX2 EPYC); a logprob of another distribution is off by > 1e-2.
    expected = (logits.float() / 0.5).log_softmax(-1).gather(1, torch.tensor(request.generated)[:, None]).squeeze(1)
    assert request.logprobs == pytest.approx(expected.tolist(), abs=1e-5)


# ---- the proposer and the scheduler -----------------------------------------------------------


def test_ngram_proposer() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    assert proposer.lookup([1, 2, 3, 4, 5, 9, 2, 3, 4], 10) == [5, 9, 2]  # the 3-gram "2 3 4"
    assert proposer.lookup([1, 2, 3, 4, 5, 9, 2, 3, 4], 2) == [5, 9]  # the limit (max_new_tokens)
    assert proposer.lookup([7, 8, 1, 7, 8, 2, 7, 8], 10) == [2, 7, 8]  # the latest occurrence
    assert proposer.lookup([1, 2, 3, 4], 10) == []  # nothing recurs
    assert proposer.lookup([5] * 8, 10) == [5, 5, 5]  # a loop: the latest occurrence followed by k tokens
    assert proposer.lookup([5] * 5, 10) == [5, 5]  # none followed by k: the longest continuation
    assert proposer.lookup([1, 2, 1, 2], 0) == []


def _engine(cfg: cbserve.ContinuousBatchingConfig, max_new: int = MAX_NEW, arch: str = "llama"):
    return build_engine(model_for(arch), GenerationConfig(max_new_tokens=max_new, do_sample=False,
                                                             eos_token_id=None), cfg)


def test_no_proposals_past_max_new_tokens_and_within_the_budget() -> None:
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, max_batch_tokens=6,
                                           speculative={"num_speculative_tokens": 8})
    engine = _engine(cfg, max_new=7, arch="gemma2")  # its outputs loop: proposals accepted
    try:
        requests = [engine.make_request(p, f"r{i}") for i, p in enumerate(_repetitive_prompts()[4:6])]
        for r in requests:
            engine.add_request(r)
        while engine.has_work:
            plan_tokens = []
            original = engine.runner.prepare

            def spy(batch, in_flight=None, original=original, plan_tokens=plan_tokens):
                plan_tokens.append(sum(s.num_query_tokens for s in batch))
                for s in batch:
                    assert len(s.request.generated) + len(s.draft) < s.request.max_new_tokens
                    if s.request.generated:  # accepted proposals count as computed: one token to run, and the draft
                        assert s.num_query_tokens == 1 + len(s.draft)
                return original(batch, in_flight)

            engine.runner.prepare = spy
            engine.step()
            engine.runner.prepare = original
            assert all(t <= 6 for t in plan_tokens)
        assert all(len(r.generated) == 7 for r in requests)
        assert engine.scheduler.num_accepted_tokens > 0
    finally:
        engine.release_model()


class _RecordingProposer:
    """Proposes `limit` copies of the request's last token, recording each limit it is given."""

    def __init__(self) -> None:
        self.limits: list[int] = []

    def propose(self, requests, limits: list[int]) -> list[list[int]]:
        self.limits.extend(limits)
        return [[r.tokens[-1]] * limit for r, limit in zip(requests, limits)]

    def distributions(self, request_id: str) -> None:
        return None  # point masses

    def forget(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("schedule", ["heuristic", "constant"])
def test_lookahead_schedule(schedule: str) -> None:
    """heuristic (transformers' num_assistant_tokens_schedule): a request's next proposal may be 2
    tokens longer after one accepted whole (never past num_speculative_tokens), 1 shorter (never
    below 1) after one cut short; constant: num_speculative_tokens each step. Tokens are unchanged."""
    prompt = random_prompts([12], seed=11)[0]
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, return_logprobs=True,
                                           speculative={**SPEC, "num_speculative_tokens_schedule": schedule})
    engine = _engine(cfg, max_new=16)
    proposer = engine.scheduler.proposer = _RecordingProposer()
    accepted: list[int] = []  # per proposal: how many of its tokens were accepted
    try:
        request = engine.make_request(prompt, "r")
        engine.add_request(request)
        while engine.has_work:
            before = engine.scheduler.num_accepted_tokens
            proposed = len(proposer.limits)
            engine.step()
            if len(proposer.limits) > proposed:
                accepted.append(engine.scheduler.num_accepted_tokens - before)
    finally:
        engine.release_model()
    assert request.generated == reference_generate(model_for("llama"), prompt, 16)[0]
    remaining = [16 - 1 - n for n in _generated_before_each(accepted)]
    expected, lookahead = [], 4
    for got_accepted, left in zip(accepted, remaining):
        expected.append(min(lookahead, left))
        if schedule == "heuristic":
            whole = got_accepted == expected[-1]
            lookahead = min(4, lookahead + 2) if whole else max(1, lookahead - 1)
    assert proposer.limits == expected
    assert any(a < lim for a, lim in zip(accepted, proposer.limits))  # some proposals were cut short
    assert engine.scheduler._lookahead == {}  # forgotten when the request finished


def _generated_before_each(accepted: list[int]) -> list[int]:
    """Tokens the request had before each proposal: one after the prompt, then each step's accepted + 1."""
    done, out = 1, []
    for a in accepted:
        out.append(done)
        done += a + 1
    return out


class _OracleProposer:
    """Proposes what the run without speculation drew next, but for one token in three (by
    position), replaced by the token after it in the vocabulary (rejected unless equal)."""

    def __init__(self, reference: dict[str, list[int]], vocab: int) -> None:
        self.reference, self.vocab = reference, vocab

    def propose(self, requests, limits):
        out = []
        for r, limit in zip(requests, limits):
            g = len(r.generated)
            ahead = self.reference[r.request_id][g : g + limit]
            out.append([(t + 1) % self.vocab if (g + i) % 3 == 2 else t for i, t in enumerate(ahead)])
        return out

    def distributions(self, request_id):
        return None

    def forget(self, request_id):
        pass


PROCESSED = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.8, frequency_penalty=0.6),
             SamplingParams(no_repeat_ngram_size=2), SamplingParams(min_new_tokens=20, logit_bias=((5, 2.0),)),
             SamplingParams(bad_words_ids=((7,), (9, 4)), sequence_bias=(((3,), -1.5),))]


def test_logits_processors_apply_per_proposed_row() -> None:
    """Requests with penalties, history processors, min_new_tokens (EOS barred) and bias speculate:
    each proposal's row is processed as if the proposals before it were generated, so tokens and
    logprobs are those of the run without speculation, with proposals accepted and rejected."""
    prompts = _repetitive_prompts()[: len(PROCESSED)]
    per_request = [{"sampling": p} for p in PROCESSED]
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, return_logprobs=True)
    plain, _ = run_engine(model_for("qwen2"), prompts, cfg, max_new=MAX_NEW, eos_token_id=2, per_request=per_request)
    oracle = _OracleProposer({r.request_id: r.generated for r in plain}, model_for("qwen2").config.vocab_size)
    speculating = cfg.model_copy(update={"speculative": SpeculativeConfig(**SPEC)})

    def setup(engine) -> None:
        engine.scheduler.proposer = oracle

    requests, engine = run_engine(model_for("qwen2"), prompts, speculating, max_new=MAX_NEW, eos_token_id=2,
                                  setup=setup, per_request=per_request)
    _assert_equal(requests, [(r.generated, r.logprobs) for r in plain])
    s = engine.scheduler
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_who_speculates() -> None:
    """No proposals for a request that opted out, or when the step has disable_by_batch_size
    decoding requests (requests with logits processors speculate:
    test_logits_processors_apply_per_proposed_row)."""
    prompt = _repetitive_prompts()[5]
    cases = {
        "opted out": {"speculative": False},
    }
    for name, kwargs in cases.items():
        engine = _engine(cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, speculative=SPEC))
        try:
            request = engine.make_request(prompt, "r", sampling=kwargs.get("sampling"))
            request.speculative = kwargs.get("speculative", True)
            engine.add_request(request)
            while engine.has_work:
                engine.step()
            assert engine.scheduler.num_draft_tokens == 0, name
        finally:
            engine.release_model()
    crowded = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200,
                                               speculative={**SPEC, "disable_by_batch_size": 2})
    _, engine = run_engine(model_for("llama"), [prompt, prompt[1:]], crowded, max_new=MAX_NEW)
    assert engine.scheduler.num_draft_tokens == 0
    _, engine = run_engine(model_for("llama"), [prompt], crowded, max_new=MAX_NEW)
    assert engine.scheduler.num_draft_tokens > 0


def test_manager_per_request_opt_out_and_stats() -> None:
    prompt = _repetitive_prompts()[5]
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=200, speculative=SPEC)
    with cbserve.continuous_batching(model_for("llama"), gc, cfg) as manager:
        manager.add_request(prompt, request_id="off", speculative=False)
        out = manager.get_result("off", timeout=60)
        while not out.is_finished():
            out = manager.get_result("off", timeout=60)
        assert manager.stats()["spec_decode_num_draft_tokens"] == 0
        manager.add_request(prompt, request_id="on")
        on = manager.get_result("on", timeout=60)
        while not on.is_finished():
            on = manager.get_result("on", timeout=60)
        stats = manager.stats()
        assert on.generated_tokens == out.generated_tokens
        assert stats["spec_decode_num_accepted_tokens"] > 0
        assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
        with pytest.raises(InvalidRequestError, match="speculative"):
            manager.add_request(prompt, speculative="yes")


def test_refusals() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="batch_invariant"):
        cbserve.ContinuousBatchingConfig(speculative=SPEC, batch_invariant=True)
    with pytest.raises(ValueError, match="method"):
        cbserve.ContinuousBatchingConfig(speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        cbserve.ContinuousBatchingConfig(speculative={"num_speculative_tokens": 0})


# ---- draft model -------------------------------------------------------------------------------


def _draft_folder(tmp_path, noise: float, vocab: int | None = None):
    """The tiny Llama's weights saved as a draft model, each weight perturbed by `noise` (0: the
    target itself, every proposal right)."""
    from tests.support.tiny_models import tiny_model

    overrides = {} if vocab is None else {"vocab_size": vocab}
    draft = tiny_model("llama", **overrides)
    if vocab is None:
        draft.load_state_dict(model_for("llama").state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g, dtype=p.dtype))
    folder = tmp_path / f"draft-{noise}-{vocab}"
    draft.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_draft_model_speculation_equals_generate(tmp_path, noise: float) -> None:
    prompts = random_prompts([5, 17, 40], seed=3)
    cfg = cbserve.ContinuousBatchingConfig(
        page_size=16, num_blocks=200, return_logprobs=True,
        speculative={"method": "draft_model", "model": _draft_folder(tmp_path, noise), "num_speculative_tokens": 3,
                     "disable_by_batch_size": None})
    requests, engine = run_engine(model_for("llama"), prompts, cfg, max_new=MAX_NEW)
    _assert_equal(requests, _reference("llama", prompts))
    s = engine.scheduler
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens > 0
    if noise == 0.0:  # the target as its own draft: every proposal is the target's greedy token
        assert s.num_accepted_tokens == s.num_draft_tokens
    else:
        assert s.num_accepted_tokens < s.num_draft_tokens
    assert not len(s.proposer.copies)  # every finished request's draft copy dropped
    assert s.proposer.engine.block_manager.num_free == s.proposer.engine.cache.num_blocks  # and its pages


def test_sampled_draft_model_proposals_follow_the_draft_distribution(tmp_path) -> None:
    """Sampled requests: the target as its own draft samples its proposals from the target's own
    distribution, so nearly every one is accepted (argmax proposals would pass only with the
    target's probability of each: ~1/5 here), and a seeded request's tokens are reproducible."""
    prompts = random_prompts([5, 17, 40], seed=3)
    cfg = cbserve.ContinuousBatchingConfig(
        page_size=16, num_blocks=200, return_logprobs=True,
        speculative={"method": "draft_model", "model": _draft_folder(tmp_path, 0.0), "num_speculative_tokens": 3,
                     "disable_by_batch_size": None})
    sampled = [{"sampling": SamplingParams(do_sample=True, temperature=1.0, seed=10 + i)} for i in range(3)]
    requests, engine = run_engine(model_for("llama"), prompts, cfg, max_new=16, per_request=sampled)
    s = engine.scheduler
    assert s.num_draft_tokens > 20 and s.num_accepted_tokens >= 0.95 * s.num_draft_tokens
    again, _ = run_engine(model_for("llama"), prompts, cfg, max_new=16, per_request=sampled)
    assert [r.generated for r in again] == [r.generated for r in requests]
    assert not s.proposer._probs and not s.proposer._seeded  # dropped with each finished request


def _draft_greedy(folder: str, tokens: list[int], k: int) -> list[int]:
    """The draft model's own greedy continuation of `tokens` (transformers, whole context each token)."""
    from transformers import AutoModelForCausalLM

    model = _DRAFTS.get(folder) or _DRAFTS.setdefault(
        folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval())
    out = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


_DRAFTS: dict = {}


def _draft_proposer(tmp_path, num_blocks: int = 200):
    folder = _draft_folder(tmp_path, 0.05)
    cfg = cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks, speculative={
        "method": "draft_model", "model": folder, "num_speculative_tokens": 3})
    engine = build_engine(model_for("llama"), GenerationConfig(max_new_tokens=4), cfg)
    return engine, engine.scheduler.proposer, folder


def _count_passes(proposer) -> list[int]:
    """Counts the draft engine's forward passes, and each one's rows, into the returned list."""
    rows, run = [], proposer.engine.runner.run

    def counting(kwargs):
        rows.append(kwargs["input_ids"].shape[1])
        return run(kwargs)

    proposer.engine.runner.run = counting
    return rows


def test_draft_proposals_are_the_draft_models_greedy_continuation(tmp_path) -> None:
    """Three requests at once, over rounds where the target accepted some, all or none of the
    proposals: each proposal is the draft model's own greedy continuation of the request's tokens
    (its paged copy kept the accepted proposals' K/V and overwrote the rejected ones'), and a round
    is one batched pass per proposed position."""
    from cbserve.scheduler.request import Request

    engine, proposer, folder = _draft_proposer(tmp_path)
    try:
        requests = [Request(f"r{i}", p, 16, frozenset()) for i, p in enumerate(random_prompts([5, 17, 40], seed=3))]
        passes = _count_passes(proposer)
        proposals = proposer.propose(requests, [3, 3, 3])
        assert proposals == [_draft_greedy(folder, r.tokens, 3) for r in requests]
        assert passes == [5 + 17 + 40, 3, 3]  # prompts, then a row per request per position
        requests[0].tokens += proposals[0][:1] + [7]  # one accepted, then the target's own token
        requests[1].tokens += proposals[1] + [11]  # all accepted
        requests[2].tokens += [(proposals[2][0] + 1) % 300]  # none accepted
        passes.clear()
        proposals = proposer.propose(requests, [2, 0, 3])
        assert proposals[1] == []
        assert proposals[0] == _draft_greedy(folder, requests[0].tokens, 2)
        assert proposals[2] == _draft_greedy(folder, requests[2].tokens, 3)
        assert passes == [1 + 1, 2, 1]  # the target's own token of each (the accepted one's K/V kept), then
        # the two still proposing
        # Three steps without speculation (a large batch): the copy's proposals are cut where the
        # target's tokens part from them, not only at the last token.
        requests[0].tokens += [(proposals[0][0] + 1) % 300, 5, 9]
        assert proposer.propose(requests[:1], [3]) == [_draft_greedy(folder, requests[0].tokens, 3)]
        for r in requests:
            proposer.forget(r.request_id)
        assert proposer.engine.block_manager.num_free == proposer.engine.cache.num_blocks
    finally:
        engine.release_model()


def test_draft_cache_full_evicts_idle_copies(tmp_path, monkeypatch) -> None:
    """A draft cache of 4 pages (16 tokens each): a request whose copy does not fit beside those
    proposing in the round gets no proposal; alone it evicts the idle copies, which start over
    when they propose again. Every proposal is still the draft's greedy continuation."""
    from cbserve.scheduler.request import Request
    from cbserve.workers import draft_model

    monkeypatch.setattr(draft_model, "DRAFT_CACHE_SHARE", 4 / 200)  # a draft as large as the target: 4 pages
    engine, proposer, folder = _draft_proposer(tmp_path)
    try:
        assert proposer.engine.cache.num_blocks == 4
        requests = [Request(f"r{i}", p, 16, frozenset()) for i, p in enumerate(random_prompts([5, 17, 40], seed=3))]
        proposals = proposer.propose(requests, [3, 3, 3])
        assert proposals[:2] == [_draft_greedy(folder, r.tokens, 3) for r in requests[:2]]
        assert proposals[2] == []  # 40 + 2 tokens need 3 pages, the others hold 3 of 4
        assert proposer.propose(requests[2:], [3]) == [_draft_greedy(folder, requests[2].tokens, 3)]
        assert not proposer.copies.get("r0").block_ids and not proposer.copies.get("r1").block_ids  # evicted
        assert proposer.propose(requests[:1], [3]) == [_draft_greedy(folder, requests[0].tokens, 3)]
        for r in requests:
            proposer.forget(r.request_id)
    finally:
        engine.release_model()


def test_draft_skips_a_long_catch_up_for_few_tokens_left(tmp_path) -> None:
    """A 40-token prompt the draft (of the target's size) has not seen: no proposal with 9 tokens
    left to generate (a 40-token prefill for them: more than 4 per token), a proposal with 10. A
    draft of half the target's layers may lag twice as far."""
    from cbserve.scheduler.request import Request
    from cbserve.workers.draft_model import catch_up_factor

    engine, proposer, folder = _draft_proposer(tmp_path)
    assert proposer.copies.max_lag_per_token_left == 4
    target = model_for("llama").config
    half = target.__class__(**{**target.to_dict(), "num_hidden_layers": target.num_hidden_layers // 2})
    assert catch_up_factor(target, half) == 8
    try:
        prompt = random_prompts([40], seed=3)[0]
        short, longer = Request("short", prompt, 9, frozenset()), Request("longer", prompt, 10, frozenset())
        assert proposer.propose([short, longer], [3, 3]) == [[], _draft_greedy(folder, prompt, 3)]
        for r in (short, longer):
            proposer.forget(r.request_id)
    finally:
        engine.release_model()


def test_quantized_draft_model_speculation_equals_generate(tmp_path) -> None:
    """speculative.quantization='int8': the target's own weights as Q8_0 blocks are the draft, which
    agrees with the target on most tokens; the output is the target's."""
    prompts = random_prompts([5, 17, 40], seed=3)
    cfg = cbserve.ContinuousBatchingConfig(
        page_size=16, num_blocks=200, return_logprobs=True,
        speculative={"method": "draft_model", "model": _draft_folder(tmp_path, 0.0), "quantization": "int8",
                     "num_speculative_tokens": 3, "disable_by_batch_size": None})
    requests, engine = run_engine(model_for("llama"), prompts, cfg, max_new=MAX_NEW)
    _assert_equal(requests, _reference("llama", prompts))
    s = engine.scheduler
    assert getattr(s.proposer.engine.model, QUANTIZED_AS) == "int8"
    assert s.num_accepted_tokens >= 0.8 * s.num_draft_tokens > 0


def test_draft_model_refusals(tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative.model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="speculative.model"):
        SpeculativeConfig(model="/some/draft")  # ngram takes no model
    cfg = cbserve.ContinuousBatchingConfig(speculative={"method": "draft_model",
                                                        "model": _draft_folder(tmp_path, 0.0, vocab=300)})
    with pytest.raises(ValueError, match="vocabulary"):
        build_engine(model_for("llama"), GenerationConfig(max_new_tokens=4), cfg)
    with pytest.raises(ValueError, match="speculative.quantization"):
        SpeculativeConfig(quantization="int8")  # n-gram proposals have no model to quantize
    cfg = cbserve.ContinuousBatchingConfig(speculative={"method": "draft_model", "quantization": "auto",
                                                        "model": _draft_folder(tmp_path, 0.0)})
    with pytest.raises(ValueError, match="speculative.quantization='auto' needs a GGUF draft"):
        build_engine(model_for("llama"), GenerationConfig(max_new_tokens=4), cfg)


@pytest.mark.default_model
def test_default_model_greedy_tokens_unchanged_by_speculation() -> None:
    """The 12 chat prompts of the default model (float32: the same packed kernel for one row and
    for a chunk of rows), 48 greedy tokens each: identical with and without n-gram speculation."""
    from cbserve.__main__ import chat_prompt_ids
    from cbserve.models import load_model
    from tests.workers.test_bf16 import CHAT_PROMPTS

    model, tokenizer = load_model(dtype="float32")
    prompts = [chat_prompt_ids(tokenizer, p) for p in CHAT_PROMPTS]
    outputs = {}
    for spec in (None, {"num_speculative_tokens": 4, "disable_by_batch_size": None}):
        cfg = cbserve.ContinuousBatchingConfig(page_size=64, num_blocks=64, return_logprobs=True, speculative=spec)
        requests, engine = run_engine(model, prompts, cfg, max_new=48)
        outputs[spec is not None] = [r.generated for r in requests]
        accepted = engine.scheduler.num_accepted_tokens
    assert outputs[True] == outputs[False]
    assert accepted > 0
