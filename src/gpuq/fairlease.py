"""The fair-share lease statements' Python face (``lease_fair``, ``lease_placed_fair`` in
``sql/queries.sql``): jobs by tickets, tenants in the order ``dispatcher/fairorder.py`` gives slots.

A tenant's n-th job (by priority then id, on jobs_fair_idx or jobs_fair_placed_idx: one descent
per tenant and kind or shape) fills its n-th ticket, and the first ``len(slots)`` tickets filled
are leased, the i-th job to ``slots[i]``: a tenant without work leaves its tickets to the next.
Each job comes back with its tenant and the (0-based) ticket it filled. No phase 2: the sweeper
takes expired leases back.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuq.jobs import LeasedJob, Shape
from gpuq.queue import BY_SLOT, leased_job, placed_job
from gpuq.sql import DB, queries

Leased = list[tuple[LeasedJob, str, int]]


async def lease_fair(db: DB, kinds: Sequence[str], tickets: Sequence[str], slots: Sequence[str],
                     lease_seconds: float) -> Leased:
    """Plain jobs of ``kinds`` (not paused, no limit)."""
    if not slots or not kinds or not tickets:
        return []
    rows = await db.fetch(queries["lease_fair"], list(kinds), list(tickets), list(slots), lease_seconds)
    return [(leased_job(r), r["tenant"], r["ticket"] - 1) for r in sorted(rows, key=BY_SLOT)]


async def lease_placed_fair(db: DB, shape: Shape, tickets: Sequence[str], slots: Sequence[str],
                            lease_seconds: float) -> Leased:
    """Placed jobs of one kind and shape (not paused, no limit, none under a limited key); the caller
    chose agents that meet the shape's requirements."""
    if not slots or not tickets:
        return []
    rows = await db.fetch(queries["lease_placed_fair"], shape.kind, shape.digest, list(tickets), list(slots),
                          lease_seconds)
    return [(placed_job(shape, r), r["tenant"], r["ticket"] - 1) for r in sorted(rows, key=BY_SLOT)]
