"""The fair lease order (issue #32): which tenant each free slot goes to. Pure: no I/O.

Start-time fair queuing over GPU-seconds (docs/design.md, "Fair share: the
lease order"):

- A tenant's virtual time is its usage ÷ its weight: GPU-seconds charged as its
  attempts ended (decayed by the half-life), plus each running job at least what
  one of its jobs is expected to charge; never below its floor.
- Each ticket goes to the tenant with the least virtual time among those with
  work, and advances it by one expected job ÷ weight. Priorities order jobs
  within a tenant (the lease statement's business).
- A tenant with nothing running and no work known that gets a ticket comes back
  from idle: it starts at the least virtual time of the busy tenants (a lift,
  kept as its floor), so it cannot bank credit while away.

Which tenants have work is known from a loose scan at each refresh, kept up by
the leases: a tenant that leaves a ticket unfilled has run out, and a few
tenants without known work are tried with each lease (``probes``), so one that
comes back is seen at the next lease, not the next refresh.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ESTIMATE_DEFAULT = 1.0  # GPU-seconds a job is expected to charge before any attempt has ended
_SOME_ATTEMPTS = 1e-6  # below this (decayed) count, a tenant's own mean is not yet an estimate


@dataclass
class Tenant:
    weight: float = 1.0
    usage: float = 0.0  # GPU-seconds: charged, decayed, plus running jobs at least their estimate
    floor: float = 0.0  # the usage it counts as having at least (its last lift)
    estimate: float = ESTIMATE_DEFAULT  # GPU-seconds its next job is expected to charge
    running: int = 0

    @property
    def vt(self) -> float:
        return max(self.usage, self.floor) / self.weight


@dataclass
class Tickets:
    """What one lease asks for: ``names[i]`` is the tenant of ticket i."""

    names: list[str]
    lifts: dict[str, float] = field(default_factory=dict)  # idle tenants: the usage a job of theirs lifts them to


class Ledger:
    """The tenants as this dispatcher knows them: loaded at each refresh, advanced by its leases."""

    def __init__(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.waiting: dict[str, set[str]] = {}  # kind -> tenants believed to have plain jobs pending
        self._turn = itertools.count()  # rotates the tenants without known work that are probed

    def load(self, rows: Iterable[tuple[str, float, float, float, float, Sequence[float]]],
             waiting: Iterable[tuple[str, str]]) -> None:
        """Refresh from the database: (tenant, weight, usage, attempts, floor, running jobs' charges so
        far) per tenant, and the (kind, tenant) pairs with jobs pending."""
        rows = list(rows)
        usage, attempts = sum(r[2] for r in rows), sum(r[3] for r in rows)
        mean = usage / attempts if attempts >= _SOME_ATTEMPTS else ESTIMATE_DEFAULT
        self.tenants = {}
        for name, weight, used, n, floor, running in rows:
            estimate = used / n if n >= _SOME_ATTEMPTS else mean
            self.tenants[name] = Tenant(weight, used + sum(max(c, estimate) for c in running), floor, estimate,
                                        len(running))
        self.waiting = {}
        for kind, name in waiting:
            self.waiting.setdefault(kind, set()).add(name)
            self.tenants.setdefault(name, Tenant(estimate=mean))

    def any_waiting(self, kinds: Iterable[str]) -> bool:
        return any(self.waiting.get(k) for k in kinds)

    def tickets(self, kinds: Iterable[str], n: int, probes: int) -> Tickets:
        """Tickets for ``n`` slots over ``kinds``: the tenants with work, least virtual time first,
        plus up to ``probes`` tenants without known work (extra tickets: each that has no work
        leaves its tickets to the next)."""
        waiting = set().union(*(self.waiting.get(k, ()) for k in kinds))
        busy = [t.vt for name, t in self.tenants.items() if t.running or name in waiting]
        floor = min(busy) if busy else None
        idle = sorted(name for name in self.tenants if name not in waiting)
        if idle and probes:
            k = next(self._turn) % len(idle)
            idle = (idle[k:] + idle[:k])[:probes]
        else:
            idle = []
        heap: list[tuple[float, str]] = []
        lifts: dict[str, float] = {}
        for name in itertools.chain(sorted(waiting), idle):
            t = self.tenants.setdefault(name, Tenant())
            vt = t.vt
            if name not in waiting and not t.running and floor is not None and vt < floor:
                vt, lifts[name] = floor, floor * t.weight  # back from idle: starts with the busiest-least
            heapq.heappush(heap, (vt, name))
        names: list[str] = []
        given = Counter[str]()
        to_waiting = 0
        while heap and to_waiting < n and len(names) < n * (1 + len(idle)):
            vt, name = heapq.heappop(heap)
            names.append(name)
            given[name] += 1
            to_waiting += name in waiting
            if name in waiting or given[name] < n:
                t = self.tenants[name]
                heapq.heappush(heap, (vt + t.estimate / t.weight, name))
        return Tickets(names, {name: usage for name, usage in lifts.items() if given[name]})

    def leased(self, kinds: Iterable[str], asked: Tickets, n: int,
               filled: Sequence[tuple[str, str, int]]) -> dict[str, float]:
        """Count a lease: ``filled`` is (kind, tenant, ticket) per job leased, of ``n`` slots.
        Returns the floors to keep for the tenants it lifted (tenant -> usage)."""
        kinds = list(kinds)
        got = Counter(tenant for _kind, tenant, _ticket in filled)
        floors = {}
        for kind, tenant, _ticket in filled:
            self.waiting.setdefault(kind, set()).add(tenant)
        for tenant, count in got.items():
            t = self.tenants.setdefault(tenant, Tenant())
            if tenant in asked.lifts:
                t.usage = max(t.usage, asked.lifts[tenant])
            t.usage += count * t.estimate
            t.running += count
            if tenant in asked.lifts:
                t.floor = floors[tenant] = t.usage
        reached = max((ticket for _k, _t, ticket in filled), default=-1) if len(filled) >= n else len(asked.names)
        seen = Counter[str]()
        for i, tenant in enumerate(asked.names):
            seen[tenant] += 1
            if i < reached and seen[tenant] > got[tenant]:  # a ticket it could not fill: it has run out
                for kind in kinds:
                    self.waiting.get(kind, set()).discard(tenant)
        return floors
