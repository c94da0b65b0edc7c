"""Fair shares of the engine between tenants, and between parent requests within a tenant.

A parent request is vLLM's name for one API call whose choices (n x prompts) run as engine
requests of their own. Each tenant, and each parent within its tenant, is charged the query
tokens scheduled for its requests while it has any live (waiting or running). The least charged
goes first: start-time fair queuing, the fluid form of deficit round robin. One that becomes
live starts at the charge of its least charged live peer, so an idle spell banks no credit and a
newcomer goes ahead of a long-running fan-out at once. A lower `priority` (vLLM's: lower first)
goes before any share. Requests without a parent id form one queue per tenant, in arrival order:
with one tenant and no parent ids (the Python API) the order is the scheduler's FIFO, unchanged.

Tokens and counts only: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cbserve.scheduler.request import Request


@dataclass
class Account:
    charged: int = 0  # query tokens scheduled while live
    live: int = 0  # requests waiting or running
    running: int = 0
    parents: dict[str | None, Account] = field(default_factory=dict)  # a tenant's parents


class FairShare:
    def __init__(self) -> None:
        self.tenants: dict[str, Account] = {}

    def tenant(self, request: Request) -> Account:
        return self.tenants[request.tenant]

    def parent(self, request: Request) -> Account:
        return self.tenants[request.tenant].parents[request.parent_id]

    def join(self, request: Request) -> None:
        """A request became live (added)."""
        tenant = _open(self.tenants, request.tenant)
        _open(tenant.parents, request.parent_id).live += 1
        tenant.live += 1

    def leave(self, request: Request) -> None:
        """A request is no longer live (finished, cancelled, failed); a tenant or parent left
        with none is forgotten."""
        tenant = self.tenants.get(request.tenant)
        parent = tenant.parents.get(request.parent_id) if tenant is not None else None
        if parent is None:
            return
        parent.live -= 1
        tenant.live -= 1
        if parent.live == 0:
            del tenant.parents[request.parent_id]
        if tenant.live == 0:
            del self.tenants[request.tenant]

    def set_running(self, request: Request, running: bool) -> None:
        delta = 1 if running else -1
        self.parent(request).running += delta
        self.tenant(request).running += delta

    def charge(self, request: Request, tokens: int) -> None:
        tenant = self.tenant(request)
        tenant.charged += tokens
        tenant.parents[request.parent_id].charged += tokens

    def several_groups(self) -> bool:
        """More than one tenant, or more than one parent in the one tenant, has requests live."""
        return len(self.tenants) > 1 or any(len(t.parents) > 1 for t in self.tenants.values())

    def rank(self, request: Request) -> tuple[int, int, int]:
        """Who goes first among running requests (and who is preempted last): lower is first."""
        tenant = self.tenants[request.tenant]
        return request.priority, tenant.charged, tenant.parents[request.parent_id].charged

    def admission_order(self, waiting: Iterable[Request]) -> list[Request]:
        """The waiting requests in the order to admit them: by priority, then by tenant share,
        then by parent share within the tenant, each interleaved by the tokens its requests would
        be charged (a request's tag is its group's charge plus the prompts ahead of it)."""
        by_tenant: dict[str, list[Request]] = {}
        for request in waiting:  # the scheduler's FIFO order (preempted requests at the front)
            by_tenant.setdefault(request.tenant, []).append(request)
        ordered = []
        for name, requests in by_tenant.items():
            within = _interleave(requests, lambda r: r.parent_id, self.tenants[name].parents)
            ordered += _tagged(within, lambda r: r.tenant, self.tenants)
        ordered.sort(key=lambda t: t[0])
        return [r for _, r in ordered]


def _open(accounts: dict, key: str | None) -> Account:
    """The live account of `key`; a new one starts at the least charge of its live peers."""
    account = accounts.get(key)
    if account is None:
        start = min((a.charged for a in accounts.values()), default=0)
        account = accounts[key] = Account(charged=start)
    return account


def _cost(request: Request) -> int:
    return max(1, request.num_tokens - request.num_computed)


def _tagged(requests: list[Request], group_of: Callable[[Request], Any],
            accounts: dict[Any, Account]) -> list[tuple[tuple[int, int, int], Request]]:
    """(sort key, request): each request's start tag in its group (its group's charge plus the
    prompts of the group's requests before it), taken in the given order."""
    ahead: dict[Any, int] = {}
    out = []
    for position, request in enumerate(requests):
        key = group_of(request)
        tag = accounts[key].charged + ahead.get(key, 0)
        ahead[key] = ahead.get(key, 0) + _cost(request)
        out.append(((request.priority, tag, position), request))
    return out


def _interleave(requests: list[Request], group_of: Callable[[Request], Any],
                accounts: dict[Any, Account]) -> list[Request]:
    """`requests` in fair order between the groups of `group_of`, FIFO by priority within one."""
    by_priority = sorted(requests, key=lambda r: r.priority)  # stable: FIFO within a priority
    tagged = _tagged(by_priority, group_of, accounts)
    tagged.sort(key=lambda t: t[0])
    return [r for _, r in tagged]


class StepLimits:
    """Query tokens that each parent request and tenant may still take in one step.

    On a CPU a step's time grows with its tokens, and a newcomer waits for the step in flight and
    then for its own: so one parent's choices take at most `parent_tokens` per step, bar its first
    row (a lone request's prefill chunk is not cut; None: no cap); and while a newcomer (a tenant or
    parent none of whose requests has its first token yet) could be admitted and is owed no less
    (its priority and charge are not above the other's), the other tenants, and the other parents
    of its tenant, that have started take at most `held_tokens` (None: never held). Newcomers never
    hold each other: 32 clients arriving at once would otherwise each get `held_tokens` of prompt a
    step, all of them waiting for the last one's prefill (measured served: TTFT p50 0.45 s for the
    first, 7.8 s for the other 31, all at once); among themselves they go in fair order, whole
    prompts first, as the budget allows."""

    def __init__(self, shares: FairShare, parent_tokens: int | None, held_tokens: int | None,
                 newcomers: Iterable[Request], started: Iterable[Request]) -> None:
        self.shares, self.parent_tokens, self.held_tokens = shares, parent_tokens, held_tokens
        self.used: dict[Any, int] = {}  # ("t", tenant) or ("p", tenant, parent) -> tokens this step
        self._held: dict[Any, bool] = {}
        going = self._going = {(r.tenant, r.parent_id) for r in started}
        tenants_going = self._tenants_going = {t for t, _ in going}
        self._tenants: dict[str, tuple[int, int]] = {}  # newcomer tenant -> least (priority, charge)
        self._parents: dict[str, dict[str | None, tuple[int, int]]] = {}  # tenant -> newcomer parent -> ...
        for r in newcomers if held_tokens is not None else ():
            if r.tenant not in tenants_going:
                _least(self._tenants, r.tenant, (r.priority, shares.tenant(r).charged))
            if (r.tenant, r.parent_id) not in going:
                _least(self._parents.setdefault(r.tenant, {}), r.parent_id, (r.priority, shares.parent(r).charged))

    def room(self, request: Request, wanted: int) -> int:
        """How many of `wanted` tokens the request may take now."""
        room = wanted
        used = self.used.get(("p", request.tenant, request.parent_id), 0)
        if used and request.parent_id is not None and self.parent_tokens is not None:  # its first row is free
            room = min(room, self.parent_tokens - used)
        for level, key in (("t", ("t", request.tenant)), ("p", ("p", request.tenant, request.parent_id))):
            if self._held_at(level, request):
                room = min(room, self.held_tokens - self.used.get(key, 0))
        return max(0, room)

    def take(self, request: Request, tokens: int) -> None:
        for key in (("t", request.tenant), ("p", request.tenant, request.parent_id)):
            self.used[key] = self.used.get(key, 0) + tokens

    def _held_at(self, level: str, request: Request) -> bool:
        key = (level, request.tenant, request.parent_id, request.priority)
        if key not in self._held:
            started = request.tenant in self._tenants_going if level == "t" else \
                (request.tenant, request.parent_id) in self._going
            self._held[key] = started and self._owed(level, request)  # a newcomer is never held
        return self._held[key]

    def _owed(self, level: str, request: Request) -> bool:
        """Whether a newcomer of another tenant (level "t"), or of another parent of the request's
        tenant ("p"), is owed no less than the request's own tenant or parent."""
        if level == "t":
            own = (request.priority, self.shares.tenant(request).charged)
            return any(t != request.tenant and k <= own for t, k in self._tenants.items())
        own = (request.priority, self.shares.parent(request).charged)
        peers = self._parents.get(request.tenant, {})
        return any(p != request.parent_id and k <= own for p, k in peers.items())


def _least(table: dict, key: Any, value: tuple[int, int]) -> None:
    if key not in table or value < table[key]:
        table[key] = value
