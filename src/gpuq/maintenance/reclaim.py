"""Expired leases back to pending: their agent vanished without a disconnect we saw."""

from __future__ import annotations

from typing import ClassVar

from gpuq import logs, metrics, queue
from gpuq.maintenance.service import Batched

log = logs.get("sweeper")


class ReclaimExpired(Batched):
    name: ClassVar[str] = "reclaim_expired"

    async def run_once(self) -> dict[str, int]:
        """A job out of attempts goes dead instead."""
        moved = await self.batches(queue.reclaim_expired, lambda m: len(m.pending) + len(m.dead))
        pending = [i for m in moved for i in m.pending]
        dead = [i for m in moved for i in m.dead]
        metrics.SWEEP_RECLAIMED.inc(len(pending))
        metrics.SWEEP_DEAD.inc(len(dead))
        if pending:
            log.info("job.reclaimed", count=len(pending), job_ids=pending[:100])
        if dead:
            log.info("job.dead", count=len(dead), job_ids=dead[:100], reason="lease expired after the last attempt")
        return {"reclaimed": len(pending), "dead": len(dead)}
