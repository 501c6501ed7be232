"""Maintenance services: small units, each with ``run_once()`` and an interval, run by one ``Maintainer``.

Each service does a bounded amount of work per ``run_once`` (a few statements
of ``batch`` rows), so no statement grows with the table, and returns the
counts of what it did. Several maintainers may run at once (in every ``gpuq
serve``, or ``gpuq sweep``): SKIP LOCKED keeps them out of each other's way.
River's ``internal/maintenance`` is the model.

- ``ReclaimExpired``: expired leases back to pending (dead when out of attempts);
- ``PromoteDue``: due ``scheduled`` rows (retries, delayed jobs) to pending;
- ``FireSchedules``: periodic jobs whose tick has come (``gpuq schedule``);
- ``ExpireDeadlines``: attempts past their execution timeout fail (``timeout``);
- ``PruneHistory``: done/dead/cancelled rows older than a retention, in windows of ids.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio

from gpuq import logs
from gpuq.db import RETRYABLE_ERRORS
from gpuq.loops import Outage, run_every
from gpuq.maintenance.deadlines import ExpireDeadlines
from gpuq.maintenance.promote import PromoteDue
from gpuq.maintenance.prune import PruneHistory
from gpuq.maintenance.reclaim import ReclaimExpired
from gpuq.maintenance.schedules import FireSchedules
from gpuq.maintenance.service import INTERVAL_SECONDS, Service

log = logs.get("sweeper")


class Maintainer:
    """Runs each service on its own interval; a database outage is logged and retried, never fatal."""

    def __init__(self, services: Sequence[Service]):
        self.services = list(services)

    @classmethod
    def standard(cls, db: Any, interval_seconds: float = INTERVAL_SECONDS,
                 retention_seconds: float | None = None) -> Maintainer:
        """The services ``gpuq serve`` and ``gpuq sweep`` run (retention only when one is set)."""
        services: list[Service] = [ReclaimExpired(db, interval_seconds), PromoteDue(db, interval_seconds),
                                   FireSchedules(db, interval_seconds), ExpireDeadlines(db, interval_seconds)]
        if retention_seconds is not None:
            services.append(PruneHistory(db, retention_seconds, interval_seconds))
        return cls(services)

    async def run_once(self) -> Counter[str]:
        """Every service once, in order; the counts of what they did."""
        report: Counter[str] = Counter()
        for service in self.services:
            report.update(await service.run_once())
        return report

    async def run(self) -> None:
        log.info("sweeper.started", services=[s.name for s in self.services],
                 intervals=[s.interval_seconds for s in self.services])
        async with anyio.create_task_group() as tg:
            for service in self.services:
                tg.start_soon(self._run_service, service)

    async def _run_service(self, service: Service) -> None:
        await run_every(service.interval_seconds, service.run_once, errors=RETRYABLE_ERRORS,
                        outage=Outage(log, "sweeper.tick_failed", service=service.name))


__all__ = ["INTERVAL_SECONDS", "Maintainer", "PromoteDue", "PruneHistory", "ReclaimExpired", "Service"]
