"""The preemption statements' Python face (``preempted_many``, ``placed_head_priority``, ``plain_head_priority``,
``held_preemption`` in ``sql/queries.sql``; the ask itself is ``admin.preempt``).

A job that yielded goes back like any job moved back (``queue.move_and_notify``: the dispatchers
are told, and waiters of one that ended dead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuq.jobs import Moved, Shape
from gpuq.queue import move_and_notify
from gpuq.sql import DB, queries


async def preempted_many(db: DB, jobs: Sequence[tuple[int, str]]) -> Moved:
    """Preemptible jobs ``(id, lease_token)`` that yielded: pending again where the token still holds
    the lease, one more preemption counted, the attempt not counted while preemptions are left."""
    if not jobs:
        return Moved([], [], set())
    return await move_and_notify(db, "preempted_many", [i for i, _ in jobs], [t for _, t in jobs],
                                 "preempted past max_preemptions during the last attempt")


async def head_priority(db: DB, shape: Shape) -> int | None:
    """The priority of the shape's next pending job that is due (None: none)."""
    return await db.fetchval(queries["placed_head_priority"], shape.kind, shape.digest)


async def plain_head_priority(db: DB, kind: str) -> int | None:
    """The priority of the kind's next pending plain job (None: none, or the kind is paused)."""
    return await db.fetchval(queries["plain_head_priority"], kind)


async def held(db: DB, ids: Sequence[int]) -> list[Any]:
    """How preemption sees these leased jobs: preemptible, priority, ran_seconds, yielding."""
    return list(await db.fetch(queries["held_preemption"], list(ids))) if ids else []
