"""Which requests run in the next forward pass, and how many of their tokens.

The scheduler reasons in token budgets, not phases: each step takes up to `max_batch_tokens`
query tokens and `max_requests` requests, mixing decode tokens and prefill chunks. Prompts
larger than the budget are prefilled in chunks over several steps. When the cache runs out,
the most recently admitted request of the lowest priority and the largest share is preempted
(its pages freed, recomputed later).

After each pass the engine hands its outcome back (`update(plan, result)`, a `StepResult`): the
scheduler moves the requests on, registers their full pages for prefix caching, releases pages
out of a sliding window, appends the tokens and finishes the requests that stop or fault,
freeing their pages. The engine only runs the plan's copies, the model and the sampler.

Between tenants and parent requests the engine is shared fairly (`fair_share.py`): waiting
requests are admitted, and running ones given the step's tokens, least charged tenant and parent
first, after `priority`; one parent's choices take at most `parent_share` of `max_requests` in
the running set, so there is always room to admit another request, and at most
`parent_step_tokens` of a step (`shared_parent_step_tokens` while others are or were lately live,
so that their requests wait for short steps); while a newcomer is owed its first token, the others
take at most `held_step_tokens` of the step (`StepLimits`), so that its first step is short.

With speculative decoding, a decoding request's row carries the tokens the proposer (`ngram.py`,
or a draft model) expects next, when their pages are free (proposals never preempt anyone): its K/V rows are written and its logits verified in the same pass
(`workers/speculative.py`), and the pass's result holds each of its accepted tokens and one more.
The proposals count in the step's token budget; only the verified ones count as computed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cbserve.outputs import FinishReason, RequestStatus
from cbserve.scheduler.block_manager import BlockManager
from cbserve.scheduler.fair_share import FairShare, StepLimits
from cbserve.scheduler.host_pages import HostPages, KVTransfer
from cbserve.scheduler.request import Request

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    """Speculative decoding's source of proposed tokens (`ngram.NgramProposer`,
    `workers/draft_model.DraftModelProposer`)."""

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """At most `limits[i]` tokens to follow each `requests[i]`'s tokens (all of a step's
        speculating requests at once: a draft model runs them as one batch)."""

    def distributions(self, request_id: str) -> Any:
        """The distributions ([len(proposal), vocab] tensor) the last proposal for the request
        was drawn from; None: point masses (a deterministic proposer, or a greedy request)."""

    def forget(self, request_id: str) -> None: ...


@dataclass
class ScheduledRequest:
    request: Request
    num_query_tokens: int
    # The chunk reaches the end of the request's tokens, so its last logits are sampled (never
    # an embedding request's: it ends with its prompt).
    sample: bool
    # Speculative decoding: tokens proposed to follow the request's last one, in the chunk after
    # it (num_query_tokens = 1 + len(draft)); each of their rows' logits is verified.
    draft: list[int] = field(default_factory=list)
    # The distributions the draft was drawn from (a tensor [len(draft), vocab]); None: point masses.
    draft_probs: Any = None

    def __post_init__(self) -> None:
        self.sample = self.sample and self.request.pooling is None


@dataclass
class StepPlan:
    """What one step does: copy pages between device and host (in order, before the forward
    pass), then run `batch`."""

    batch: list[ScheduledRequest]
    transfers: list[KVTransfer]


@dataclass
class StepResult:
    """A forward pass's sampled output as the scheduler takes it (`Scheduler.update`): for each
    request drawn for, in row order, its token and, when asked, its log-probability and top
    (token, logprob) pairs; and the requests that cannot go on, each with its own fault. A request
    in both had its token refused by its own state (grammar, logits processors): the token is
    kept, and the request fails. A request that speculated appears once per token it gets, in a
    row: its accepted proposals, then the token drawn after them."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    requests: list[Request] = field(default_factory=list)
    faults: list[tuple[Request, BaseException]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_requests: int,
        policy: str = "fifo",
        safety_margin: float = 0.15,
        host_pages: HostPages | None = None,
        parent_share: float = 1.0,
        release_window: int | None = None,
        parent_step_tokens: int | None = None,
        held_step_tokens: int | None = None,
        shared_parent_step_tokens: int | None = None,
        shared_window_s: float = 0.0,
        proposer: Proposer | None = None,
        speculate_below: int | None = None,
        num_speculative_tokens: int = 0,
        adaptive_lookahead: bool = False,
        max_loras: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests
        self.policy = policy
        self.safety_margin = safety_margin
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.host_pages = host_pages
        self.shares = FairShare()
        # Running choices of one parent request (requests without a parent id are not capped).
        self.max_running_per_parent = max(1, int(parent_share * max_requests))
        # Query tokens per step: of one parent's choices; of others while a newcomer is owed (`StepLimits`).
        self.parent_step_tokens, self.held_step_tokens = parent_step_tokens, held_step_tokens
        # ... and while the engine is shared (`_parent_step_tokens`; `_shared_at`: when it last was).
        self.shared_parent_step_tokens, self.shared_window_s = shared_parent_step_tokens, shared_window_s
        self.clock, self._shared_at = time.monotonic, float("-inf")
        self._transfers: list[KVTransfer] = []
        # Speculative decoding: proposals in steps with fewer than `speculate_below` decoding requests.
        self.proposer, self.speculate_below = proposer, speculate_below
        # With `adaptive_lookahead`, each request's proposals are at most its own lookahead
        # (request id -> tokens; `_adapt_lookahead`), else at most `num_speculative_tokens`.
        self.max_lookahead, self.adaptive_lookahead = num_speculative_tokens, adaptive_lookahead
        self._lookahead: dict[str, int] = {}
        # LoRA: the running requests use at most this many adapters (all resident in one step).
        self.max_loras = max_loras
        # With sliding-window layers only: how far back a query sees (pages before are released).
        self.release_window = release_window
        # Called with each pass's advanced entries, before their tokens are taken (the node pool).
        self.on_computed: Callable[[list[ScheduledRequest]], None] | None = None
        self.num_preemptions, self.num_recomputes, self.prefix_hit_tokens = 0, 0, 0
        self.num_steps = 0  # forward passes taken (`update`)
        self.num_prompt_tokens = 0  # prompt tokens computed (not recomputed after a preemption)
        self.num_generated_tokens = 0
        # Speculative decoding (vLLM's counters): steps a request speculated in, tokens proposed,
        # tokens accepted, and accepted by position in the proposal.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.shares.join(request)
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, cancelled or failed) and free its pages."""
        if request in self.running:
            self.running.remove(request)
            self.shares.set_running(request, False)
            self.shares.leave(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            self.shares.leave(request)
        self.block_manager.free(request)
        if request.host_block_ids:
            self.host_pages.release(request)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        budget = self.max_batch_tokens
        if self.host_pages is not None:
            self.host_pages.begin_step()
        batch: list[ScheduledRequest] = []
        ranked = sorted(self.running, key=self.shares.rank)  # stable: admission order within a share
        decodes = [r for r in ranked if r.num_pending == 1 and not r.awaits_last_token]
        prefills = [r for r in ranked if r.num_pending > 1]
        order = decodes + prefills if self.policy == "fifo" else prefills + decodes
        scheduled: set[int] = set()
        limits = self._step_limits(ranked)
        speculate = self.proposer is not None and (self.speculate_below is None or len(decodes) < self.speculate_below)
        drafts = self._drafts(decodes[: self.max_requests]) if speculate else {}
        for request in order:
            if budget == 0 or len(batch) == self.max_requests:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            draft = drafts.get(id(request), []) if request.num_pending == 1 else []
            num = limits.room(request, min(request.num_pending + len(draft), budget))
            draft = draft[: max(0, num - request.num_pending)]
            if draft and not self.block_manager.allocate(request, request.num_computed + num):
                draft, num = [], request.num_pending  # proposals never preempt anyone: none this step
            if num == 0 or not self._allocate_or_preempt(request, num, scheduled):
                continue
            if draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
            probs = self.proposer.distributions(request.request_id) if draft else None
            probs = probs[: len(draft)] if probs is not None else None
            batch.append(ScheduledRequest(request, num, num >= request.num_pending, draft, probs))
            self.shares.charge(request, num)
            limits.take(request, num)
            scheduled.add(id(request))
            budget -= num
        self._admit(batch, budget, limits)
        if self.policy == "prefill_first":  # admitted prefills go first
            batch.sort(key=lambda s: s.request.num_pending == 1)
        transfers, self._transfers = self._transfers, []
        return StepPlan(batch, transfers)

    def _drafts(self, decodes: list[Request]) -> dict[int, list[int]]:
        """The proposed next tokens of decoding requests (by id): none past a request's
        max_new_tokens (the token drawn after them is its own), none for one that may not speculate."""
        speculating, limits = [], []
        for request in decodes:
            if not request.may_speculate or request.num_inflight:
                continue
            lookahead = self._lookahead.get(request.request_id, self.max_lookahead)
            limit = min(lookahead, request.max_new_tokens - len(request.generated) - 1)
            if limit > 0:
                speculating.append(request)
                limits.append(limit)
        if not speculating:
            return {}
        return {id(r): d for r, d in zip(speculating, self.proposer.propose(speculating, limits)) if d}

    def _allocate_or_preempt(self, request: Request, num: int, scheduled: set[int]) -> bool:
        target = request.num_computed + num
        while not self.block_manager.allocate(request, target):
            victim = self._victim(scheduled)
            if victim is None:  # nothing left to preempt: wait for others to finish
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _victim(self, scheduled: set[int]) -> Request | None:
        """The running request not yet scheduled this step with the largest rank (the lowest
        priority, then the largest tenant and parent share), the most recently admitted of those."""
        candidates = [(i, r) for i, r in enumerate(self.running) if id(r) not in scheduled]
        if not candidates:
            return None
        return max(candidates, key=lambda c: (self.shares.rank(c[1]), c[0]))[1]

    def _preempt(self, request: Request) -> None:
        """Evict a running request: its pages go to the host pool when it has room, else
        they are dropped and recomputed on readmission."""
        self.running.remove(request)
        self.shares.set_running(request, False)
        transfer = self.host_pages.offload(request) if self.host_pages is not None else None
        if transfer is not None:
            self._transfers.append(transfer)
        elif self.host_pages is not None and (export := self.host_pages.export(request)) is not None:
            self._transfers.append(export)  # recomputed on readmission, unless the node pool still has them
        offloaded = transfer is not None
        logger.debug("preempting %s (%s)", request.request_id, "offload" if offloaded else "recompute")
        self.num_recomputes += not offloaded
        self.block_manager.free(request)
        request.status = RequestStatus.PENDING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _pull_from_node(self, request: Request) -> int:
        """Tokens of the request the node pool holds past its local prefix match, planned as a
        pull into host pages (0: none, no node pool, or too little room to admit the whole
        request now: a pull is a copy, not repeated while the request waits)."""
        hp, bm = self.host_pages, self.block_manager
        if hp is None or hp.node is None:
            return 0
        if bm.num_free < bm.pages_needed(request.num_tokens) - len(request.block_ids):
            return 0
        pull = hp.pull(request)
        if pull is None:
            return 0
        self._transfers.append(pull)
        return request.num_offloaded_tokens

    def _drop_pulled(self, request: Request) -> None:
        if self.host_pages is not None and self.host_pages.pulled(request):
            self.host_pages.release(request)
            self._transfers = [t for t in self._transfers if t.kind != "pull" or t.request_id != request.request_id]

    def pulled_short(self, plan: StepPlan, short: list[tuple[KVTransfer, int]]) -> None:
        """Pulls of `plan` that copied fewer pages than planned (`(transfer, pages copied)`: a
        node pool page changed since the plan was made): their requests compute from the last
        page copied, the same number of tokens in this step."""
        ps = self.block_manager.page_size
        lost = {t.request_id: (len(t.host_blocks) - copied) * ps for t, copied in short}
        for i, s in enumerate(plan.batch):
            missing = lost.get(s.request.request_id)
            if missing is None:
                continue
            request = s.request
            request.num_computed -= missing
            self.prefix_hit_tokens -= missing
            self.host_pages.num_node_hit_tokens -= missing
            plan.batch[i] = ScheduledRequest(request, s.num_query_tokens,
                                             request.num_computed + s.num_query_tokens == request.num_tokens)

    def _may_admit(self, batch: list[ScheduledRequest], budget: int) -> bool:
        bm = self.block_manager
        if budget <= 0 or len(batch) >= self.max_requests:
            return False
        return not (self.running and bm.num_free < self.safety_margin * bm.num_blocks)

    def _step_limits(self, running: list[Request]) -> StepLimits:
        """This step's `StepLimits`. Newcomers: waiting requests that could be admitted now (not
        a full parent, room for their pages above the safety margin: else holding the others would
        only slow the release of pages) and running ones, without a first token yet."""
        bm = self.block_manager
        started = [r for r in running if r.generated or r.status == RequestStatus.DECODING]
        newcomers = []
        if self.held_step_tokens is not None and self.shares.several_groups():  # else none to hold
            newcomers = [r for r in running if not r.generated and r.status != RequestStatus.DECODING]
            if len(running) < self.max_requests and not (running and bm.num_free < self.safety_margin * bm.num_blocks):
                newcomers += [r for r in self.waiting if not r.generated and not r.num_inflight
                              and not self._parent_full(r) and bm.pages_needed(r.num_tokens) <= bm.num_free]
        return StepLimits(self.shares, self._parent_step_tokens(), self.held_step_tokens, newcomers, started)

    def _parent_step_tokens(self) -> int | None:
        """One parent's query tokens this step: `parent_step_tokens`, and `shared_parent_step_tokens`
        while the engine is shared (several tenants or parents live now or within `shared_window_s`):
        a newcomer then waits for a short step in flight, not for a fan-out's whole one."""
        if self.shared_parent_step_tokens is None:
            return self.parent_step_tokens
        now = self.clock()
        if self.shares.several_groups():
            self._shared_at = now
        if now - self._shared_at > self.shared_window_s:
            return self.parent_step_tokens
        return min(c for c in (self.parent_step_tokens, self.shared_parent_step_tokens) if c is not None)

    def _parent_full(self, request: Request) -> bool:
        """Its parent request already has its most choices running (room left for others)."""
        return request.parent_id is not None and self.shares.parent(request).running >= self.max_running_per_parent

    def _adapters_full(self, request: Request) -> bool:
        """Its LoRA adapter would be one more than `max_loras` among the running requests'."""
        if request.lora_id is None or self.max_loras is None:
            return False
        adapters = {r.lora_id for r in self.running if r.lora_id is not None}
        return request.lora_id not in adapters and len(adapters) >= self.max_loras

    def _candidates(self, limits: StepLimits, budget: int) -> list[Request]:
        """The waiting requests that could be admitted this step: of each tenant's parent (FIFO
        within it), at most as many as it has step tokens left, none of a full parent; so a
        512-choice call's waiting choices are not all ordered again every step."""
        left: dict[tuple[str, str | None], int] = {}
        out = []
        for request in self.waiting:
            key = (request.tenant, request.parent_id)
            if key not in left:
                left[key] = 0 if self._parent_full(request) else limits.room(request, budget)
            if left[key] > 0:
                out.append(request)
                left[key] -= not request.num_inflight
        return out

    def _admit(self, batch: list[ScheduledRequest], budget: int, limits: StepLimits) -> None:
        """Admit waiting requests in fair order (`FairShare.admission_order`) while there is room."""
        if not self.waiting or not self._may_admit(batch, budget):
            return
        bm = self.block_manager
        in_flight = {h for r in self.running for h in bm.pages_in_flight(r)}
        admitted: set[int] = set()
        for request in self.shares.admission_order(self._candidates(limits, budget)):
            if not self._may_admit(batch, budget):
                break
            if request.num_inflight or self._parent_full(request):  # a token still on the device: next step
                continue
            if self._adapters_full(request):  # waits for a running adapter's requests to finish
                continue
            if not limits.room(request, 1):  # its tenant or parent has had its tokens this step
                continue
            restored = request.num_offloaded_tokens
            if not restored and not request.computes_whole_prompt:
                bm.match_prefix(request)
                if bm.waits_for_prefix(request, in_flight):  # its prefix is being computed
                    bm.free(request)
                    continue
                restored = self._pull_from_node(request)
            computed = restored or request.num_computed
            num = limits.room(request, min(request.num_tokens - computed, budget))
            if not bm.allocate(request, computed + num):
                self._drop_pulled(request)
                bm.free(request)  # release the prefix pages it matched; it stays in line
                break
            if restored:
                self._transfers.append(self.host_pages.restore(request))
            admitted.add(id(request))
            self.prefix_hit_tokens += request.num_computed
            self.running.append(request)
            self.shares.set_running(request, True)
            request.status = RequestStatus.PREFILLING
            batch.append(ScheduledRequest(request, num, num == request.num_pending))
            self.shares.charge(request, num)
            limits.take(request, num)
            in_flight.update(bm.pages_in_flight(request))
            budget -= num
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)

    # -- after a step ------------------------------------------------------------------------

    def update(self, plan: StepPlan | None, result: StepResult | None = None) -> list[Request]:
        """The step's bookkeeping, in this order: `plan`'s pass has run, so its requests still
        live move on (their K/V is in the cache: full pages registered for prefix caching, pages
        out of the sliding window released); then `result`'s tokens are appended, and requests
        that stop or fault finish, their pages freed. `result` is that pass's output, or (async
        batching) None while it is on the device: its sampled requests then count a token in
        flight, and a later `update(None, result)` hands the tokens over. Returns the requests
        that got a token or finished."""
        if plan is not None:
            self._advance([s for s in plan.batch if s.request.live], in_flight=result is None)
        if plan is not None and result is not None and self.adaptive_lookahead:
            self._adapt_lookahead(plan.batch, result)
        return [] if result is None else self._take(result, was_in_flight=plan is None)

    def _adapt_lookahead(self, batch: list[ScheduledRequest], result: StepResult) -> None:
        """transformers' "heuristic" schedule of assistant tokens, per request: after a proposal
        accepted whole, the next may be 2 tokens longer (up to `max_lookahead`); after one cut
        short, 1 shorter (at least 1). Proposals that keep failing cost one verified row a step,
        not `max_lookahead`."""
        runs = Counter(id(r) for r in result.requests)  # a request's accepted proposals + its drawn token
        for s in batch:
            if not s.draft:
                continue
            rid = s.request.request_id
            lookahead = self._lookahead.get(rid, self.max_lookahead)
            if runs[id(s.request)] - 1 == len(s.draft):
                self._lookahead[rid] = min(self.max_lookahead, lookahead + 2)
            else:
                self._lookahead[rid] = max(1, lookahead - 1)

    def _advance(self, batch: list[ScheduledRequest], in_flight: bool) -> None:
        bm = self.block_manager
        for s in batch:
            request = s.request
            if not request.generated:
                self.num_prompt_tokens += s.num_query_tokens
            request.num_computed += s.num_query_tokens - len(s.draft)  # proposals: once verified (`_take`)
            if request.status == RequestStatus.PREFILLING and s.sample:
                request.status = RequestStatus.DECODING
            bm.register_full_pages(request)
            if self.release_window is not None:
                bm.release_before(request, request.num_computed - self.release_window + 1)
            request.num_inflight += in_flight and s.sample
        if self.on_computed is not None:  # the node pool publishes the computed prompt pages
            self.on_computed(batch)
        self.num_steps += 1

    def _take(self, result: StepResult, was_in_flight: bool) -> list[Request]:
        """Append each live request's token; finish those that stop, fail those at fault."""
        faults = {id(r): fault for r, fault in result.faults}
        drawn = {id(r) for r in result.requests}
        refused = [r for r, fault in result.faults if id(r) not in drawn]  # nothing drawn for them
        for request in refused:
            self.fail(request, faults[id(request)])
        updated: dict[int, Request] = {}
        previous, position = None, 0
        for i, request in enumerate(result.requests):
            repeat, previous = request is previous, request
            position = position + 1 if repeat else 0
            if not request.live:  # finished before this pass, or on an earlier token of its run
                continue
            if repeat:  # an accepted proposal came before: this pass wrote its K/V
                request.num_computed += 1
                self.num_accepted_tokens += 1
                self.accepted_per_position[position - 1] += 1
            else:
                request.num_inflight -= was_in_flight
            request.append_token(result.tokens[i], result.logprobs[i] if result.logprobs is not None else None,
                                 result.top_logprobs[i] if result.top_logprobs is not None else None)
            updated[id(request)] = request
            self.num_generated_tokens += 1
            if id(request) in faults:
                self.fail(request, faults[id(request)])
            elif (reason := request.stop_reason()) is not None:
                self.finish(request, RequestStatus.FINISHED, reason)
        return refused + list(updated.values())

    def fail(self, request: Request, error: BaseException) -> None:
        """One request cannot go on (a fault of its own): it alone fails, its pages freed."""
        logger.warning("request %s failed: %s", request.request_id, error)
        self.finish(request, RequestStatus.FAILED, FinishReason.ERROR, error)

    def finish(self, request: Request, status: RequestStatus, reason: FinishReason,
               error: BaseException | None = None) -> None:
        """The request ends (finished, cancelled, failed): out of the scheduler, its pages freed."""
        if request.live:
            self.remove(request)
            if self.proposer is not None:
                self.proposer.forget(request.request_id)
                self._lookahead.pop(request.request_id, None)
        request.finish(status, reason, error)
