"""Due ``scheduled`` jobs (retries after their backoff, delayed jobs) become pending, with a NOTIFY."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuq import logs, metrics, queue

log = logs.get("sweeper")

BATCH = 1000  # rows per statement
MAX_BATCHES = 10  # statements per run


@dataclass
class PromoteDue:
    db: Any
    interval_seconds: float = 2.0
    batch: int = BATCH
    max_batches: int = MAX_BATCHES
    name: str = "promote_due"

    async def run_once(self) -> dict[str, int]:
        promoted = 0
        for _ in range(self.max_batches):
            moved = await queue.promote_due(self.db, self.batch)
            promoted += len(moved.pending)
            if len(moved.pending) < self.batch:
                break
        metrics.SWEEP_PROMOTED.inc(promoted)
        if promoted:
            log.info("sweeper.promoted", count=promoted)
        return {"promoted": promoted}
