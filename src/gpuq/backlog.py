"""The backlog per kind and placement shape: what autoscalers scale GPU agents on.

``gpuq_pending_jobs`` and ``gpuq_pending_oldest_seconds`` on ``/metrics``
(docs/design.md, "Autoscaling signals"). The ``backlog`` statement reads them
from the partial pending indexes by index probes alone, so reading them costs
O(kinds and shapes), never O(backlog):

- the count walks at most ``COUNT_CAP`` index entries of each kind and shape
  and stops there: a gauge at the cap means "at least that many";
- the age is how long the next job of each priority level (the first entry of
  the level in the index, the one the dispatcher leases next) has been due,
  the longest of them, over the ``MAX_LEVELS`` highest levels.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuq.jobs import Shape
from gpuq.sql import DB, queries

# Past this many pending jobs of one kind and shape the count stops: reading
# it costs ~5 index pages (and, before a vacuum marks them visible, the heap
# pages of those rows), and 1,000 waiting jobs is past any scaling decision's
# need (KEDA's maxReplicaCount caps the agents long before).
COUNT_CAP = 1000
# Priority levels probed per kind and shape for the oldest wait (one index
# descent each); a kind with more levels in use has its lowest ones unseen.
MAX_LEVELS = 32


@dataclass(frozen=True, slots=True)
class Backlog:
    """One kind and shape's pending work (``shape.plain``: the kind's plain jobs)."""

    shape: Shape
    pending: int  # at most COUNT_CAP
    oldest_seconds: float | None  # None: nothing pending


async def read_backlog(db: DB) -> list[Backlog]:
    """Every kind with plain jobs pending, and every shape ever enqueued (0 when none wait)."""
    return [Backlog(Shape(r["kind"], r["shape"] or "", r["gpus"], r["gpu_memory_mb"], frozenset(r["labels"]),
                          r["model"], r["keyed"]), r["pending"], r["waited"])
            for r in await db.fetch(queries["backlog"], COUNT_CAP, MAX_LEVELS)]
