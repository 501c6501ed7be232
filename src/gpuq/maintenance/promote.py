"""Due ``scheduled`` jobs (retries after their backoff, delayed jobs) become pending, with a NOTIFY."""

from __future__ import annotations

from typing import ClassVar

from gpuq import logs, metrics, queue
from gpuq.maintenance.service import Batched

log = logs.get("sweeper")


class PromoteDue(Batched):
    name: ClassVar[str] = "promote_due"

    async def run_once(self) -> dict[str, int]:
        promoted = sum(len(m.pending) for m in await self.batches(queue.promote_due, lambda m: len(m.pending)))
        metrics.SWEEP_PROMOTED.inc(promoted)
        if promoted:
            log.info("sweeper.promoted", count=promoted)
        return {"promoted": promoted}
