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
