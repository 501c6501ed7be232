"""The census: queue depth, the backlog per kind and shape and the tenants' usage, read in the background
for ``/metrics``.

One task per ``gpuq serve`` reads them every ``period`` seconds
(``GPUQ_METRICS_SAMPLE_SECONDS``, 5 s) and sets the gauges from them;
``/metrics`` serves what the last read found and reads no database itself.
So the scrapes cost the database nothing, however many scrapers there are
(Prometheus, KEDA, several of each) and however big the backlog and the
history; the census costs one read a period, whatever the scrape rate:

- ``status_counts`` (``gpuq_queue_depth``, ``gpuq_kind_paused``): exact
  counts of the live rows, from the partial indexes: O(live jobs), never
  O(history) (11,200 buffers, ~40 ms, at 105,000 pending jobs);
- ``backlog`` (``gpuq_pending_jobs``, ``gpuq_pending_oldest_seconds``):
  index probes, O(kinds and shapes) (``gpuq.backlog``);
- ``tenant_usage`` (``gpuq_tenant_*``), only while fair share is on as the
  dispatcher last read the weights (``fair_share``): O(tenants with work +
  COUNT_CAP a tenant), never history (``gpuq.admin.tenants``). Off, there is
  no such read and no tenant series.

The rules:

- The first read happens before the server listens: its first scrape has
  every series of the queue.
- A read that took d seconds puts the next one at least d / LOAD_SHARE
  later, so the census takes at most that share of one connection's time
  however big the backlog: its numbers are then older than the period.
- A read that fails leaves the gauges as they were and is tried again a
  period later (an outage is logged once).
- ``gpuq_queue_sample_age_seconds`` says how old the numbers are (NaN before
  the first read): an operator alerts on it, not on a guess.
- The tenants follow the dispatcher's view of fair share: their series come
  (or go) with the first read after it has read that a weight was set (or
  the last one removed): at its first pass, then on a ``*`` notification
  (``gpuq tenant set`` sends one), at most every ``fair_share_seconds``.

The dashboard's trend takes its queue depth from the same reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from gpuq import db, logs, metrics
from gpuq.admin import status_counts, tenants
from gpuq.backlog import Backlog, read_backlog
from gpuq.jobs import StatusCounts
from gpuq.loops import Outage
from gpuq.tenants import Tenant

log = logs.get("census")

# A slow read stretches the period so that reading takes at most this share of the time.
LOAD_SHARE = 0.02


@dataclass(frozen=True, slots=True)
class Sample:
    counts: StatusCounts
    backlog: list[Backlog]
    tenants: list[Tenant]  # none while fair share is off
    read_at: float  # the census clock when the read began: the numbers are at least this old


class Census:
    def __init__(self, pool: Any, period: float, clock: Callable[[], float] = time.monotonic,
                 fair_share: Callable[[], bool] = lambda: False):
        self.pool = pool
        self.period = period
        self.fair_share = fair_share  # is fair share on? Then each read takes the tenants' usage too
        self.clock = clock
        self.latest: Sample | None = None
        self.took = 0.0  # seconds the last read took, failed or not
        self.outage = Outage(log, "census.failed")

    @property
    def current(self) -> Sample | None:
        """The latest sample, unless the reads since have failed."""
        return self.latest if self.outage.since is None else None

    def interval(self) -> float:
        """Seconds from one read to the next: the period, longer after a slow read."""
        return max(self.period, self.took / LOAD_SHARE)

    async def read(self) -> Sample | None:
        """Read the counts, the backlog and (fair share on) the tenants and show them on the gauges
        (None: the database failed)."""
        start = self.clock()
        try:
            counts = await status_counts(self.pool)
            backlog = await read_backlog(self.pool)
            shares = await tenants(self.pool) if self.fair_share() else []
        except db.RETRYABLE_ERRORS as exc:
            self.took = self.clock() - start
            self.outage.failed(exc, round(self.interval(), 3))
            return None
        self.took = self.clock() - start
        self.outage.ended()
        self.latest = Sample(counts, backlog, shares, start)
        metrics.show_queue(counts, backlog, shares, lambda: self.clock() - start)
        return self.latest

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Read now (``task_status.started()`` after it: the server listens then), then every
        ``interval()`` until cancelled."""
        await self.read()
        task_status.started()
        while True:
            await anyio.sleep(self.interval())
            await self.read()
