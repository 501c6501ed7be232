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
from typing import TypeAlias

ESTIMATE_DEFAULT = 1.0  # GPU-seconds a job is expected to charge before any attempt has ended
# The least a job is expected to charge: jobs that run in no time still take turns by weight
# (with an estimate of 0 no ticket would advance its tenant, and the first would take every slot).
ESTIMATE_FLOOR = 0.001
_SOME_ATTEMPTS = 1e-6  # below this (decayed) count, a tenant's own mean is not yet an estimate

# What a tenant waits in: a kind of plain jobs, or (kind, shape) of placed jobs.
Key: TypeAlias = str | tuple[str, str]


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
        self.waiting: dict[Key, set[str]] = {}  # kind or (kind, shape) -> tenants believed to have jobs pending
        self._turn = itertools.count()  # rotates the tenants without known work that are probed
        self._mean = ESTIMATE_DEFAULT  # the estimate for a tenant first seen waiting

    def load(self, rows: Iterable[tuple[str, float, float, float, float, Sequence[float]]],
             waiting: Iterable[tuple[Key, str]]) -> None:
        """Refresh from the database: (tenant, weight, usage, attempts, floor, running jobs' charges so
        far) per tenant, and the (key, tenant) pairs with jobs pending."""
        rows = list(rows)
        usage, attempts = sum(r[2] for r in rows), sum(r[3] for r in rows)
        mean = max(ESTIMATE_FLOOR, usage / attempts) if attempts >= _SOME_ATTEMPTS else ESTIMATE_DEFAULT
        self.tenants = {}
        for name, weight, used, n, floor, running in rows:
            estimate = max(ESTIMATE_FLOOR, used / n) if n >= _SOME_ATTEMPTS else mean
            self.tenants[name] = Tenant(weight, used + sum(max(c, estimate) for c in running), floor, estimate,
                                        len(running))
        self._mean = mean
        self.load_waiting(waiting)
        self._cap_floors()

    def _cap_floors(self) -> None:
        """A floor never lifts a tenant above the least usage per weight of the other busy tenants
        (floors left out): a lift made with estimates that proved too large (1 s a job before any
        ended, for jobs of 0.2 s) would else hold the tenant back until the others caught up."""
        busy = set().union(*self.waiting.values()) | {n for n, t in self.tenants.items() if t.running}
        two = heapq.nsmallest(2, ((self.tenants[n].usage / self.tenants[n].weight, n) for n in busy
                                  if n in self.tenants))
        for name, t in self.tenants.items():
            if t.floor:
                least = [vt for vt, other in two if other != name][:1]
                t.floor = min(t.floor, least[0] * t.weight) if least else 0.0

    def load_waiting(self, waiting: Iterable[tuple[Key, str]]) -> None:
        """The (key, tenant) pairs with jobs pending, read again (a tenant new here: the mean estimate)."""
        self.waiting = {}
        for key, name in waiting:
            self.waiting.setdefault(key, set()).add(name)
            if name not in self.tenants:
                self.tenants[name] = Tenant(estimate=self._mean)

    def any_waiting(self, keys: Iterable[Key]) -> bool:
        return any(self.waiting.get(k) for k in keys)

    def least(self, key: Key) -> float:
        """The least virtual time among the tenants waiting in ``key`` (inf: none known)."""
        return min((self.tenants[name].vt for name in self.waiting.get(key, ()) if name in self.tenants),
                   default=float("inf"))

    def tickets(self, keys: Sequence[Key], n: int, probes: int) -> Tickets:
        """Tickets for ``n`` slots over ``keys``: the tenants with work, least virtual time first,
        plus up to ``probes`` tenants without known work (extra tickets: each that has no work
        leaves its tickets to the next). Only the ``n`` least of the waiting can get one of ``n``
        tickets, so the rest are not looked at: O(tenants) in C, O(n log n) in Python."""
        waiting = self.waiting.get(keys[0], set()) if len(keys) == 1 else \
            set().union(*(self.waiting.get(k, ()) for k in keys))
        tenants = self.tenants
        for name in waiting:
            if name not in tenants:
                tenants[name] = Tenant()
        first = heapq.nsmallest(n, waiting, key=lambda name: (tenants[name].vt, name))
        idle = self._idle(waiting, probes)
        floor = None
        if idle:  # the least busy virtual time: a waiting tenant's, or a running one's
            busy = [tenants[first[0]].vt] if first else []
            busy += [t.vt for t in tenants.values() if t.running]
            floor = min(busy) if busy else None
        # (virtual time, 0 for a probe: it goes first on a tie, else it would never be tried, tenant)
        heap: list[tuple[float, int, str]] = [(tenants[name].vt, 1, name) for name in first]
        lifts: dict[str, float] = {}
        for name in idle:
            t = tenants[name]
            vt = t.vt
            if not t.running and floor is not None and vt < floor:
                vt, lifts[name] = floor, floor * t.weight  # back from idle: starts at the least busy
            heap.append((vt, 0, name))
        heapq.heapify(heap)
        names: list[str] = []
        given = Counter[str]()
        to_waiting = 0
        while heap and to_waiting < n:
            vt, rank, name = heapq.heappop(heap)
            names.append(name)
            given[name] += 1
            to_waiting += name in waiting
            if name in waiting or given[name] < n:
                t = tenants[name]
                heapq.heappush(heap, (vt + t.estimate / t.weight, rank, name))
        return Tickets(names, {name: usage for name, usage in lifts.items() if given[name]})

    def _idle(self, waiting: set[str], probes: int) -> list[str]:
        """Up to ``probes`` known tenants without known work, taking turns."""
        if not probes or len(waiting) >= len(self.tenants):
            return []
        idle = [name for name in self.tenants if name not in waiting]
        if not idle:
            return []
        k = next(self._turn) % len(idle)
        return (idle[k:] + idle[:k])[:probes]

    def leased(self, keys: Iterable[Key], asked: Tickets, n: int,
               filled: Sequence[tuple[Key, str, int]]) -> dict[str, float]:
        """Count a lease: ``filled`` is (key, tenant, ticket) per job leased, of ``n`` slots.
        Returns the floors to keep for the tenants it lifted (tenant -> usage)."""
        keys = list(keys)
        got = Counter(tenant for _kind, tenant, _ticket in filled)
        floors = {}
        for key, tenant, _ticket in filled:
            self.waiting.setdefault(key, set()).add(tenant)
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
                for key in keys:
                    self.waiting.get(key, set()).discard(tenant)
        return floors
