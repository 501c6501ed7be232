"""Expired leases back to pending: their agent vanished without a disconnect we saw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuq import logs, metrics, queue

log = logs.get("sweeper")

BATCH = 1000  # rows per statement
MAX_BATCHES = 10  # statements per run (bounds one run's work)


@dataclass
class ReclaimExpired:
    db: Any
    interval_seconds: float = 2.0
    batch: int = BATCH
    max_batches: int = MAX_BATCHES
    name: str = "reclaim_expired"

    async def run_once(self) -> dict[str, int]:
        """Up to ``max_batches`` statements; a job out of attempts goes dead instead."""
        pending: list[int] = []
        dead: list[int] = []
        for _ in range(self.max_batches):
            moved = await queue.reclaim_expired(self.db, self.batch)
            pending += moved.pending
            dead += moved.dead
            if len(moved.pending) + len(moved.dead) < self.batch:
                break
        metrics.SWEEP_RECLAIMED.inc(len(pending))
        metrics.SWEEP_DEAD.inc(len(dead))
        if pending:
            log.info("job.reclaimed", count=len(pending), job_ids=pending[:100])
        if dead:
            log.info("job.dead", count=len(dead), job_ids=dead[:100], reason="lease expired after the last attempt")
        return {"reclaimed": len(pending), "dead": len(dead)}
