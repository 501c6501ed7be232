"""Fair share, as this dispatcher knows it: the tenants' weights, and while on, the lease order.

Fair share is on while some tenant has a weight (gpuq.tenants). The completer
asks ``on`` to pick its outcome statements: on, they also charge each
attempt's GPU-seconds to its tenant's usage in the same statement; off, they
are the plain ones, at today's cost (docs/design.md, "Fair share").

The weights are read when a pass looks at everything (a start, a poll, a
``*`` notification: ``gpuq tenant set`` sends one), at most every
``fair_share_seconds``: a read that the throttle holds back is due when it
lapses (``wait_left``). While on, each read also loads the tenants' usage and
which tenants have work (``fairorder.Ledger``), at least every
``fair_share_seconds``, and the group leases go through ``lease``: each free
slot to the tenant with work whose usage per weight is least.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from gpuq import admin, fairlease
from gpuq.dispatcher.fairorder import Key, Ledger
from gpuq.dispatcher.trigger import Pass
from gpuq.dispatcher.tuning import Tuning
from gpuq.fairlease import Leased
from gpuq.jobs import LeasedJob, Shape
from gpuq.sql import queries


class FairShare:
    def __init__(self, pool: Any, tuning: Tuning):
        self.pool, self.tuning = pool, tuning
        self.weights: dict[str, float] = {}
        self.ledger = Ledger()
        self._read_at, self._stale = -tuning.fair_share_seconds, True
        self._waiting_at = self._read_at

    @property
    def on(self) -> bool:
        """Some tenant has a weight: outcomes charge usage, and plain jobs lease in the fair order."""
        return bool(self.weights)

    async def refresh(self, why: Pass) -> bool:
        """Read the weights (and, on, the tenants) if a pass over everything asked since the last read, or
        fair share is on and the last read is ``fair_share_seconds`` old; the throttle allows. On, kinds
        announced (or a pass over everything) have the tenants with work read again (at most every ``fair_waiting_seconds``): a
        tenant new to this server is leased for in the pass its first job's notification brings.
        Returns whether fair share was turned on or off."""
        now = time.monotonic()
        self._stale = self._stale or why.every or self.on
        if not self._stale or now - self._read_at < self.tuning.fair_share_seconds:
            if self.on and (why.kinds or why.every) and now - self._waiting_at >= self.tuning.fair_waiting_seconds:
                self.ledger.load_waiting(await self._waiting())
                self._waiting_at = now
            return False
        was = self.on
        self.weights = await admin.tenant_weights(self.pool)
        if self.on:
            state = await self.pool.fetch(queries["fair_state"])
            self.ledger.load([(r["tenant"], r["weight"], r["usage"], r["attempts"], r["usage_floor"], r["running"])
                              for r in state], await self._waiting())
        self._read_at = self._waiting_at = now
        self._stale = False
        return was != self.on

    async def _waiting(self) -> list[tuple[Key, str]]:
        return [(r["kind"] if r["shape"] is None else (r["kind"], r["shape"]), r["tenant"])
                for r in await self.pool.fetch(queries["fair_waiting"])]

    def wait_left(self) -> float | None:
        """Seconds until a read held back by the throttle is due, or (on) the next read (None: none is)."""
        if not self._stale and not self.on:
            return None
        return max(0.0, self._read_at + self.tuning.fair_share_seconds - time.monotonic())

    async def lease(self, kinds: list[str], slots: list[str], lease_seconds: float) -> tuple[list[LeasedJob], bool]:
        """Lease plain jobs of ``kinds`` for ``slots`` in the fair order. Returns the jobs, and whether
        there may be more (False: no tenant's ticket was left unfilled for want of work)."""
        return await self._lease(list(kinds), slots, lambda tickets: fairlease.lease_fair(
            self.pool, kinds, tickets, slots, lease_seconds))

    async def lease_placed(self, shape: Shape, slots: list[str],
                           lease_seconds: float) -> tuple[list[LeasedJob], bool]:
        """``lease``, for placed jobs of one shape."""
        return await self._lease([(shape.kind, shape.digest)], slots, lambda tickets: fairlease.lease_placed_fair(
            self.pool, shape, tickets, slots, lease_seconds))

    def least(self, shape: Shape) -> float:
        """The least usage per weight among the tenants known to wait for ``shape``: the shape
        whose is least leases first."""
        return self.ledger.least((shape.kind, shape.digest))

    async def _lease(self, keys: list[Key], slots: list[str],
                     statement: Callable[[list[str]], Awaitable[Leased]]) -> tuple[list[LeasedJob], bool]:
        asked = self.ledger.tickets(keys, len(slots), self.tuning.fair_probes)
        if not asked.names:
            return [], False
        leased = await statement(asked.names)
        key_of = (lambda j: j.kind) if isinstance(keys[0], str) else (lambda j: keys[0])
        floors = self.ledger.leased(keys, asked, len(slots), [(key_of(j), t, ticket) for j, t, ticket in leased])
        if floors:  # every server sees the lift at its next refresh
            names = sorted(floors)
            await self.pool.execute(queries["tenant_lift"], names, [floors[n] for n in names])
        jobs = [j for j, _tenant, _ticket in leased]
        # Short: the tenants that left a ticket unfilled are no longer waiting (each short lease drops
        # one at least), and the others may still have work.
        return jobs, len(jobs) == len(slots) or self.ledger.any_waiting(keys)
